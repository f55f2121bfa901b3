"""Gemma 3, text-only checkpoints (GGUF architecture "gemma3").

As llama.cpp's converter: every RMS norm weight gets Gemma's "1 +" added (Gemma3RMSNorm
multiplies by 1 + w), rope in NeoX mode (no row permutation), the SentencePiece vocabulary
without a space prefix. Layers are local (sliding window) or global: layer_types in
config.json, else every sliding_window_pattern-th layer global (default 6, which llama.cpp
assumes when the file says nothing; any other pattern is written as a per-layer array).
Global layers take rope_theta and the rope scaling, local layers rope_local_base_freq.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, GGUFWriter

from ott_gguf.errors import UnsupportedError

from .architecture import Architecture
from .hparams import HParams
from .outtype import to_f32
from .registry import register

T = MODEL_TENSOR
NORMS = (T.ATTN_NORM, T.ATTN_Q_NORM, T.ATTN_K_NORM, T.ATTN_POST_NORM, T.FFN_PRE_NORM, T.FFN_POST_NORM, T.OUTPUT_NORM)
LLAMACPP_PATTERN = 6


@register("Gemma3ForCausalLM")
class Gemma3(Architecture):
    gguf_arch = MODEL_ARCH.GEMMA3
    # Gemma3TextConfig's defaults
    config_defaults = {
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "head_dim": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    layer_tensors = (
        T.ATTN_NORM,
        T.ATTN_Q,
        T.ATTN_K,
        T.ATTN_V,
        T.ATTN_OUT,
        T.ATTN_Q_NORM,
        T.ATTN_K_NORM,
        T.ATTN_POST_NORM,
        T.FFN_PRE_NORM,
        T.FFN_GATE,
        T.FFN_UP,
        T.FFN_DOWN,
        T.FFN_POST_NORM,
    )
    rope_scaling_types = ("linear",)

    @classmethod
    def prepare_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 nests the rope of each layer kind in rope_parameters
        config = dict(config)
        rope = config.get("rope_parameters") or {}
        if "full_attention" in rope:
            config["rope_parameters"] = rope["full_attention"]
            local = (rope.get("sliding_attention") or {}).get("rope_theta")
            if local is not None:
                config["rope_local_base_freq"] = local
        return super().prepare_config(config)

    def __init__(self, hparams: HParams):
        super().__init__(hparams)
        cfg = hparams.config
        if cfg.get("hidden_activation") != "gelu_pytorch_tanh":
            raise UnsupportedError(
                f"{hparams.path}: hidden_activation {cfg.get('hidden_activation')!r} is not "
                f"supported (gelu_pytorch_tanh)"
            )
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if cfg.get(key):
                raise UnsupportedError(f"{hparams.path}: {key} = {cfg[key]} is not supported")
        # llama.cpp scales queries by 1/sqrt(head_dim), or by 1/sqrt(n_embd/n_head) for the 62 layers of 27B
        scalar = cfg["query_pre_attn_scalar"]
        implied = hparams.n_embd // hparams.n_head if hparams.n_layer == 62 else hparams.n_embd_head
        if scalar != implied:
            raise UnsupportedError(
                f"{hparams.path}: query_pre_attn_scalar = {scalar} is not supported "
                f"(GGUF implies {implied} for this model)"
            )
        self.local = self._local_layers()

    def _local_layers(self) -> list[bool]:
        hp = self.hparams
        types = hp.config.get("layer_types")
        if types is not None:
            if len(types) != hp.n_layer or not set(types) <= {"sliding_attention", "full_attention"}:
                raise UnsupportedError(
                    f"{hp.path}: layer_types must name sliding_attention or full_attention "
                    f"for each of the {hp.n_layer} layers"
                )
            return [t == "sliding_attention" for t in types]
        n = int(hp.config.get("sliding_window_pattern", LLAMACPP_PATTERN))
        return [n == 0 or il % n < n - 1 for il in range(hp.n_layer)]

    def add_parameters(self, w: GGUFWriter) -> None:
        super().add_parameters(w)
        hp, cfg = self.hparams, self.hparams.config
        w.add_rope_freq_base_swa(float(cfg["rope_local_base_freq"]))
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        if any(self.local):
            w.add_sliding_window(int(cfg["sliding_window"]))
            default = [il % LLAMACPP_PATTERN < LLAMACPP_PATTERN - 1 for il in range(hp.n_layer)]
            if self.local != default:
                w.add_sliding_window_pattern(self.local)

    def space_prefix(self, stated: bool | None, vocab_model: str) -> bool | None:
        return False if vocab_model == "llama" else None

    def transform(self, kind: MODEL_TENSOR, data: np.ndarray) -> np.ndarray:
        return to_f32(data) + np.float32(1.0) if kind in NORMS else data
