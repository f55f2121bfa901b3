"""Where the checkpoint is: a local directory, or a Hub repo id fetched by huggingface_hub.

Only the files the converter reads are downloaded (into huggingface_hub's cache, reused next
time): config, tokenizer files and the safetensors weights, or the PyTorch .bin weights
when the repo has no safetensors. With HF_HUB_OFFLINE=1 the cached snapshot is used.
"""

from __future__ import annotations

import re
from pathlib import Path

from ott_gguf.errors import InvalidArgumentError, ModelFileError

# files read besides the weights
METADATA_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]
SAFETENSORS_FILES = ["model.safetensors", "model-*.safetensors", "model.safetensors.index.json"]
TORCH_FILES = ["pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json"]

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id} (revision {revision or 'main'})"
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise ModelFileError(f"{repo_id}: no such repository on the Hugging Face Hub (or it is private)") from None
    except RevisionNotFoundError:
        raise ModelFileError(f"{where}: no such revision on the Hugging Face Hub") from None
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise ModelFileError(
                f"{where}: no complete snapshot in the Hugging Face cache "
                f"{constants.HF_HUB_CACHE}, and HF_HUB_OFFLINE=1 forbids downloading"
            ) from None
        raise ModelFileError(f"{where}: cannot download from the Hugging Face Hub: {_first_line(e)}") from None
    except HFValidationError as e:
        raise InvalidArgumentError(f"{repo_id}: not a valid Hub repo id ({_first_line(e)})") from None
    except OSError as e:  # HTTP errors and file system errors of the cache
        raise ModelFileError(f"{where}: cannot fetch from the Hugging Face Hub: {_first_line(e)}") from None


def resolve_source(src: str, revision: str | None) -> Path:
    """The local directory holding the checkpoint named by `src`."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InvalidArgumentError(f"{src}: expected a checkpoint directory, got a file")
        if revision is not None:
            raise InvalidArgumentError(f"--revision applies to Hub repo ids, not to the directory {src}")
        return path
    if not _REPO_ID.match(src) or src.startswith("."):
        raise ModelFileError(f"{src}: no such directory (and not a Hub repo id org/name)")
    directory = _snapshot(src, revision, METADATA_FILES + SAFETENSORS_FILES)
    if any(directory.glob("model*.safetensors")):
        return directory
    return _snapshot(src, revision, METADATA_FILES + TORCH_FILES)
