"""Base class of a converter architecture: hook methods that subclasses override.

The defaults describe a llama-like decoder (token embedding, per-layer RMS norms, Q/K/V/O
attention, gated FFN, output norm and head). Tensor names come from gguf-py's tables;
shapes are checked against config.json before anything is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGUFWriter, RopeScalingType

from ott_gguf.errors import UnsupportedError

from .hparams import HParams

T = MODEL_TENSOR


class Architecture:
    gguf_arch: MODEL_ARCH
    # values transformers' config class assumes for keys config.json may leave out
    config_defaults: dict[str, Any] = {}
    # the weights of every layer
    layer_tensors: tuple[MODEL_TENSOR, ...] = (
        T.ATTN_NORM,
        T.ATTN_Q,
        T.ATTN_K,
        T.ATTN_V,
        T.ATTN_OUT,
        T.FFN_NORM,
        T.FFN_GATE,
        T.FFN_UP,
        T.FFN_DOWN,
    )
    # biases that every layer must have (besides the weights)
    required_biases: tuple[MODEL_TENSOR, ...] = ()
    # rope_scaling types of config.json this architecture converts
    rope_scaling_types: tuple[str, ...] = ("linear", "yarn")

    def __init__(self, hparams: HParams):
        self.hparams = hparams
        rope_type = hparams.rope_scaling.get("rope_type")
        if rope_type is not None and rope_type not in self.rope_scaling_types:
            raise UnsupportedError(
                f"{hparams.path}: rope scaling '{rope_type}' is not supported for "
                f"{hparams.architecture} (supported: {', '.join(self.rope_scaling_types)})"
            )

    @classmethod
    def prepare_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """config.json over the defaults, in the flat form parse_hparams reads."""
        return {**cls.config_defaults, **config}

    @property
    def name(self) -> str:
        return MODEL_ARCH_NAMES[self.gguf_arch]

    def space_prefix(self, stated: bool | None, vocab_model: str) -> bool | None:
        """tokenizer.ggml.add_space_prefix to write (None: none), given tokenizer_config's
        add_prefix_space (None when it says nothing) and tokenizer.ggml.model."""
        return None

    # ---- metadata -------------------------------------------------------------------------

    def add_parameters(self, w: GGUFWriter) -> None:
        """The {arch}.* keys, with llama.cpp's names and meanings."""
        hp = self.hparams
        w.add_block_count(hp.n_layer)
        w.add_context_length(hp.n_ctx_train)
        w.add_embedding_length(hp.n_embd)
        w.add_feed_forward_length(hp.n_ff)
        w.add_head_count(hp.n_head)
        w.add_head_count_kv(hp.n_head_kv)
        w.add_rope_freq_base(hp.rope_theta)
        w.add_layer_norm_rms_eps(hp.rms_eps)
        if hp.head_dim_given:
            w.add_key_length(hp.n_embd_head)
            w.add_value_length(hp.n_embd_head)
        self._add_rope_scaling(w)

    def _add_rope_scaling(self, w: GGUFWriter) -> None:
        rope = self.hparams.rope_scaling
        rope_type = rope.get("rope_type")
        if rope_type == "linear":
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(rope["factor"]))
        elif rope_type == "yarn":
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(rope["factor"]))
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            for key, add in (
                ("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
            ):
                if rope.get(key) is not None:
                    add(float(rope[key]))

    # ---- tensors --------------------------------------------------------------------------

    def expected_shape(self, kind: MODEL_TENSOR, suffix: str) -> tuple[int, ...] | None:
        """Shape in HF order [out, in] that config.json implies; None for a tensor we do not convert."""
        hp = self.hparams
        n_q = hp.n_head * hp.n_embd_head  # rows of Wq
        n_kv = hp.n_head_kv * hp.n_embd_head  # rows of Wk, Wv
        if suffix == ".weight":
            if kind not in self.layer_tensors and kind not in (T.TOKEN_EMBD, T.OUTPUT, T.OUTPUT_NORM):
                return None
            return {
                T.TOKEN_EMBD: (hp.n_vocab, hp.n_embd),
                T.OUTPUT: (hp.n_vocab, hp.n_embd),
                T.OUTPUT_NORM: (hp.n_embd,),
                T.ATTN_NORM: (hp.n_embd,),
                T.ATTN_Q: (n_q, hp.n_embd),
                T.ATTN_K: (n_kv, hp.n_embd),
                T.ATTN_V: (n_kv, hp.n_embd),
                T.ATTN_QKV: (n_q + 2 * n_kv, hp.n_embd),
                T.ATTN_OUT: (hp.n_embd, n_q),
                T.ATTN_Q_NORM: (hp.n_embd_head,),
                T.ATTN_K_NORM: (hp.n_embd_head,),
                T.ATTN_POST_NORM: (hp.n_embd,),
                T.FFN_NORM: (hp.n_embd,),
                T.FFN_PRE_NORM: (hp.n_embd,),
                T.FFN_POST_NORM: (hp.n_embd,),
                T.FFN_GATE: (hp.n_ff, hp.n_embd),
                T.FFN_UP: (hp.n_ff, hp.n_embd),
                T.FFN_DOWN: (hp.n_embd, hp.n_ff),
            }.get(kind)
        if kind not in self.required_biases:
            return None
        return {T.ATTN_Q: (n_q,), T.ATTN_K: (n_kv,), T.ATTN_V: (n_kv,), T.ATTN_OUT: (hp.n_embd,)}.get(kind)

    def required_tensors(self) -> list[str]:
        """GGUF names that the checkpoint must provide."""
        names = ["token_embd.weight", "output_norm.weight"]
        if not self.hparams.tie_word_embeddings:
            names.append("output.weight")
        for il in range(self.hparams.n_layer):
            names += [TENSOR_NAMES[k].format(bid=il) + ".weight" for k in self.layer_tensors]
            names += [TENSOR_NAMES[k].format(bid=il) + ".bias" for k in self.required_biases]
        return names

    def transform(self, kind: MODEL_TENSOR, data: np.ndarray) -> np.ndarray:
        """Rearrange or change one source tensor before it is encoded: float32, float16, or
        uint16 bfloat16 bits in, the same or float32 out (outtype.source_dtype); shape kept."""
        return data

    def extra_tensors(self) -> dict[str, np.ndarray]:
        """Tensors computed from config.json rather than read from the checkpoint (F32)."""
        return {}
