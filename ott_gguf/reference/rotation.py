"""Rotations of the KV cache (docs/design.md §8): an orthogonal R per (layer, KV head), applied to
keys and/or values when they enter the cache.

For keys, with a centre c_k:   k' = R_k (k - c_k)   and queries   q' = R_k q,
so q'·k' = q·k - q·c_k: every score of a query moves by the same amount, and the softmax
does not change. For values:   v' = R_v (v - c_v),  and the attention output o' of the
rotated values gives back  o = R_vᵀ o' + c_v  (the probabilities sum to 1). Every store of
the cache — window and pools included — holds rotated vectors; quantization sees them.

Kinds (KVConfig.rot_k / rot_v):
    0  none
    1  hadamard     R = H_d · diag(s) / √d, c = 0: H_d the Sylvester Hadamard matrix
                    (H[i][j] = (-1)^popcount(i & j)), s fixed pseudo-random signs per
                    (layer, KV head, keys or values) from `hadamard_signs`; head_dim a power
                    of two. It spreads outlier channels over all channels.
    2  calibrated   R and c from the model's own keys and values on calibration text
                    (calibrate.py), read from the sidecar GGUF.

Vectors are rows here: y = (x - c) @ R.T for x [..., head_dim].
"""

from __future__ import annotations

import numpy as np

from ott_gguf.errors import InvalidArgumentError

ROTATIONS = ("none", "hadamard", "calibrated")
NONE, HADAMARD, CALIBRATED = 0, 1, 2

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64: (new state, output)."""
    state = (state + _GOLDEN) & _MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return state, z ^ (z >> 31)


def hadamard_signs(head_dim: int, il: int, head: int, values: bool) -> np.ndarray:
    """The signs s (float64 [head_dim], ±1) of one Hadamard rotation: output c of splitmix64
    started at GOLDEN · (2·(il·65536 + head) + values + 1) gives s_c = -1 when its top bit
    is set (kv/kv_rotation.cpp draws the same)."""
    state = (_GOLDEN * (2 * (il * 65536 + head) + int(values) + 1)) & _MASK
    s = np.empty(head_dim)
    for c in range(head_dim):
        state, z = _splitmix64(state)
        s[c] = -1.0 if z >> 63 else 1.0
    return s


def sylvester(head_dim: int) -> np.ndarray:
    """H_d: float64 [head_dim, head_dim], entries ±1, H @ H.T = head_dim · I."""
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise InvalidArgumentError(f"hadamard rotation: head size {head_dim} is not a power of two")
    i = np.arange(head_dim)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return 1.0 - 2.0 * parity


def hadamard(head_dim: int, il: int, head: int, values: bool) -> np.ndarray:
    """R = H_d · diag(s) / √d: float64 [head_dim, head_dim], orthogonal."""
    return sylvester(head_dim) * hadamard_signs(head_dim, il, head, values)[None, :] / np.sqrt(head_dim)


def rotate(x: np.ndarray, R: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
    """(x - c) @ R.T over the last axis: x [..., head_dim] -> float64 [..., head_dim]."""
    x = np.asarray(x, dtype=np.float64)
    return (x if c is None else x - c) @ R.T


def restore(y: np.ndarray, R: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
    """The inverse of rotate: y @ R + c."""
    x = np.asarray(y, dtype=np.float64) @ R
    return x if c is None else x + c
