"""Qwen2 / Qwen2.5 (GGUF architecture "qwen2"): llama-like with Q/K/V biases, rope in NeoX mode.

GGML runs Qwen2's rope in NeoX mode, which rotates the same (i, i + n_embd_head/2) pairs as
HF, so unlike llama no rows are permuted.
"""

from __future__ import annotations

from gguf import MODEL_ARCH, MODEL_TENSOR

from .architecture import Architecture
from .registry import register


@register("Qwen2ForCausalLM")
class Qwen2(Architecture):
    gguf_arch = MODEL_ARCH.QWEN2
    config_defaults = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
    required_biases = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V)
