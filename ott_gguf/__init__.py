"""ott-gguf: run GGUF language models with a 2-bit Outlier-Token-Tracing KV cache."""

from .errors import BackendError, ContextFullError, InvalidArgumentError, ModelFileError, OttError, UnsupportedError

__version__ = "0.1.0"

__all__ = [
    "Model",
    "Weights",
    "Context",
    "SamplingParams",
    "OttError",
    "ModelFileError",
    "UnsupportedError",
    "InvalidArgumentError",
    "ContextFullError",
    "BackendError",
    "__version__",
]


def __getattr__(name):
    # the native library loads on first use, so `import ott_gguf` stays cheap
    if name in ("Model", "Weights", "Context"):
        from . import model

        return getattr(model, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
