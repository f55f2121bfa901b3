"""Hugging Face checkpoints -> GGUF files that load in ott-gguf and in llama.cpp."""

from .cli import main
from .converter import convert

__all__ = ["convert", "main"]
