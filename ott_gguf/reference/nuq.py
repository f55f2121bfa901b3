"""Non-uniform quantization (KVQuant's nuq datatypes) of normalized values: a codebook of 2^b
float32 levels, ascending, on the normalized range (about -1 .. 1), and the exact rules that
turn a value into a code.

Bit-exact contract (native/src/kv/kv_nuq.h transliterates it; float32 operations, round to
nearest even, no FMA):

    mid_j = (L_j + L_{j+1}) * 0.5f                 j = 0 .. 2^b - 2   (midpoints, f32)
    code  = #{ j : mid_j < t }                     the nearest level; a tie goes to the lower one

Per-token range of a value vector (over its entries that are not outliers, fp16 inputs):

    mn, mx = min, max of the kept entries          (exact; none kept: zero = scale = 0)
    zero   = fp16((f32(mx) + f32(mn)) * 0.5f)      scale = fp16((f32(mx) - f32(mn)) * 0.5f)
    inv    = scale != 0 ? 1.0f / f32(scale) : 0
    t      = (f32(x) - f32(zero)) * inv

Per-channel range of keys (calibrated thresholds lo, hi, float32, from the sidecar):

    zero = (hi + lo) * 0.5f,  scale = (hi - lo) * 0.5f,  inv = scale != 0 ? 1.0f / scale : 0
    t    = (f32(k) - zero) * inv

Dequantization x̂ = L_code · scale + zero is not part of the bit-exact contract (float64 here).
"""

from __future__ import annotations

import numpy as np

from ott_gguf.errors import InvalidArgumentError

HALF = np.float32(0.5)


def uniform_levels(bits: int) -> np.ndarray:
    """2^b evenly spaced levels from -1 to 1: L_i = f32(2i / (2^b - 1) - 1), float32 [2^b]."""
    n = 2**bits
    return (2.0 * np.arange(n) / (n - 1) - 1.0).astype(np.float32)


def check_levels(levels: np.ndarray, bits: int, what: str) -> np.ndarray:
    """A codebook as float32 [2^bits], finite and strictly ascending, or an error naming `what`."""
    levels = np.asarray(levels, dtype=np.float32)
    if levels.shape != (2**bits,) or not np.isfinite(levels).all() or (np.diff(levels) <= 0).any():
        raise InvalidArgumentError(f"{what}: a codebook must be {2**bits} finite ascending levels, got {levels!r}")
    return levels


def midpoints(levels: np.ndarray) -> np.ndarray:
    """mid_j = (L_j + L_{j+1}) * 0.5f: float32 [2^b - 1]."""
    return (levels[:-1] + levels[1:]) * HALF


def nearest_codes(t: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Codes of the nearest levels: float32 t [...] -> uint8 [...] (count of midpoints < t)."""
    return np.searchsorted(midpoints(levels), t.astype(np.float32), side="left").astype(np.uint8)


def safe_inverse(scale: np.ndarray) -> np.ndarray:
    """1.0f / scale in float32, 0 where scale is 0."""
    scale = np.asarray(scale, dtype=np.float32)
    inv = np.zeros_like(scale)
    np.divide(np.float32(1.0), scale, out=inv, where=scale != 0)
    return inv


def channel_params(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(zero, scale) float32 of calibrated per-channel thresholds lo, hi (float32 [...])."""
    lo, hi = np.asarray(lo, dtype=np.float32), np.asarray(hi, dtype=np.float32)
    return (hi + lo) * HALF, (hi - lo) * HALF


def token_params(x: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(zero, scale) fp16 [...] of the kept entries of fp16 x [..., d] (keep: bool [..., d])."""
    xf = x.astype(np.float32)
    any_kept = keep.any(axis=-1)
    mn = np.where(keep, xf, np.inf).min(axis=-1)
    mx = np.where(keep, xf, -np.inf).max(axis=-1)
    mn, mx = np.where(any_kept, mn, 0).astype(np.float32), np.where(any_kept, mx, 0).astype(np.float32)
    return ((mx + mn) * HALF).astype(np.float16), ((mx - mn) * HALF).astype(np.float16)


def normalize(x: np.ndarray, zero: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """t = (f32(x) - f32(zero)) * inv(scale), float32, zero and scale broadcast against x."""
    return (x.astype(np.float32) - np.asarray(zero).astype(np.float32)) * safe_inverse(
        np.asarray(scale).astype(np.float32)
    )


def dequantize(codes: np.ndarray, levels: np.ndarray, zero: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x̂ = L_code · scale + zero in float64 (zero and scale broadcast against codes)."""
    return levels.astype(np.float64)[codes] * np.asarray(scale).astype(np.float64) + np.asarray(zero).astype(np.float64)
