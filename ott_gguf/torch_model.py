"""A torch forward (and backward) pass of a GGUF model's own weights, dequantized with gguf-py:
what KVQuant calibration needs gradients from (calibrate.py), and what the accuracy bench
runs a simulated cache in. Architectures `llama` (SmolLM2, Llama) and `qwen2`.

torch is an optional extra (`pip install ".[calibrate]"`); the runtime never imports this.

Shapes: B sequences of n tokens, H query heads, H_kv KV heads of d channels. Keys and values
are rounded to fp16 on their way into attention, as every cache of the runtime stores them
(a straight-through rounding: gradients pass unchanged). Hooks per layer il:

    observe(il, k_pre, k_post, v)        the layer's keys before and after RoPE and values,
                                         float32 [B, n, H_kv, d] (fp16-rounded), in the graph
    attend(il, q, k_pre, k_post, v)      replaces causal attention: q float32 [B, n, H, d]
                                         (after RoPE) -> float32 [B, n, H, d]
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np

from .errors import UnsupportedError
from .reference.rope import Rope

# RoPE pairing per architecture (reference/rope.py): llama GGUFs have Q/K rows permuted for
# adjacent pairs, qwen2 keeps the neox halves
_NEOX = {"llama": False, "qwen2": True}


def _torch():
    try:
        import torch
    except ImportError:
        raise UnsupportedError('this needs torch: pip install "ott-gguf[calibrate]"') from None
    return torch


class TorchModel:
    def __init__(self, path: str | os.PathLike, device: str = "cpu"):
        torch = _torch()
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(str(path))
        self.arch = arch = reader.fields["general.architecture"].contents()
        if arch not in _NEOX:
            raise UnsupportedError(f"{path}: the torch forward supports {', '.join(_NEOX)}, not {arch}")

        def meta(key, default=None):
            f = reader.fields.get(f"{arch}.{key}")
            return default if f is None else f.contents()

        self.n_layer = int(meta("block_count"))
        self.n_head = int(meta("attention.head_count"))
        self.n_head_kv = int(meta("attention.head_count_kv", self.n_head))
        n_embd = int(meta("embedding_length"))
        self.head_dim = int(meta("attention.key_length", n_embd // self.n_head))
        self.eps = float(meta("attention.layer_norm_rms_epsilon"))
        if meta("rope.scaling.type", "none") not in ("none",) or "rope_freqs.weight" in {
            t.name for t in reader.tensors
        }:
            raise UnsupportedError(f"{path}: the torch forward has no RoPE scaling")
        self.rope = Rope(
            int(meta("rope.dimension_count", self.head_dim)), float(meta("rope.freq_base", 10000.0)), 1.0, _NEOX[arch]
        )
        self.device = device
        self.w = {}
        for t in reader.tensors:
            a = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            self.w[t.name] = torch.from_numpy(np.array(a, dtype=np.float32)).to(device)
        self.w.setdefault("output.weight", self.w["token_embd.weight"])  # tied embeddings

    # ---- pieces -------------------------------------------------------------------------

    def rope_tables(self, pos: np.ndarray):
        """cos, sin: float32 [n, n_rot/2] at positions pos (angles in float64, as rope.py)."""
        torch = _torch()
        theta = self.rope.angles(pos)
        return (
            torch.from_numpy(np.cos(theta).astype(np.float32)).to(self.device),
            torch.from_numpy(np.sin(theta).astype(np.float32)).to(self.device),
        )

    def apply_rope(self, x, cos, sin):
        """x [B, n, heads, d] rotated at the positions of cos, sin [n, n_rot/2]."""
        torch = _torch()
        n_rot, half = self.rope.n_rot, self.rope.n_rot // 2
        rot, rest = x[..., :n_rot], x[..., n_rot:]
        a, b = (rot[..., :half], rot[..., half:]) if self.rope.neox else (rot[..., 0::2], rot[..., 1::2])
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        ra, rb = a * c - b * s, a * s + b * c
        out = torch.cat([ra, rb], -1) if self.rope.neox else torch.stack([ra, rb], -1).reshape(rot.shape)
        return torch.cat([out, rest], -1)

    def _linear(self, x, name):
        y = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def _norm(self, x, name):
        return x * (x.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt() * self.w[f"{name}.weight"]

    def causal_attention(self, q, k, v):
        """Exact causal attention: q [B, n, H, d], k, v [B, n, H_kv, d] -> [B, n, H, d]."""
        torch = _torch()
        rep = self.n_head // self.n_head_kv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=1.0 / math.sqrt(self.head_dim),
        )
        return o.transpose(1, 2)

    # ---- the pass -----------------------------------------------------------------------

    def forward(self, tokens, observe: Callable | None = None, attend: Callable | None = None, grads: bool = False):
        """tokens: int64 [B, n] at positions 0..n-1 -> logits float32 [B, n, n_vocab].
        grads: the activations require gradients (the weights never do)."""
        torch = _torch()
        B, n = tokens.shape
        cos, sin = self.rope_tables(np.arange(n))
        x = self.w["token_embd.weight"][tokens].requires_grad_(grads)
        for il in range(self.n_layer):
            blk = f"blk.{il}"
            h = self._norm(x, f"{blk}.attn_norm")
            q = self._linear(h, f"{blk}.attn_q").view(B, n, self.n_head, self.head_dim)
            k = _fp16(self._linear(h, f"{blk}.attn_k").view(B, n, self.n_head_kv, self.head_dim))
            v = _fp16(self._linear(h, f"{blk}.attn_v").view(B, n, self.n_head_kv, self.head_dim))
            q = self.apply_rope(q, cos, sin)
            k_post = _fp16(self.apply_rope(k, cos, sin))
            if observe is not None:
                observe(il, k, k_post, v)
            o = attend(il, q, k, k_post, v) if attend is not None else self.causal_attention(q, k_post, v)
            x = x + self._linear(o.reshape(B, n, -1), f"{blk}.attn_output")
            h = self._norm(x, f"{blk}.ffn_norm")
            g = self._linear(h, f"{blk}.ffn_gate")
            x = x + self._linear(torch.nn.functional.silu(g) * self._linear(h, f"{blk}.ffn_up"), f"{blk}.ffn_down")
        return self._norm(x, "output_norm") @ self.w["output.weight"].T


def _fp16(x):
    """x rounded to fp16 in the forward pass, gradients straight through."""
    return x + (x.half().float() - x).detach()
