"""Llama family: Llama 2/3, SmolLM, TinyLlama, Mistral (GGUF architecture "llama")."""

from __future__ import annotations

import math

import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, GGUFWriter

from .architecture import Architecture
from .hparams import HParams
from .registry import register


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of Wq or Wk (or their bias) for GGML's rope.

    HF llama rotates the pairs (i, i + n_embd_head/2) of each head ("rotate_half"); GGML's
    normal rope mode rotates adjacent pairs (2i, 2i+1). Within each head the rows
    [x_0..x_{h-1}, y_0..y_{h-1}] become [x_0, y_0, x_1, y_1, ...].
    w: [n_head * n_embd_head, ...] -> same shape.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(hparams: HParams) -> np.ndarray:
    """F32 [n_embd_head/2]: the per-frequency divisors of Llama 3.1's rope scaling.

    Wavelengths shorter than original_ctx/high_freq_factor keep their frequency, longer than
    original_ctx/low_freq_factor are divided by `factor`, and those between are interpolated
    smoothly; ggml divides each rope frequency by this factor ("rope_freqs" tensor).
    The arithmetic is float32 throughout, as in llama.cpp's converter.
    """
    rope = hparams.rope_scaling
    base = np.float32(hparams.rope_theta)
    dim = hparams.n_embd_head
    factor = np.float32(rope.get("factor", 8.0))
    low_freq_factor = np.float32(rope.get("low_freq_factor", 1.0))
    high_freq_factor = np.float32(rope.get("high_freq_factor", 4.0))
    old_context_len = np.float32(rope.get("original_max_position_embeddings", 8192))

    freqs = np.float32(1.0) / base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    wavelen = np.float32(2 * math.pi) / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = np.float32(1.0) / ((np.float32(1.0) - smooth) / factor + smooth)
    factors = np.where(
        wavelen < old_context_len / high_freq_factor,
        np.float32(1.0),
        np.where(wavelen > old_context_len / low_freq_factor, factor, between),
    )
    return factors.astype(np.float32)


@register("LlamaForCausalLM")
class Llama(Architecture):
    gguf_arch = MODEL_ARCH.LLAMA
    config_defaults = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
    rope_scaling_types = ("linear", "yarn", "llama3")

    def space_prefix(self, stated: bool | None, vocab_model: str) -> bool | None:
        return stated  # llama.cpp writes tokenizer_config's add_prefix_space for llama-family models

    def add_parameters(self, w: GGUFWriter) -> None:
        super().add_parameters(w)
        hp = self.hparams
        w.add_vocab_size(hp.n_vocab)
        w.add_rope_dimension_count(hp.n_embd_head)
        if not hp.head_dim_given:
            # llama.cpp's converter reads LlamaConfig, which always has head_dim
            w.add_key_length(hp.n_embd_head)
            w.add_value_length(hp.n_embd_head)

    def transform(self, kind: MODEL_TENSOR, data: np.ndarray) -> np.ndarray:
        if kind == MODEL_TENSOR.ATTN_Q:
            return permute_rope_rows(data, self.hparams.n_head)
        if kind == MODEL_TENSOR.ATTN_K:
            return permute_rope_rows(data, self.hparams.n_head_kv)
        return data

    def extra_tensors(self) -> dict[str, np.ndarray]:
        if self.hparams.rope_scaling.get("rope_type") == "llama3":
            return {"rope_freqs.weight": llama3_rope_factors(self.hparams)}
        return {}


@register("MistralForCausalLM")
class Mistral(Llama):
    config_defaults = {**Llama.config_defaults, "max_position_embeddings": 4096 * 32}
