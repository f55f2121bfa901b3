"""Rotary position embedding (RoPE) in float64: what the KVQuant cache applies to keys it
stores before RoPE (kvquant.py), inside attention, at each key's position.

The first n_rot channels of a vector at position p are rotated in pairs by the angles
θ_i = p · freq_scale · freq_base^(-2i/n_rot), i < n_rot/2; the rest pass unchanged. Pairs:

    normal (llama)  (x[2i], x[2i+1])         the llama converter permutes Q/K rows to fit it
    neox (qwen2)    (x[i], x[i + n_rot/2])

    (a, b) -> (a·cos θ - b·sin θ,  a·sin θ + b·cos θ)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rope:
    n_rot: int  # rotated channels (even, <= head_dim)
    freq_base: float
    freq_scale: float = 1.0  # linear position scaling
    neox: bool = False  # pairing: False (x[2i], x[2i+1]), True (x[i], x[i + n_rot/2])

    def angles(self, pos: np.ndarray) -> np.ndarray:
        """θ: float64 [n, n_rot/2] for positions int [n]."""
        inv_freq = self.freq_base ** (-np.arange(0, self.n_rot, 2, dtype=np.float64) / self.n_rot)
        return np.outer(np.asarray(pos, dtype=np.float64) * self.freq_scale, inv_freq)

    def apply(self, x: np.ndarray, pos: np.ndarray, inverse: bool = False) -> np.ndarray:
        """x [n, ..., head_dim] at positions pos [n] -> float64, rotated (by -θ: inverse)."""
        x = np.asarray(x, dtype=np.float64)
        theta = self.angles(pos) * (-1.0 if inverse else 1.0)
        shape = (len(theta),) + (1,) * (x.ndim - 2) + (self.n_rot // 2,)
        c, s = np.cos(theta).reshape(shape), np.sin(theta).reshape(shape)
        rot, rest = x[..., : self.n_rot], x[..., self.n_rot :]
        half = self.n_rot // 2
        a, b = (rot[..., :half], rot[..., half:]) if self.neox else (rot[..., 0::2], rot[..., 1::2])
        ra, rb = a * c - b * s, a * s + b * c
        out = np.concatenate([ra, rb], -1) if self.neox else np.stack([ra, rb], -1).reshape(rot.shape)
        return np.concatenate([out, rest], -1)
