"""GGUF metadata and tensor list of a loaded model, read from the native loader.

The loader has already parsed the file with ggml's gguf reader; asking it costs about a
hundredth of re-parsing the file with `gguf.GGUFReader` (whose per-string objects make a
150k-token vocabulary take seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._native import check, ffi, lib

# gguf value types -> numpy dtypes (strings and arrays handled apart)
_DTYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorDesc:
    name: str
    type_name: str  # ggml type name, e.g. "q4_1"
    shape: tuple  # ggml ne, fastest-varying first, trailing 1s dropped
    n_bytes: int
    file_offset: int  # where its data starts in the model file


def _text(ptr) -> str:
    return ffi.string(ptr).decode("utf-8", "replace")


def read_metadata(model_handle) -> dict:
    """Every key -> Python value: str, int, float, bool, list[str] or a numpy array."""
    n = ffi.new("int64_t *")
    check(lib.ott_model_meta_count(model_handle, n))
    kv = ffi.new("ott_meta_kv *")
    out = {}
    for i in range(n[0]):
        check(lib.ott_model_meta_get(model_handle, i, kv))
        key = _text(kv.key)
        if kv.type == _STRING:
            out[key] = _text(kv.str)
        elif kv.type == _ARRAY:
            if kv.elem_type == _STRING:
                s = ffi.new("const char **")
                items = []
                for j in range(kv.n):
                    check(lib.ott_model_meta_arr_str(model_handle, i, j, s))
                    items.append(_text(s[0]))
                out[key] = items
            elif kv.elem_type in _DTYPES:
                dt = np.dtype(_DTYPES[kv.elem_type])
                out[key] = np.frombuffer(ffi.buffer(kv.data, kv.n * dt.itemsize), dtype=dt).copy()
        elif kv.type in _DTYPES:
            dt = np.dtype(_DTYPES[kv.type])
            out[key] = np.frombuffer(ffi.buffer(kv.data, dt.itemsize), dtype=dt)[0].item()
    return out


def read_tensors(model_handle) -> list[TensorDesc]:
    n = ffi.new("int64_t *")
    check(lib.ott_model_tensor_count(model_handle, n))
    d = ffi.new("ott_tensor_desc *")
    out = []
    for i in range(n[0]):
        check(lib.ott_model_tensor_get(model_handle, i, d))
        shape = list(d.ne)
        while len(shape) > 1 and shape[-1] == 1:
            shape.pop()
        out.append(TensorDesc(_text(d.name), _text(d.type_name), tuple(shape), d.n_bytes, d.file_offset))
    return out
