"""The runtime's KVQuant cache (CPU) against the numpy specification, with the harness of
test_kv_native.py: a random F32 model decodes token chunks through the native cache, and
one reference LayerCache per layer, fed the fp16 K/V the native cache stored (keys before
RoPE), gives the expected stores and, with float64 attention that rotates each key at its
position, the expected logits.

- stores, bit for bit: sink and window rows, and every KVQuant head-block byte for byte
  (codes, value zero and scale, sparse indices and values; kv_layout.h's layout);
- logits within test_kv_native's LOGIT_BUDGET per token (float32 matmuls, the native
  attention's float32 softmax, and its float32 cos/sin table against float64 rotations).

The tables come from a made-up sidecar (make_gguf.write_kvq_sidecar): the cache must follow
whatever calibrated tables it is given. Calibrated tables and accuracy: docs/kvquant.md.
"""

import numpy as np
import pytest

from make_gguf import write_kvq_sidecar
from ott_gguf import cli
from ott_gguf.errors import InvalidArgumentError, ModelFileError
from ott_gguf.kvq_calibration import read_sidecar
from ott_gguf.model import Model
from ott_gguf.reference import preset
from reference_forward import ReferenceModel
from test_kv_native import LOGIT_BUDGET, ReferenceRun, random_model, rel_err, run_probed_chunks, stored_kv
from test_kvq_native import block_bytes

# small blocks so that a few hundred tokens cross many events; 1 % outliers of a 16 x 64
# block are 10 sparse entries of keys and 10 of values
SMALL = preset("kvquant2").with_overrides(block=16, group_k=16, sink=2, window=4)


def assert_same_stores(model: Model, run: ReferenceRun) -> None:
    """Sink, window and head-blocks of every layer and KV head, bit for bit."""
    for il, layer in enumerate(run.layers):
        for h, head in enumerate(layer.heads):
            st = model.kv_head_state(il, 0, h)
            where = f"layer {il} head {h} at {head.n_tokens} tokens"
            assert st.n_tokens == head.n_tokens, where
            for name, ref, k, v in [
                ("sink", head.sink, st.sink_k, st.sink_v),
                ("window", head.window, st.window_k, st.window_v),
            ]:
                assert k.shape == ref.k.shape, f"{where}: {name} holds {len(k)} not {len(ref)}"
                assert (k.view(np.uint16) == ref.k.view(np.uint16)).all(), f"{where}: {name} K"
                assert (v.view(np.uint16) == ref.v.view(np.uint16)).all(), f"{where}: {name} V"
            assert len(st.blocks) == len(head.blocks), where
            for j, rb in enumerate(head.blocks):
                want = np.frombuffer(block_bytes(rb, layer.cfg, layer.head_dim), np.uint8)
                assert (st.blocks[j] == want).all(), f"{where}: block {j}"


def kvq_run(tmp_path, cfg, head_dim: int, gqa: int, n_layer: int = 2):
    path = random_model(tmp_path, head_dim, gqa, n_layer=n_layer)
    sidecar = write_kvq_sidecar(path, tmp_path / "tables.kvcalib.gguf")
    model = Model(path, n_ctx=512, n_threads=2, kv=cfg, kv_calib=sidecar, device="cpu")
    tables = read_sidecar(sidecar, model.info.n_layer).layers(model.kv_config)
    return model, ReferenceRun(ReferenceModel(path), cfg, model, kvq=tables), path, sidecar


CASES = [
    # id, head_dim, gqa, config, tokens, chunk sizes (at most window + 1: stored_kv reads the
    # chunk's K/V back from the fp16 stores)
    ("hd64-gqa3-2bit", 64, 3, SMALL, 180, [1, 3, 4, 2]),
    ("hd128-gqa1-3bit", 128, 1, SMALL.with_overrides(bits_k=3, bits_v=3), 120, [4, 1]),
    ("hd64-gqa7-4bit-no-outliers", 64, 7, SMALL.with_overrides(bits_k=4, bits_v=4, outliers=0), 100, [2, 3]),
    ("hd64-gqa3-post-rope", 64, 3, SMALL.with_overrides(pre_rope=0), 120, [1, 4]),
    ("hd64-gqa1-no-sink-window1", 64, 1, SMALL.with_overrides(sink=0, window=1), 70, [1]),
    # a block longer than the attention's tile of 128 keys (tiles of 128 and 8), and a head
    # size that is not a multiple of 8 (the value rows' scalar tail)
    ("hd64-gqa3-block136", 64, 3, SMALL.with_overrides(block=136, group_k=136), 290, [4, 1]),
    ("hd36-gqa2-2bit", 36, 2, SMALL, 90, [3, 1]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kvquant_cache_matches_the_spec(tmp_path, case):
    _, head_dim, gqa, cfg, n_tokens, sizes = case
    model, run, _, _ = kvq_run(tmp_path, cfg, head_dim, gqa)
    assert model.kv == "custom" and model.kv_config.kvq
    tokens = np.random.default_rng(1).integers(0, model.n_vocab, n_tokens).tolist()
    i, c = 0, 0
    while i < len(tokens):
        n = min(sizes[c % len(sizes)], len(tokens) - i)
        ours = model.eval(tokens[i : i + n], all_logits=True)
        theirs = run.chunk(tokens[i : i + n], stored_kv(model, n))
        assert rel_err(ours, theirs).max() < LOGIT_BUDGET, f"chunk at {i}"
        i, c = i + n, c + 1
        if c % 4 == 0 or i == len(tokens):
            assert_same_stores(model, run)
    assert len(run.layers[0].heads[0].blocks) >= 2  # events happened


def test_large_chunks_span_events(tmp_path):
    """Prompt chunks longer than a block (several events on the way): each token attends to
    the cache as it stood plus the chunk causally, and the chunk is quantized as it is
    appended. One layer: a context whose window never quantizes provides the same K/V."""
    model, run, path, sidecar = kvq_run(tmp_path, SMALL, 64, 3, n_layer=1)
    probe = Model(path, n_ctx=512, n_threads=2, kv=SMALL.with_overrides(window=400), kv_calib=sidecar)
    tokens = np.random.default_rng(2).integers(0, model.n_vocab, 260).tolist()
    run_probed_chunks(model, probe, run, tokens, [40, 1, 37, 64, 100, 3], assert_same_stores)


def test_memory_accounting(tmp_path):
    """kv_stats counts what the footprint formula counts (reference/footprint.py)."""
    model, _, _, _ = kvq_run(tmp_path, SMALL, 64, 3)
    model.eval(np.random.default_rng(3).integers(0, model.n_vocab, 150).tolist())
    stats, formula = model.kv_stats(), model.kv_footprint(150)
    assert stats.bytes_used == formula.total_bytes
    assert stats.bits_per_element == pytest.approx(formula.bits_per_element)


def test_sidecar_errors(tmp_path, capsys):
    """No sidecar, another model's, or tables for an outlier share it lacks: one error."""
    path = random_model(tmp_path, 64, 3)
    (tmp_path / "o").mkdir()
    other = random_model(tmp_path / "o", 64, 3, seed=1)
    with pytest.raises(ModelFileError, match="calibrate MODEL -f TEXT --kvquant"):
        Model(path, n_ctx=64, kv="kvquant2")
    wrong = write_kvq_sidecar(other, tmp_path / "other.kvcalib.gguf")
    with pytest.raises(InvalidArgumentError, match="for another model file"):
        Model(path, n_ctx=64, kv="kvquant2", kv_calib=wrong)
    right = write_kvq_sidecar(path, tmp_path / "right.kvcalib.gguf")
    cut = tmp_path / "cut.kvcalib.gguf"
    cut.write_bytes(right.read_bytes()[: right.stat().st_size // 2])
    with pytest.raises(ModelFileError, match=r"cut.kvcalib.gguf: cannot read the calibration sidecar \(truncated"):
        Model(path, n_ctx=64, kv="kvquant2", kv_calib=cut)
    with pytest.raises(InvalidArgumentError, match="no KVQuant thresholds for 0.5 % outliers"):
        Model(path, n_ctx=64, kv=preset("kvquant2").with_overrides(outliers=50), kv_calib=right)
    with pytest.raises(InvalidArgumentError, match="pool=3 does not apply to KVQuant"):  # the spec's composition only
        Model(path, n_ctx=64, kv=preset("kvquant2").with_overrides(pool=3), kv_calib=right)
    with pytest.raises(InvalidArgumentError, match="no Q-Norm codebooks"):  # tables without their Q-Norm twins
        Model(path, n_ctx=64, kv=preset("kvquant2").with_overrides(qnorm=1), kv_calib=right)
    assert cli.main(["run", str(path), "--kv", "kvquant2", "-p", "hi", "-n", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--kvquant" in err[0]
    # info needs no sidecar for the footprint, but one named with --kv-calib is read
    assert cli.main(["info", str(path), "--kv", "kvquant2"]) == 0
    assert cli.main(["info", str(path), "--kv", "kvquant2", "--kv-calib", str(right)]) == 0
    capsys.readouterr()
    assert cli.main(["info", str(path), "--kv", "kvquant2", "--kv-calib", str(wrong)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "for another model file" in err[0]
