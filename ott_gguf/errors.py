"""Exceptions raised by ott-gguf. Each message is one line naming what failed and where."""


class OttError(Exception):
    """Base class of every error ott-gguf raises on bad input or failed work."""


class ModelFileError(OttError):
    """A model file is missing, unreadable, truncated or not GGUF."""


class UnsupportedError(OttError):
    """An architecture, tensor type, tokenizer or option ott-gguf does not support."""


class InvalidArgumentError(OttError, ValueError):
    """A parameter, flag or batch is invalid."""


class ContextFullError(OttError):
    """A sequence would grow past the context size."""


class BackendError(OttError):
    """The native runtime or ggml backend failed (allocation, compute)."""
