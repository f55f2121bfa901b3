"""Phi-3 / Phi-3.5 / Phi-4-mini (GGUF architecture "phi3"), as llama.cpp's converter writes them.

The fused qkv_proj and gate_up_proj are kept whole (attn_qkv, ffn_up of 2·n_ff rows, gate
rows first); rope in NeoX mode over the first partial_rotary_factor of each head. LongRoPE
("longrope", formerly "su") becomes the tensors rope_factors_long / rope_factors_short and the
attention factor sqrt(1 + ln(s)/ln(n_orig)), s = max_position_embeddings / n_orig, that
multiplies rope's cos and sin; the runtime takes the long factors when the context exceeds
n_orig = original_max_position_embeddings. sliding_window is written as given, 0 for none.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, GGUFWriter

from ott_gguf.errors import ModelFileError

from .architecture import Architecture
from .registry import register

T = MODEL_TENSOR


@register("Phi3ForCausalLM")
class Phi3(Architecture):
    gguf_arch = MODEL_ARCH.PHI3
    # Phi3Config's defaults
    config_defaults = {
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "partial_rotary_factor": 1.0,
    }
    layer_tensors = (T.ATTN_NORM, T.ATTN_QKV, T.ATTN_OUT, T.FFN_NORM, T.FFN_UP, T.FFN_DOWN)
    rope_scaling_types = ("longrope", "su")

    @classmethod
    def prepare_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare_config(config)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        config.setdefault(
            "original_max_position_embeddings",
            rope.get("original_max_position_embeddings", config["max_position_embeddings"]),
        )
        if "partial_rotary_factor" in rope:
            config["partial_rotary_factor"] = rope["partial_rotary_factor"]
        return config

    @property
    def n_rot(self) -> int:
        hp = self.hparams
        return int(float(hp.config["partial_rotary_factor"]) * hp.n_embd) // hp.n_head

    @property
    def n_ctx_orig(self) -> int:
        return int(self.hparams.config["original_max_position_embeddings"])

    def expected_shape(self, kind: MODEL_TENSOR, suffix: str) -> tuple[int, ...] | None:
        if kind == T.FFN_UP and suffix == ".weight":
            return (2 * self.hparams.n_ff, self.hparams.n_embd)
        return super().expected_shape(kind, suffix)

    def add_parameters(self, w: GGUFWriter) -> None:
        hp = self.hparams
        w.add_context_length(hp.n_ctx_train)
        w.add_rope_scaling_orig_ctx_len(self.n_ctx_orig)
        w.add_embedding_length(hp.n_embd)
        w.add_feed_forward_length(hp.n_ff)
        w.add_block_count(hp.n_layer)
        w.add_head_count(hp.n_head)
        w.add_head_count_kv(hp.n_head_kv)
        w.add_layer_norm_rms_eps(hp.rms_eps)
        w.add_rope_dimension_count(self.n_rot)
        w.add_rope_freq_base(hp.rope_theta)
        w.add_sliding_window(int(hp.config.get("sliding_window") or 0))
        if self._long_rope():
            scale = hp.n_ctx_train / self.n_ctx_orig
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(self.n_ctx_orig)) if scale > 1 else 1.0
            )

    def _long_rope(self) -> dict[str, Any] | None:
        rope = self.hparams.rope_scaling
        return rope if rope.get("long_factor") else None

    def extra_tensors(self) -> dict[str, np.ndarray]:
        rope = self._long_rope()
        if rope is None:
            return {}
        factors = {
            name: np.asarray(rope.get(key) or [], dtype=np.float32)
            for name, key in (
                ("rope_factors_long.weight", "long_factor"),
                ("rope_factors_short.weight", "short_factor"),
            )
        }
        for name, f in factors.items():
            if f.shape != (self.n_rot // 2,):
                raise ModelFileError(
                    f"{self.hparams.path}: rope scaling has {f.size} factors for {name}, "
                    f"expected {self.n_rot // 2} (half the rotated dimensions)"
                )
        return factors
