"""Qwen3 (GGUF architecture "qwen3"): Qwen2 without Q/K/V biases, with an RMS norm over each
head of Q and of K before rope (attn_q_norm, attn_k_norm), rope in NeoX mode (no row
permutation), head_dim stated in config.json."""

from __future__ import annotations

from gguf import MODEL_ARCH, MODEL_TENSOR

from .architecture import Architecture
from .registry import register

T = MODEL_TENSOR


@register("Qwen3ForCausalLM")
class Qwen3(Architecture):
    gguf_arch = MODEL_ARCH.QWEN3
    config_defaults = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128}
    layer_tensors = Architecture.layer_tensors + (T.ATTN_Q_NORM, T.ATTN_K_NORM)
