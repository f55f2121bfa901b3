"""Raw binding to native/include/ott.h: the cffi API-mode module, loaded once.

`ffi` and `lib` mirror the C header one to one; `check()` turns a status code into the
matching exception with the library's one-line message. Set OTT_NATIVE_DIR to a folder
holding another build (`_ott_cffi*.so` beside its `libott.so`) to use that one instead of
the build installed with the package (a folder without one is an error). Run from a source
checkout (`python -m ott_gguf` in the repository root), the package finds the compiled
module of the installed distribution.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from ..errors import BackendError, ContextFullError, InvalidArgumentError, ModelFileError, OttError, UnsupportedError

_MODULE = "ott_gguf._native._ott_cffi"


def _load_file(f: Path):
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(f))
    spec = importlib.util.spec_from_file_location(_MODULE, str(f), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _installed_native_dir() -> Path | None:
    """The `ott_gguf/_native` folder of the installed distribution, if one is installed."""
    try:
        dist = importlib.metadata.distribution("ott-gguf")
    except importlib.metadata.PackageNotFoundError:
        return None
    folder = Path(dist.locate_file("ott_gguf/_native"))
    return folder if folder.resolve() != Path(__file__).resolve().parent else None


def _cannot_load(tried: list[str]) -> ImportError:
    return ImportError("cannot load the ott-gguf native library; tried: " + "; ".join(tried))


def _load():
    tried = []
    override = os.environ.get("OTT_NATIVE_DIR")
    if override:
        for f in sorted(Path(override).glob("_ott_cffi*.so")) + sorted(Path(override).glob("_ott_cffi*.pyd")):
            try:
                return _load_file(f)
            except ImportError as e:
                tried.append(f"{f}: {e}")
        if not tried:
            tried.append(f"OTT_NATIVE_DIR={override}: no _ott_cffi extension there")
        raise _cannot_load(tried)  # the build asked for, not another in its place unnoticed
    try:
        return importlib.import_module(_MODULE)
    except ImportError as e:
        tried.append(f"{_MODULE} (beside this package): {e}")
    # `python -m ott_gguf` from a source checkout imports the checkout's package, which holds
    # no compiled module: take the one `pip install .` put into the installed distribution.
    installed = _installed_native_dir()
    for f in sorted(installed.glob("_ott_cffi*.so")) if installed else []:
        try:
            return _load_file(f)
        except ImportError as e:
            tried.append(f"{f} (installed distribution): {e}")
    if installed is None:
        tried.append("no installed ott-gguf distribution elsewhere (pip install .)")
    elif not any(installed.glob("_ott_cffi*.so")):
        tried.append(f"{installed}: no _ott_cffi extension there")
    raise _cannot_load(tried)


_mod = _load()
ffi = _mod.ffi
lib = _mod.lib

_ERRORS = {
    lib.OTT_ERR_IO: ModelFileError,
    lib.OTT_ERR_FORMAT: ModelFileError,
    lib.OTT_ERR_UNSUPPORTED: UnsupportedError,
    lib.OTT_ERR_INVALID_ARG: InvalidArgumentError,
    lib.OTT_ERR_CONTEXT_FULL: ContextFullError,
    lib.OTT_ERR_ALLOC: BackendError,
    lib.OTT_ERR_BACKEND: BackendError,
}


def check(status: int) -> None:
    """Raise the exception matching a non-OK status, with the native message."""
    if status != lib.OTT_OK:
        msg = ffi.string(lib.ott_last_error()).decode("utf-8", "replace")
        raise _ERRORS.get(status, OttError)(msg or f"native error {status}")
