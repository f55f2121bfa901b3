"""The key tiers' query scale from the weights (ott_gguf/tier_scale.py) on the real models."""

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from ott_gguf.model import Weights


def _query_energy(path, il: int, n_q: int) -> np.ndarray:
    """Σ_j (W_q[c, j]·g_j)² + b_q[c]² of layer il, straight from the file (float64 [n_q])."""
    tensors = {t.name: t for t in GGUFReader(path).tensors}

    def get(name):
        t = tensors.get(f"blk.{il}.{name}")
        if t is None:
            return None
        return dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape]))).astype(np.float64)

    e = ((get("attn_q.weight") * get("attn_norm.weight")) ** 2).sum(axis=1)
    b = get("attn_q.bias")
    return e if b is None else e + b**2


@pytest.mark.parametrize("which", ["smollm2_path", pytest.param("qwen05_path", marks=pytest.mark.slow)])
def test_query_scale_from_the_weights(request, which):
    """u is the square root of the query energy per channel, summed over a KV head's query
    heads, averaged over each RoPE pair, normalized to a mean square of 1 per head."""
    path = request.getfixturevalue(which)
    w = Weights(path)
    i = w.info
    u = w.tier_scale()
    assert u.shape == (i.n_layer, i.n_head_kv, i.n_embd_head) and u.dtype == np.float32
    assert w.tier_scale() is u  # computed once
    assert np.allclose((u.astype(np.float64) ** 2).mean(axis=2), 1.0, rtol=1e-5)
    hd, rep = i.n_embd_head, i.n_head // i.n_head_kv
    neox = i.rope_type == 2
    for il in (0, i.n_layer - 1):
        e = _query_energy(path, il, i.n_head * hd).reshape(i.n_head_kv, rep, hd).sum(axis=1)
        pair = np.r_[hd // 2 : hd, 0 : hd // 2] if neox else np.arange(hd).reshape(-1, 2)[:, ::-1].reshape(-1)
        e = (e + e[:, pair]) / 2
        want = np.sqrt(e / e.mean(axis=1, keepdims=True))
        assert np.allclose(u[il], want, rtol=1e-5)
    # channels of one head differ severalfold somewhere: what the ranking is for
    assert (u.max(axis=2) / u.min(axis=2)).max() > 3
    w.close()
