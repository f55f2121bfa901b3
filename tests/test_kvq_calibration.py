"""KVQuant calibration (ott_gguf/kvq_calibration.py) and the torch forward it runs
(ott_gguf/torch_model.py): the forward matches the runtime, the tables are deterministic,
make sense, round-trip through the sidecar, and a sidecar without them is one error line."""

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ott_gguf import cli  # noqa: E402
from ott_gguf.calibrate import collect, write  # noqa: E402
from ott_gguf.errors import InvalidArgumentError, ModelFileError  # noqa: E402
from ott_gguf.kvq_calibration import (  # noqa: E402
    BITS,
    EntryBins,
    collect_kvq,
    qnorm_levels,
    read_sidecar,
    weighted_kmeans,
)
from ott_gguf.model import Model  # noqa: E402
from ott_gguf.reference import nuq  # noqa: E402
from ott_gguf.reference.config import preset  # noqa: E402
from ott_gguf.torch_model import TorchModel  # noqa: E402

N_CTX, N_SEQS = 96, 2  # small windows: the tables' making, not their quality, is tested


@pytest.fixture(scope="module")
def calib_text(wikitext_path):
    return wikitext_path.read_text(encoding="utf-8")[:30000]


@pytest.fixture(scope="module")
def torch_smol(smollm2_path):
    torch.set_num_threads(2)
    return TorchModel(smollm2_path)


def test_torch_forward_matches_the_runtime(torch_smol, smollm2_path, calib_text):
    """The runtime's matmuls read activations rounded to 8-bit blocks (ggml's Q8_1 for the
    Q4_1 weights) where torch keeps float32: about 3 % rms of the logits' spread (0.029
    measured on these tokens), the q8_0 budget of test_reference_forward.py, and the same
    top token almost everywhere (97.7 % measured)."""
    model = Model(smollm2_path, n_ctx=256, n_threads=2, device="cpu")
    ids = model.tokenize(calib_text[:3000])[:128]
    want = model.eval(ids, all_logits=True)
    with torch.no_grad():
        got = torch_smol.forward(torch.tensor([ids]))[0].numpy()
    rel_rms = np.sqrt(np.mean((got - want) ** 2)) / want.std()
    assert rel_rms < 0.05, rel_rms
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_weighted_kmeans_finds_clusters_and_follows_weights():
    rng = np.random.default_rng(0)
    t = np.concatenate([rng.normal(c, 0.01, 4000) for c in (-0.8, -0.3, 0.1, 0.7)]).clip(-1, 1)
    levels = weighted_kmeans(EntryBins.of(t, np.ones_like(t)), 2)
    assert np.abs(levels - [-0.8, -0.3, 0.1, 0.7]).max() < 0.01
    u = rng.uniform(-1, 1, 20000)
    heavy = weighted_kmeans(EntryBins.of(u, np.where(u > 0.5, 100.0, 1.0)), 2)  # sensitivity near 0.75
    plain = weighted_kmeans(EntryBins.of(u, np.ones_like(u)), 2)
    assert (heavy > 0.5).sum() >= 2 and (plain > 0.5).sum() == 1
    assert (
        np.diff(weighted_kmeans(EntryBins.of(np.zeros(10), np.ones(10)), 3)) > 0
    ).all()  # degenerate data: still ascending


@pytest.fixture(scope="module")
def kvq_sidecar(tmp_path_factory, smollm2_path, calib_text):
    d = tmp_path_factory.mktemp("kvq")
    model = d / smollm2_path.name
    shutil.copy(smollm2_path, model)
    kvq = collect_kvq(model, calib_text, n_ctx=N_CTX, n_seqs=N_SEQS, block=16, n_threads=2, progress=False)
    cal = collect(model, calib_text, n_ctx=N_CTX, n_seqs=N_SEQS, n_threads=2, device="cpu", progress=False)
    path = d / "side.gguf"
    write(type(cal)(**{**cal.__dict__, "kvq": kvq}), path)
    return model, path, kvq


def test_tables_deterministic_and_round_trip(kvq_sidecar, calib_text):
    model, path, kvq = kvq_sidecar
    again = collect_kvq(model, calib_text, n_ctx=N_CTX, n_seqs=N_SEQS, block=16, n_threads=2, progress=False)
    back = read_sidecar(path, kvq.n_layer)
    assert back.outliers == (0, 100) and back.block == 16
    for il in range(kvq.n_layer):
        for table in ("k_range", "codebook_k", "codebook_v", "qnorm_k", "qnorm_v"):
            a, b, c = (getattr(x, table)[il] for x in (kvq, again, back))
            assert a.keys() == b.keys() == c.keys()
            assert all((a[key] == b[key]).all() and (a[key] == c[key]).all() for key in a), (il, table)


def test_qnorm_keeps_the_mean_and_spread():
    """Fisher weights pull a codebook toward the sensitive entries, so the entries it codes
    come back with another mean and a smaller spread; the Q-Norm codebook restores both
    (within 1 %), and it still ascends."""
    rng = np.random.default_rng(3)
    t = np.clip(rng.gamma(2.0, 0.15, 60000) - 0.4, -1, 1).astype(np.float32)  # skewed, in -1 .. 1
    w = np.where(t > 0.2, 50.0, 1.0)
    for bits in (2, 3):
        levels = weighted_kmeans(EntryBins.of(t, w), bits)
        qn = qnorm_levels(EntryBins.of(t), levels)
        before = levels[nuq.nearest_codes(t, levels)]
        after = qn[nuq.nearest_codes(t, qn)]
        assert abs(before.mean() - t.mean()) > 0.02 * t.std() or abs(before.std() / t.std() - 1) > 0.02
        assert abs(after.mean() - t.mean()) < 0.01 * t.std()
        assert abs(after.std() / t.std() - 1) < 0.01
        assert (np.diff(qn) > 0).all()


def test_tables_describe_the_keys(kvq_sidecar):
    """Thresholds bracket the channel (1 % ones inside the min-max ones), codebooks ascend in
    -1 .. 1, and they are not uniform (the k-means moved them)."""
    _, _, kvq = kvq_sidecar
    for il in range(kvq.n_layer):
        for rope in ("pre", "post"):
            full, one = kvq.k_range[il][(rope, 0)], kvq.k_range[il][(rope, 100)]
            assert (full[..., 0] <= one[..., 0]).all() and (one[..., 1] <= full[..., 1]).all()
            assert (one[..., 0] < one[..., 1]).all()
        for b in BITS:
            for lv in (kvq.codebook_k[il][("pre", 100, b)], kvq.codebook_v[il][(100, b)]):
                assert len(lv) == 2**b and (np.diff(lv) > 0).all() and lv[0] >= -1 and lv[-1] <= 1
    layers = kvq.layers(preset("kvquant2"))
    assert len(layers) == kvq.n_layer and layers[3].k_lo.shape == (3, 64)
    uniform = kvq.layers(preset("kvquant2").with_overrides(uniform=1))
    assert uniform[3].levels_k.tolist() == pytest.approx([-1, -1 / 3, 1 / 3, 1])
    assert not np.allclose(layers[3].levels_k, uniform[3].levels_k, atol=0.02)
    qn = kvq.layers(preset("kvquant2").with_overrides(qnorm=1))
    assert not np.array_equal(layers[3].levels_k, qn[3].levels_k)
    assert (np.diff(qn[3].levels_k) > 0).all() and (np.diff(qn[3].levels_v) > 0).all()


def test_sidecar_errors_are_one_line(kvq_sidecar, tmp_path):
    model, path, kvq = kvq_sidecar
    with pytest.raises(InvalidArgumentError, match="no KVQuant thresholds for 2 % outliers") as e:
        kvq.layers(preset("kvquant2").with_overrides(outliers=200))
    assert "\n" not in str(e.value)
    rotations_only = tmp_path / "rot.gguf"
    cal = collect(model, "x " * 4000, n_ctx=N_CTX, n_seqs=1, n_threads=2, device="cpu", progress=False)
    write(cal, rotations_only)
    with pytest.raises(ModelFileError, match="no KVQuant tables"):
        read_sidecar(rotations_only, kvq.n_layer)
    with pytest.raises(InvalidArgumentError, match="another layer count"):
        read_sidecar(path, kvq.n_layer + 1)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ModelFileError, match="cut.gguf"):
        read_sidecar(truncated, kvq.n_layer)


def test_cli_outlier_knob_is_one_line(capsys, smollm2_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["info", str(smollm2_path), "--kv", "kvquant2", "--kv-outliers", "11"])
    assert e.value.code == 2 and "--kv-outliers" in capsys.readouterr().err


def test_cli_kvquant_only_sidecar(tmp_path, smollm2_path, calib_text, capsys):
    """calibrate --kvquant-only: a sidecar with the model's record and KVQuant tables, no
    rotations (a calibrated rotation asked of it is one error line)."""
    text, out = tmp_path / "text.txt", tmp_path / "kvq.gguf"
    text.write_text(calib_text, encoding="utf-8")
    assert (
        cli.main(
            [
                "calibrate",
                str(smollm2_path),
                "-f",
                str(text),
                "-o",
                str(out),
                "--kvquant-only",
                "-c",
                "64",
                "--windows",
                "1",
                "-t",
                "2",
                "--kv-outliers",
                "0.5",
            ]
        )
        == 0
    )
    assert "KVQuant tables, 30 layers, from 64 tokens" in capsys.readouterr().out
    kvq = read_sidecar(out, 30)
    assert kvq.outliers == (50,) and kvq.n_layer == 30
    from ott_gguf.reference.rotation import CALIBRATED

    with pytest.raises(ModelFileError, match="no tensor 'ott.rot_v.0'"):
        Model(
            smollm2_path,
            n_ctx=32,
            kv=preset("ott2").with_overrides(rot_v=CALIBRATED),
            kv_calib=out,
            n_threads=1,
            device="cpu",
        )
