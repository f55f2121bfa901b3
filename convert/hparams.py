"""The hyperparameters of a Hugging Face checkpoint, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ott_gguf.errors import ModelFileError


@dataclass(frozen=True)
class HParams:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_embd_head: int  # per-head size (config "head_dim", else n_embd / n_head)
    head_dim_given: bool  # config.json states head_dim explicitly
    n_vocab: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    rope_scaling: dict[str, Any]  # {"rope_type": ..., "factor": ...}; empty when none
    tie_word_embeddings: bool
    path: Path  # the config.json, for messages
    config: dict[str, Any] = field(repr=False)


# Ranges of config.json's sizes: those the runtime accepts in a GGUF file (native/src/model.cpp)
LIMITS = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, 1 << 24),
}


def read_json(path: Path) -> Any:
    """Parse a JSON file, raising ModelFileError that names the file on bad syntax or encoding."""
    if path.exists() and not path.is_file():  # a FIFO or a device would block
        raise ModelFileError(f"{path}: not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ModelFileError(f"{path}: JSON nested too deeply") from None
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read ({e.strerror})") from None


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling parameters with a lower-case "rope_type"; empty when there is none."""
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in (None, "default"):
        return {}
    return {**rope, "rope_type": str(rope_type).lower()}


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{directory}: no config.json (not a Hugging Face model directory)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ModelFileError(f"{path}: missing 'architectures' (a non-empty list of names)")
    return config


def parse_hparams(config: dict[str, Any], path: Path) -> HParams:
    """config: config.json over the architecture's defaults (those of its transformers class)."""

    def need(key: str, source: dict[str, Any] = config) -> Any:
        if source.get(key) is None:
            raise ModelFileError(f"{path}: missing '{key}'")
        return source[key]

    def size(key: str, default: int | None = None) -> int:
        value = need(key) if default is None or config.get(key) is not None else default
        lo, hi = LIMITS[key]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ModelFileError(f"{path}: '{key}' = {value!r} must be an integer in [{lo}, {hi}]")
        return value

    def positive(key: str, source: dict[str, Any], hi: float) -> float:
        value = need(key, source)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0 < value <= hi):
            raise ModelFileError(f"{path}: '{key}' = {value!r} must be a finite number in (0, {hi:g}]")
        return float(value)

    n_embd = size("hidden_size")
    n_head = size("num_attention_heads")
    n_head_kv = size("num_key_value_heads", n_head)
    if n_head % n_head_kv:
        raise ModelFileError(
            f"{path}: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}"
        )
    head_given = config.get("head_dim") is not None
    if not head_given and n_embd % n_head:
        raise ModelFileError(f"{path}: hidden_size {n_embd} is not a multiple of num_attention_heads {n_head}")
    n_embd_head = size("head_dim") if head_given else n_embd // n_head
    if n_embd_head % 2:
        raise ModelFileError(f"{path}: the head size {n_embd_head} is odd (rope turns pairs of dimensions)")
    # transformers < 5 writes "rope_scaling" (with "type" or "rope_type"); 5.x writes
    # "rope_parameters", which also holds rope_theta
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelFileError(f"{path}: 'rope_parameters' / 'rope_scaling' must be an object, not {rope!r}")
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ModelFileError(f"{path}: 'tie_word_embeddings' = {tie!r} must be true or false")
    return HParams(
        architecture=config["architectures"][0],
        n_layer=size("num_hidden_layers"),
        n_embd=n_embd,
        n_ff=size("intermediate_size"),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head=n_embd_head,
        head_dim_given=head_given,
        n_vocab=size("vocab_size"),
        n_ctx_train=size("max_position_embeddings"),
        rope_theta=positive("rope_theta", rope if "rope_theta" in rope else config, 3.4e38),
        rms_eps=positive("rms_norm_eps", config, 1.0),
        rope_scaling=_rope_scaling(rope),
        tie_word_embeddings=tie,
        path=path,
        config=config,
    )
