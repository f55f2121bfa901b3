"""The query scale of the key tiers (reference/block.py), from the model's weights alone.

A key channel's quantization error enters a score multiplied by the query's value in that
channel, so the tiers rank channels by range · u_c, where u_c estimates the query's
magnitude in channel c without running the model: for query row c of layer il,

    e_c = Σ_j (W_q[c, j] · g_j)²  +  b_q[c]²

with g the attention norm's gain (the normalized input has unit mean square, its
correlations are ignored) and b_q the query bias if any; with a per-head query norm
(qwen3, gemma3) e_c = n_c² · e_c / mean_head(e) (the norm fixes the head's mean square, n its
gain). e is summed over the query heads that share a KV head, averaged over each RoPE pair
(the rotation mixes the two channels at every position), and u = sqrt(e / mean_head(e)),
float32 [n_layer, n_head_kv, head_dim].

In a fake-quantized replay at 2048 tokens this ranking took ottr2:hi_k=4:lo_k=8's KL to f16
on Qwen2.5-Coder-0.5B from 0.078 (range alone) to 0.053, as good as query energies
calibrated on text (docs/results.md).
"""

from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ott_gguf.errors import InvalidArgumentError
from ott_gguf.gguf_meta import TensorDesc

GGML_ROPE_TYPE_NEOX = 2


def tier_scale(
    path: str | os.PathLike,
    tensors: list[TensorDesc],
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_rot: int,
    rope_type: int,
) -> np.ndarray:
    """u float32 [n_layer, n_head_kv, head_dim] of the GGUF model at path, whose tensor
    table (ott_gguf.gguf_meta.read_tensors) is `tensors` (module docstring)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    by_name = {t.name: t for t in tensors}

    def tensor(name: str) -> np.ndarray | None:
        """A tensor dequantized to float64 [rows, cols] (None if absent)."""
        t = by_name.get(name)
        if t is None:
            return None
        raw = data[t.file_offset : t.file_offset + t.n_bytes]
        return dequantize(raw, GGMLQuantizationType[t.type_name.upper()]).reshape(t.shape[::-1]).astype(np.float64)

    n_q = n_head * head_dim
    out = np.empty((n_layer, n_head_kv, head_dim), np.float32)
    for il in range(n_layer):
        p = f"blk.{il}."
        wq = tensor(p + "attn_q.weight")
        if wq is None:  # Q, K, V rows fused (phi3)
            qkv = tensor(p + "attn_qkv.weight")
            if qkv is None:
                raise InvalidArgumentError(f"{path}: layer {il} has no query weights (attn_q or attn_qkv)")
            wq = qkv[:n_q]
        g = tensor(p + "attn_norm.weight")
        e = ((wq * (1.0 if g is None else g)) ** 2).sum(axis=1)  # [n_q]
        bq = tensor(p + "attn_q.bias")
        if bq is not None:
            e = e + bq**2
        e = e.reshape(n_head, head_dim)
        qn = tensor(p + "attn_q_norm.weight")
        if qn is not None:
            e = qn**2 * e / e.mean(axis=1, keepdims=True)
        e = e.reshape(n_head_kv, n_head // n_head_kv, head_dim).sum(axis=1)  # [n_head_kv, head_dim]
        half = n_rot // 2
        if rope_type == GGML_ROPE_TYPE_NEOX:  # pairs (i, i + n_rot/2)
            pair = (e[:, :half] + e[:, half:n_rot]) / 2
            e[:, :half], e[:, half:n_rot] = pair, pair
        else:  # pairs (2i, 2i + 1)
            pair = (e[:, 0:n_rot:2] + e[:, 1:n_rot:2]) / 2
            e[:, 0:n_rot:2], e[:, 1:n_rot:2] = pair, pair
        mean = e.mean(axis=1, keepdims=True)
        out[il] = np.sqrt(e / np.where(mean > 0, mean, 1.0))
    if not np.isfinite(out).all():
        raise InvalidArgumentError(f"{path}: the query weights give a non-finite key-tier scale")
    return out
