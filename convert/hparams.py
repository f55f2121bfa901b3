"""The hyperparameters of a Hugging Face checkpoint, read from its config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ott_gguf.errors import ModelFileError


@dataclass(frozen=True)
class HParams:
    architecture: str            # HF class name, e.g. "LlamaForCausalLM"
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_embd_head: int             # per-head size (config "head_dim", else n_embd / n_head)
    head_dim_given: bool         # config.json states head_dim explicitly
    n_vocab: int
    n_ctx_train: int | None
    rope_theta: float | None
    rms_eps: float | None
    rope_scaling: dict[str, Any]  # {"rope_type": ..., "factor": ...}; empty when none
    tie_word_embeddings: bool
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


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any]:
    # transformers < 5 writes "rope_scaling" with "type" or "rope_type"; 5.x writes "rope_parameters"
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in (None, "default"):
        return {}
    rope["rope_type"] = str(rope_type).lower()
    return rope


def load_hparams(directory: Path) -> HParams:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{directory}: no config.json (not a Hugging Face model directory)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}: expected a JSON object")

    def need(key: str) -> Any:
        if key not in config:
            raise ModelFileError(f"{path}: missing '{key}'")
        return config[key]

    architectures = need("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise ModelFileError(f"{path}: 'architectures' must be a non-empty list")

    n_embd = int(need("hidden_size"))
    n_head = int(need("num_attention_heads"))
    head_dim = config.get("head_dim")
    rope = _rope_scaling(config)
    rope_theta = config.get("rope_theta", rope.get("rope_theta"))
    return HParams(
        architecture=str(architectures[0]),
        n_layer=int(need("num_hidden_layers")),
        n_embd=n_embd,
        n_ff=int(need("intermediate_size")),
        n_head=n_head,
        n_head_kv=int(config.get("num_key_value_heads") or n_head),
        n_embd_head=int(head_dim) if head_dim is not None else n_embd // n_head,
        head_dim_given=head_dim is not None,
        n_vocab=int(need("vocab_size")),
        n_ctx_train=config.get("max_position_embeddings"),
        rope_theta=float(rope_theta) if rope_theta is not None else None,
        rms_eps=config.get("rms_norm_eps"),
        rope_scaling=rope,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        config=config,
    )
