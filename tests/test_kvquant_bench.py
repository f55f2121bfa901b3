"""bench/kvquant_accuracy.py's one-pass attention is decode-faithful: for every query it
equals the reference's chunked prefill (chunks ending where events fire), which is what
token-by-token decoding sees."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from kvquant_accuracy import SimulatedCache  # noqa: E402

from ott_gguf.reference import LayerCache, nuq, prefill, preset  # noqa: E402
from ott_gguf.reference.kvquant import KVQLayer  # noqa: E402
from ott_gguf.reference.rope import Rope  # noqa: E402


@pytest.mark.parametrize("overrides", [dict(), dict(pre_rope=0), dict(sink=0, window=8), dict(pool=3, extra_pool=8)])
def test_one_pass_equals_chunked_decode(overrides):
    rng = np.random.default_rng(0)
    n, H, H_kv, d = 90, 4, 2, 64
    cfg = preset("kvquant2").with_overrides(block=16, group_k=16, **overrides)
    rope = Rope(d, 10000.0)
    tm = SimpleNamespace(n_head=H, n_head_kv=H_kv, head_dim=d, rope=rope)
    tab = KVQLayer(
        -np.ones((H_kv, d), np.float32), np.ones((H_kv, d), np.float32), nuq.uniform_levels(2), nuq.uniform_levels(2)
    )
    q = rng.normal(size=(n, H, d)).astype(np.float32)
    k = rng.normal(0, 0.5, size=(n, H_kv, d)).astype(np.float16).astype(np.float32)
    v = rng.normal(size=(n, H_kv, d)).astype(np.float16).astype(np.float32)
    k_post = rope.apply(k, np.arange(n)).astype(np.float16).astype(np.float32)
    qr = rope.apply(q, np.arange(n)).astype(np.float32)
    sim = SimulatedCache(tm, cfg, [tab])

    def as_t(x):
        return torch.from_numpy(x)[None]

    got = sim.attend(0, as_t(qr), as_t(k), as_t(k_post), as_t(v))[0].numpy()
    layer = LayerCache.new(cfg, 0, H_kv, d, tab)
    want = prefill(layer, qr, k if cfg.pre_rope else k_post, v, rope=rope)
    assert len(layer.heads[0].blocks) >= 4
    # float32 torch against float64; keys rotated after fp16 rounding on both sides
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
