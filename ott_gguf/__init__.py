"""ott-gguf: run GGUF language models with a 2-bit Outlier-Token-Tracing KV cache."""
from .errors import (BackendError, ContextFullError, InvalidArgumentError, ModelFileError, OttError,
                     UnsupportedError)

__version__ = "0.1.0"

__all__ = ["Model", "SamplingParams", "OttError", "ModelFileError", "UnsupportedError",
           "InvalidArgumentError", "ContextFullError", "BackendError", "__version__"]


def __getattr__(name):
    # the native library loads on first use, so `import ott_gguf` stays cheap
    if name == "Model":
        from .model import Model
        return Model
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
