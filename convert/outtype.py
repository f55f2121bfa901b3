"""Output tensor types: which GGML type each tensor gets, its size, and the encoding itself."""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import quantize

# --outtype -> (GGML type of the weight matrices, general.file_type)
OUTTYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}


def tensor_type(outtype: str, gguf_name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
    """The GGML type of one output tensor; shape in numpy order [.., n_rows, n_cols]."""
    # As llama.cpp's converter does: 1-D tensors and norms stay F32 (kernels expect F32 there)
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight"):
        return GGMLQuantizationType.F32
    qtype = OUTTYPES[outtype][0]
    block_size = GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block_size != 0:
        return GGMLQuantizationType.F16  # rows not a whole number of blocks: llama.cpp falls back to F16 too
    return qtype


def tensor_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block_size * type_size


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# numpy dtype of a loaded source array -> the dtype name it stands for (source.py)
SOURCE_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint16): "BF16"}


def source_dtype(data: np.ndarray) -> str:
    """ "F32", "F16" or "BF16" (raw uint16 bits) for an array as source.py loads them."""
    return SOURCE_DTYPES[data.dtype.newbyteorder("=")]


def to_f32(data: np.ndarray) -> np.ndarray:
    """A loaded source array (float32, float16 or bfloat16 bits) as float32."""
    return bf16_bits_to_f32(data) if source_dtype(data) == "BF16" else data.astype(np.float32)


# elements encoded per step: the float32 temporaries of a conversion stay at a few MiB
CHUNK_ELEMENTS = 1 << 22

# source dtype -> the GGML type holding the same bits
SAME_BITS = {"F32": GGMLQuantizationType.F32, "F16": GGMLQuantizationType.F16, "BF16": GGMLQuantizationType.BF16}


def _encode_block(data: np.ndarray, src_dtype: str, qtype: GGMLQuantizationType) -> np.ndarray:
    if src_dtype == "BF16":
        data = bf16_bits_to_f32(data)
    if qtype == GGMLQuantizationType.F32:
        return data.astype(np.float32, copy=False)
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16, copy=False)
    # BF16 (round to nearest even, like ggml) and Q8_0, from float32
    return quantize(data.astype(np.float32, copy=False), qtype)


def encode(data: np.ndarray, src_dtype: str, qtype: GGMLQuantizationType) -> np.ndarray:
    """Source array (float32, float16, or uint16 bfloat16 bits) -> the data of `qtype`.

    Returns float32/float16 arrays for F32/F16, uint8 [.., n_rows, row bytes] for BF16 and Q8_0,
    ready for GGUFWriter.write_tensor_data. Rows are encoded a chunk at a time into the output,
    so memory holds the source, the output and one chunk's temporaries.
    """
    if SAME_BITS[src_dtype] == qtype:
        return data  # the bits pass through unchanged
    if data.ndim < 2 or data.size <= CHUNK_ELEMENTS:
        return _encode_block(data, src_dtype, qtype)
    rows = data.reshape(-1, data.shape[-1])  # [n_rows, n_cols]
    step = max(1, CHUNK_ELEMENTS // rows.shape[1])
    first = _encode_block(rows[:step], src_dtype, qtype)  # [step, n_cols or row bytes]
    out = np.empty((rows.shape[0], first.shape[1]), dtype=first.dtype)
    out[:step] = first
    for r in range(step, rows.shape[0], step):
        out[r : r + step] = _encode_block(rows[r : r + step], src_dtype, qtype)
    return out.reshape(*data.shape[:-1], first.shape[1])
