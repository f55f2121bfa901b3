"""The converter's architectures, keyed by the Hugging Face class name in config.json."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ott_gguf.errors import UnsupportedError

from .architecture import Architecture
from .hparams import parse_hparams

ARCHITECTURES: dict[str, type[Architecture]] = {}

A = TypeVar("A", bound=type[Architecture])


def register(*hf_names: str) -> Callable[[A], A]:
    def add(cls: A) -> A:
        for name in hf_names:
            ARCHITECTURES[name] = cls
        return cls

    return add


def architecture_for(config: dict[str, Any], path: Path) -> Architecture:
    """The architecture named by config.json (at `path`), with its hyperparameters."""
    # the modules register themselves on import
    from . import gemma3, llama, phi3, qwen2, qwen3  # noqa: F401

    name = config["architectures"][0]
    cls = ARCHITECTURES.get(name)
    if cls is None:
        raise UnsupportedError(
            f"{path}: architecture {name} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return cls(parse_hparams(cls.prepare_config(config), path))
