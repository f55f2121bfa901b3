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


def encode(data: np.ndarray, src_dtype: str, qtype: GGMLQuantizationType) -> np.ndarray:
    """Source array (float32, float16, or uint16 bfloat16 bits) -> the bytes of `qtype`.

    Returns float32/float16 arrays for F32/F16 and uint8/uint16 arrays for BF16 and Q8_0,
    ready for GGUFWriter.write_tensor_data.
    """
    if src_dtype == "BF16":
        if qtype == GGMLQuantizationType.BF16:
            return data  # the bits pass through unchanged
        data = bf16_bits_to_f32(data)
    if qtype == GGMLQuantizationType.F32:
        return data.astype(np.float32, copy=False)
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16, copy=False)
    # BF16 (round to nearest even, like ggml) and Q8_0 from float32
    return quantize(data.astype(np.float32, copy=False), qtype)
