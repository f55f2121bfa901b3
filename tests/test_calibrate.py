"""Calibration sidecars (ott_gguf/calibrate.py, native/src/kv/kv_calib.h): deterministic,
read back by the runtime exactly as written, and refused with one line when they do not fit."""

import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from ott_gguf.calibrate import Calibration, collect, write
from ott_gguf.errors import InvalidArgumentError, ModelFileError
from ott_gguf.model import Model, default_calibration
from ott_gguf.reference.config import preset
from ott_gguf.reference.rotation import CALIBRATED

N_CTX, N_SEQS = 256, 2  # small windows: the statistics, not their quality, are tested


@pytest.fixture(scope="module")
def calib_text(wikitext_path):
    return wikitext_path.read_text(encoding="utf-8")[:60000]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory, smollm2_path, calib_text):
    """SmolLM2's sidecar, written beside a copy of the model (where Model looks by default)."""
    d = tmp_path_factory.mktemp("calib")
    model = d / smollm2_path.name
    shutil.copy(smollm2_path, model)
    cal = collect(model, calib_text, n_ctx=N_CTX, n_seqs=N_SEQS, n_threads=2, device="cpu", progress=False)
    write(cal, default_calibration(model))
    return model, cal


def tensors(path):
    return {t.name: np.array(t.data) for t in GGUFReader(path).tensors}


def test_deterministic_and_orthogonal(sidecar, calib_text, tmp_path):
    model, cal = sidecar
    again = tmp_path / "again.gguf"
    write(collect(model, calib_text, n_ctx=N_CTX, n_seqs=N_SEQS, n_threads=1, device="cpu", progress=False), again)
    assert default_calibration(model).read_bytes() == again.read_bytes()
    assert cal.n_tokens == N_CTX * N_SEQS and len(cal.model_hash) == 16
    r = cal.rot_v.astype(np.float64)  # [L, H, d, d]
    assert np.abs(r @ r.transpose(0, 1, 3, 2) - np.eye(r.shape[-1])).max() < 1e-5


def test_runtime_stores_the_calibrated_rotation(sidecar, calib_text):
    """The window of a calibrated cache holds fp16(R (x - c)) of what the f16 cache holds:
    in layer 0, whose inputs are the same in both, to fp16 rounding; deeper, to the drift of
    30 layers run with other attention kernels and roundings (up to 6 % seen), far below what
    another layer's or head's rotation would give (about 100 %)."""
    model, cal = sidecar
    cfg = preset("ott2").with_overrides(rot_k=CALIBRATED, rot_v=CALIBRATED)
    rotated = Model(model, n_ctx=64, kv=cfg, n_threads=2, device="cpu")  # the sidecar found beside it
    plain = Model(model, n_ctx=64, n_threads=2, device="cpu")
    ids = rotated.tokenize(calib_text[:2000])[:40]
    rotated.eval(ids)
    plain.eval(ids)
    for il in range(rotated.info.n_layer):
        for h in range(rotated.info.n_head_kv):
            got, src = rotated.kv_head_state(il, 0, h), plain.kv_head_state(il, 0, h)
            for kind, rot, centre in (("k", cal.rot_k, cal.center_k), ("v", cal.rot_v, cal.center_v)):
                x = getattr(src, f"window_{kind}").astype(np.float64)
                want = (x - centre[il, h]) @ rot[il, h].T.astype(np.float64)
                err = np.abs(getattr(got, f"window_{kind}").astype(np.float64) - want)
                assert np.linalg.norm(err) < 0.15 * np.linalg.norm(want), (il, h, kind)
                if il == 0:
                    # each side rounds to fp16 once (2^-11 relative): the rotated one its result,
                    # the plain one its input x, whose rounding the rotation spreads over the row
                    rms = np.sqrt((x**2).mean(axis=1, keepdims=True))
                    assert (err <= 2**-10 * (np.abs(want) + rms)).all(), (h, kind, err.max())


def corrupt(src, dst, **changes):
    """A copy of sidecar src with some tensors replaced (name -> array) or dropped (None)."""
    from gguf import GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(str(dst), arch="ott-kvcalib")
    for k, f in r.fields.items():
        if k.startswith("ott.calib."):
            v = f.contents()
            (w.add_string if isinstance(v, str) else w.add_uint64 if k.endswith("n_tokens") else w.add_uint32)(k, v)
    for t in r.tensors:
        data = changes.get(t.name, np.array(t.data))
        if data is not None:
            w.add_tensor(t.name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(
    "case",
    ["missing", "truncated", "another-model", "another-file", "not-orthogonal", "wrong-shape", "nan", "dropped-tensor"],
)
def test_bad_sidecars_are_one_error(sidecar, qwen05_path, tmp_path, case):
    model, cal = sidecar
    good = default_calibration(model)
    cfg = preset("ott2").with_overrides(rot_v=CALIBRATED)
    path, target, error = tmp_path / "side.gguf", model, InvalidArgumentError
    rot = tensors(good)["ott.rot_v.3"]
    if case == "missing":
        error = ModelFileError
    elif case == "truncated":
        path.write_bytes(good.read_bytes()[:3000])
        error = ModelFileError
    elif case == "another-model":
        shutil.copy(good, path)
        target = qwen05_path
    elif case == "another-file":
        shutil.copy(good, path)
        target = tmp_path / "changed.gguf"
        data = bytearray(model.read_bytes())
        data[-1000] ^= 1
        target.write_bytes(data)
    else:
        changes = {
            "not-orthogonal": {"ott.rot_v.3": rot * 1.01},
            "wrong-shape": {"ott.rot_v.3": rot[:, :-1, :-1]},
            "nan": {"ott.center_v.3": np.full_like(tensors(good)["ott.center_v.3"], np.nan)},
            "dropped-tensor": {"ott.rot_v.3": None},
        }[case]
        corrupt(good, path, **changes)
        error = ModelFileError
    with pytest.raises(error) as e:
        Model(target, n_ctx=32, kv=cfg, kv_calib=path, n_threads=1, device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and ("side.gguf" in msg)


def test_calibration_needs_enough_text(smollm2_path):
    with pytest.raises(InvalidArgumentError, match="fewer than one window"):
        collect(smollm2_path, "too short", n_ctx=N_CTX, n_seqs=1, n_threads=1, device="cpu", progress=False)


def test_record_says_what_it_was_computed_from(sidecar):
    model, cal = sidecar
    f = {
        k: v.contents() for k, v in GGUFReader(default_calibration(model)).fields.items() if k.startswith("ott.calib.")
    }
    assert f["ott.calib.architecture"] == "llama" and f["ott.calib.block_count"] == 30
    assert f["ott.calib.model_hash"] == f"{Model(model, n_ctx=16, n_threads=1, device='cpu').fingerprint():016x}"
    assert f["ott.calib.n_tokens"] == N_CTX * N_SEQS and isinstance(cal, Calibration)
