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


def read_json(path: Path) -> Any:
    """Parse a JSON file, raising ModelFileError that names the file on bad syntax."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
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
    if not isinstance(architectures, list) or not architectures:
        raise ModelFileError(f"{path}: missing 'architectures' (a non-empty list)")
    return config


def parse_hparams(config: dict[str, Any], path: Path) -> HParams:
    """config: config.json over the architecture's defaults (those of its transformers class)."""

    def need(key: str) -> Any:
        if config.get(key) is None:
            raise ModelFileError(f"{path}: missing '{key}'")
        return config[key]

    n_embd = int(need("hidden_size"))
    n_head = int(need("num_attention_heads"))
    head_dim = config.get("head_dim")
    # transformers < 5 writes "rope_scaling" (with "type" or "rope_type"); 5.x writes
    # "rope_parameters", which also holds rope_theta
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    return HParams(
        architecture=str(config["architectures"][0]),
        n_layer=int(need("num_hidden_layers")),
        n_embd=n_embd,
        n_ff=int(need("intermediate_size")),
        n_head=n_head,
        n_head_kv=int(config.get("num_key_value_heads") or n_head),
        n_embd_head=int(head_dim) if head_dim is not None else n_embd // n_head,
        head_dim_given=head_dim is not None,
        n_vocab=int(need("vocab_size")),
        n_ctx_train=int(need("max_position_embeddings")),
        rope_theta=float(rope["rope_theta"] if "rope_theta" in rope else need("rope_theta")),
        rms_eps=float(need("rms_norm_eps")),
        rope_scaling=_rope_scaling(rope),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        path=path,
        config=config,
    )
