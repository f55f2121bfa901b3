"""bench/llama7b_gguf.py's ensure(): a made-up KVQuant sidecar beside the files it writes, never
beside another model."""

import shutil
import sys
from pathlib import Path

from make_gguf import write_random_model
from ott_gguf.model import Context, Weights, default_calibration
from ott_gguf.reference import preset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import llama7b_gguf  # noqa: E402


def test_sidecar_beside_a_random_model(tmp_path, monkeypatch):
    """A file with the script's general.name gets the sidecar when a KVQuant mode is asked (not
    for other modes), and a kvquant2 context then decodes on it."""
    path = write_random_model(tmp_path / "r.gguf", arch="llama")
    monkeypatch.setattr(llama7b_gguf, "NAME", "random-llama-test")  # make_gguf's general.name
    sidecar = default_calibration(path)
    llama7b_gguf.ensure(path, ["ottr2tg", "f16"])
    assert not sidecar.exists()
    llama7b_gguf.ensure(path, ["f16", "kvquant2:outliers=50"])
    assert sidecar.exists()
    w = Weights(path)
    ctx = Context(w, n_ctx=64, kv=preset("kvquant2"))
    assert ctx.eval([1, 2, 3], 0).shape[-1] == w.info.n_vocab
    ctx.close()
    w.close()


def test_no_sidecar_beside_a_real_model(tmp_path, smollm2_path):
    """Another model (here SmolLM2) gets none: its sidecar must come from calibration."""
    path = tmp_path / "smollm2.gguf"
    shutil.copy(smollm2_path, path)
    assert not llama7b_gguf.written_here(path)
    llama7b_gguf.ensure(path, ["kvquant2"])
    assert not default_calibration(path).exists()
