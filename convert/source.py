"""Lazy access to the tensors of a Hugging Face checkpoint, one tensor at a time.

Safetensors files (single, or sharded with model.safetensors.index.json) are read by parsing
their JSON header and reading each tensor's bytes only when asked, so memory holds one
tensor at a time. pytorch_model*.bin files are opened by torch (weights_only=True, mmap).

A loaded tensor is a numpy array of float32 or float16, or of uint16 holding the raw bits
of a bfloat16 tensor (numpy has no bfloat16); TensorRef.dtype says which.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ott_gguf.errors import ModelFileError, UnsupportedError

from .hparams import read_json

# safetensors dtype name -> numpy dtype of the loaded array (BF16 kept as raw uint16 bits)
SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


@dataclass(frozen=True)
class TensorRef:
    name: str  # HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # HF (PyTorch) order: [out_features, in_features]
    dtype: str  # "F32", "F16" or "BF16"
    file: Path
    load: Callable[[], np.ndarray]


def _read_safetensors_header(path: Path) -> list[TensorRef]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{path}: truncated safetensors file ({size} bytes)")
        (n_header,) = struct.unpack("<Q", head)
        if 8 + n_header > size:
            raise ModelFileError(f"{path}: truncated safetensors file (header of {n_header} bytes, file of {size})")
        try:
            header = json.loads(f.read(n_header))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelFileError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: corrupt safetensors header")

    data_start = 8 + n_header
    refs = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{path}: corrupt safetensors entry for tensor {name}") from None
        if dtype_name not in SAFETENSORS_DTYPES:
            raise UnsupportedError(f"{path}: tensor {name} has dtype {dtype_name} (supported: F32, F16, BF16)")
        dtype = SAFETENSORS_DTYPES[dtype_name]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ModelFileError(f"{path}: tensor {name} has {end - begin} bytes for shape {list(shape)} {dtype_name}")
        if data_start + end > size:
            raise ModelFileError(
                f"{path}: truncated safetensors file (tensor {name} ends at byte {data_start + end}, file has {size})"
            )
        refs.append(
            TensorRef(name, shape, dtype_name, path, _safetensors_loader(path, data_start + begin, shape, dtype))
        )
    return sorted(refs, key=lambda r: header[r.name]["data_offsets"][0])


def _safetensors_loader(path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype):
    def load() -> np.ndarray:
        # a private buffer per tensor (not a memory map) so the resident memory is released
        # as soon as the converted tensor has been written
        out = np.empty(shape, dtype=dtype)
        with open(path, "rb") as f:
            f.seek(offset)
            if f.readinto(memoryview(out).cast("B")) != out.nbytes:
                raise ModelFileError(f"{path}: truncated while reading tensor data at byte {offset}")
        return out

    return load


def _torch_bin_refs(path: Path) -> list[TensorRef]:
    try:
        import torch
    except ImportError:
        raise UnsupportedError(f"{path}: reading pytorch_model*.bin needs torch (pip install torch)") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises RuntimeError, pickle and zip errors alike on bad files
        raise ModelFileError(f"{path}: cannot load with torch ({str(e).splitlines()[0]})") from None

    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    refs = []
    for name, tensor in state.items():
        if tensor.dtype not in names:
            raise UnsupportedError(
                f"{path}: tensor {name} has dtype {tensor.dtype} (supported: float32, float16, bfloat16)"
            )

        def load(t=tensor) -> np.ndarray:
            if t.dtype == torch.bfloat16:
                return t.contiguous().view(torch.int16).numpy().view(np.uint16)
            return t.contiguous().numpy()

        refs.append(TensorRef(name, tuple(tensor.shape), names[tensor.dtype], path, load))
    return refs


def _sharded(directory: Path, index_name: str) -> list[Path] | None:
    index_path = directory / index_name
    if not index_path.is_file():
        return None
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFileError(f"{index_path}: missing 'weight_map'")
    files = list(dict.fromkeys(weight_map.values()))
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise ModelFileError(f"{index_path}: lists {missing[0]}, which is not in {directory}")
    return [directory / f for f in files]


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files in reading order: safetensors first, then PyTorch .bin."""
    for index_name, single, pattern in (
        ("model.safetensors.index.json", "model.safetensors", "model-*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model-*.bin"),
    ):
        files = _sharded(directory, index_name)
        if files:
            return files
        if (directory / single).is_file():
            return [directory / single]
        if files := sorted(directory.glob(pattern)):
            return files
    raise ModelFileError(f"{directory}: no model*.safetensors or pytorch_model*.bin weights")


def open_checkpoint(directory: Path) -> dict[str, TensorRef]:
    """All tensors of the checkpoint by HF name, in file order; nothing is loaded yet."""
    tensors: dict[str, TensorRef] = {}
    for path in weight_files(directory):
        refs = _read_safetensors_header(path) if path.suffix == ".safetensors" else _torch_bin_refs(path)
        for ref in refs:
            if ref.name in tensors:
                raise ModelFileError(f"{path}: tensor {ref.name} also in {tensors[ref.name].file.name}")
            tensors[ref.name] = ref
    return tensors
