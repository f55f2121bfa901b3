"""Attention over every store of the cache (docs/design.md §3), in float64: the accuracy reference.

A chunk of n_q new tokens (n_q = 1 is a decode step) attends to the cache as it stands —
sink, quantized blocks minus masked slots, pool, extra pool, window — and to itself causally,
its own K/V rounded to fp16 as the window will store them. One softmax over all of it with
scale 1/sqrt(head_dim). Then the chunk is appended, which may fire quantization events.

GQA: query head h reads KV head h // (n_head / n_head_kv).

Keys cached before RoPE (cfg.pre_rope, either scheme): every key — dequantized, sink, window and
the chunk's own — is rotated at its position (rope.py) in float64 before its score is taken,
so q·RoPE(k̂, p) is exact up to float64 rounding; queries arrive rotated as always.

Decode-faithful chunking: a chunk sees no quantization event of its own tokens, so chunks
that end exactly where events fire (`LayerCache.tokens_until_event`) give what token-by-token
decoding gives. Such chunk bounds sit at sink + R + j·block tokens, not at multiples of block.
"""

from __future__ import annotations

import numpy as np

from ott_gguf.errors import InvalidArgumentError

from .cache import LayerCache
from .rope import Rope
from .store import to_fp16


def attend(layer: LayerCache, q: np.ndarray, k: np.ndarray, v: np.ndarray, rope: Rope | None = None) -> np.ndarray:
    """Attention of a chunk over the cache and itself; the cache is not changed.

    q:    float32 [n_q, n_head, head_dim]      queries of the chunk (post-RoPE)
    k, v: float32 [n_q, n_head_kv, head_dim]   the chunk's own keys and values (post-RoPE;
                                               before RoPE with cfg.pre_rope, then `rope` rotates)
    return float64 [n_q, n_head, head_dim]
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    layer.check_kv(k, v)
    n_q, n_head, head_dim = q.shape
    if n_q != len(k) or head_dim != layer.head_dim or n_head % layer.n_head_kv:
        raise InvalidArgumentError(
            f"layer {layer.il} attention: q {q.shape} does not match k {k.shape} "
            f"(n_head must be a multiple of n_head_kv={layer.n_head_kv})"
        )
    if layer.cfg.pre_rope and rope is None:
        raise InvalidArgumentError(f"layer {layer.il} attention: keys cached before RoPE need the model's RoPE")
    k_own = to_fp16(k, f"layer {layer.il} k").astype(np.float64)  # [n_q, n_head_kv, head_dim]
    own_pos = layer.n_tokens + np.arange(n_q)
    if layer.cfg.pre_rope:
        k_own = rope.apply(k_own, own_pos)
    v_own = to_fp16(v, f"layer {layer.il} v").astype(np.float64)
    q64 = q.astype(np.float64)
    n_rep = n_head // layer.n_head_kv
    out = np.empty((n_q, n_head, head_dim), dtype=np.float64)
    # own token j is visible to query i iff j <= i
    causal = np.tril(np.ones((n_q, n_q), dtype=bool))  # [n_q, n_q]
    for h_kv, head in enumerate(layer.heads):
        pos_past, k_past, v_past = head.tokens()  # [n_kv, head_dim]
        if layer.cfg.pre_rope:
            k_past = rope.apply(k_past, pos_past)
        k_all = np.concatenate([k_past, k_own[:, h_kv]])  # [n_kv + n_q, head_dim]
        v_all = np.concatenate([v_past, v_own[:, h_kv]])
        visible = np.concatenate([np.ones((n_q, len(k_past)), dtype=bool), causal], axis=1)
        for h in range(h_kv * n_rep, (h_kv + 1) * n_rep):
            scores = q64[:, h] @ k_all.T / np.sqrt(head_dim)  # [n_q, n_kv + n_q]
            scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, h] = (p @ v_all) / p.sum(axis=1, keepdims=True)
    return out


def forward_chunk(
    layer: LayerCache, q: np.ndarray, k: np.ndarray, v: np.ndarray, rope: Rope | None = None
) -> np.ndarray:
    """Attend (see `attend`), then append the chunk's K/V to the cache."""
    out = attend(layer, q, k, v, rope)
    layer.append(k, v)
    return out


def prefill(
    layer: LayerCache, q: np.ndarray, k: np.ndarray, v: np.ndarray, fp16: bool = False, rope: Rope | None = None
) -> np.ndarray:
    """Process a prompt. fp16=False: decode-faithful chunks (same result as decoding token by
    token). fp16=True (--prefill-fp16): the whole prompt is one chunk, so it attends in full
    precision, and is quantized afterwards as it is appended.

    q: float32 [n, n_head, head_dim]; k, v: float32 [n, n_head_kv, head_dim] -> float64 [n, n_head, head_dim]
    """
    if fp16:
        return forward_chunk(layer, q, k, v, rope)
    outs, i = [], 0
    while i < len(q):
        step = layer.tokens_until_event()
        j = len(q) if step is None else min(len(q), i + step)
        outs.append(forward_chunk(layer, q[i:j], k[i:j], v[i:j], rope))
        i = j
    return np.concatenate(outs) if outs else np.zeros(q.shape, dtype=np.float64)
