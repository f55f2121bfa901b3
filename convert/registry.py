"""The converter's architectures, keyed by the Hugging Face class name in config.json."""
from __future__ import annotations

from typing import Callable, TypeVar

from ott_gguf.errors import UnsupportedError

from .architecture import Architecture
from .hparams import HParams

ARCHITECTURES: dict[str, type[Architecture]] = {}

A = TypeVar("A", bound=type[Architecture])


def register(*hf_names: str) -> Callable[[A], A]:
    def add(cls: A) -> A:
        for name in hf_names:
            ARCHITECTURES[name] = cls
        return cls
    return add


def architecture_for(hparams: HParams, where: str) -> Architecture:
    # the modules register themselves on import
    from . import llama, qwen2  # noqa: F401

    cls = ARCHITECTURES.get(hparams.architecture)
    if cls is None:
        raise UnsupportedError(f"{where}: architecture {hparams.architecture} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return cls(hparams)
