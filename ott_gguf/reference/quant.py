"""KIVI asymmetric quantization of one group, and LSB-first code packing.

Bit-exact contract (what native code must reproduce, byte for byte)
-------------------------------------------------------------------
Inputs are fp16 values (they come from the fp16 window). Every step is one IEEE-754
float32 operation in round-to-nearest-even, in this order, with no fused multiply-add
and no fast-math (compile the native quantizer with -ffp-contract=off, CUDA without
--use_fast_math):

    mn    = min(x)                              exact (x is fp16)
    mx    = max(x)                              exact
    range = f32(mx) - f32(mn)                   f32 subtraction
    s32   = range / f32(2^b - 1)                f32 division
    scale = fp16(s32)                           f32 -> fp16, round to nearest even   (stored)
    min   = fp16(mn)                            exact                                (stored)
    inv   = 1.0f / f32(scale), or 0 if scale == 0     f32 division
    t     = (f32(x) - f32(mn)) * inv            f32 subtraction, then f32 multiplication
    code  = clamp(rint(t), 0, 2^b - 1)          rint: round half to even (rintf,
                                                _mm256_round_ps(.., _MM_FROUND_TO_NEAREST_INT),
                                                vrndnq_f32, CUDA rintf / __float2int_rn)

A group with max == min (or whose range/(2^b-1) underflows fp16 to 0) stores scale 0 and
all codes 0; it dequantizes to `min` for every element.

Clipped ranges (clip=True)
--------------------------
The range [mn, mx] is the first of CLIP_SHRINK candidates; each candidate i narrows it
symmetrically by c_i = CLIP_SHRINK[i] (float32 constants) of its width, and the group keeps
the candidate whose dequantized values are closest to x (least sum of squared errors). With
b bits, 2^b levels spread over the whole range waste most of them on the few extreme values
of a large group; the best narrowing keeps about 55-75 % of the range at 2 bits. Per
candidate, in float32 operations as above:

    t     = f32(mx) - f32(mn)                   (once)
    d     = c_i * t
    lo    = f32(mn) + d,   hi = f32(mx) - d
    scale = fp16((hi - lo) / f32(2^b - 1))      min = fp16(lo)
    inv   = 1.0f / f32(scale), or 0 if scale == 0
    code  = clamp(rint((f32(x) - f32(min)) * inv), 0, 2^b - 1)
    e     = (code * f32(scale) + f32(min)) - f32(x)         three f32 operations
    err   = sum of double(e) * double(e) over the group in element order, in float64
            (each product is exact; the sum is sequential)

The first candidate with the least err wins (ties: the earlier, less narrowed one).
Candidate 0 (c = 0) is exactly the min-max recipe above.

8-bit parameters (param_bits=8)
-------------------------------
Scale and minimum take one byte each instead of two fp16 values:

    scale  ufp8: the top 8 bits of an fp16 bit pattern of a value >= 0 (5 exponent and 3
           mantissa bits), decode(s8) = f32(fp16 with bits s8 << 7); steps of 6-12 %
    min    int8 z: min = f32(f32(z) * 0.25) * decode(s8)     (two f32 multiplications)

Encoding of a range [lo, hi] (the group's min-max range [mn, mx], or with clip=True each
clipped candidate's):

    t    = (f32(hi) - f32(lo)) / f32(2^b - 1)
    h    = fp16(t), then the next fp16 up while f32(h) < t     (the least fp16 >= t)
    s8   = max(1, ceil(h / 128))                               (the least ufp8 >= h, > 0)
    z    = floor(f32(f32(lo) / s) * 4.0f)  with s = decode(s8)
    while z is outside -128 .. 127: s8 += 1, z again           (a wider scale reaches lo)
    codes as above with min and scale decoded: clamp(rint((f32(x) - min) * (1/s)), 0, 2^b - 1)

Both are rounded outward: the scale up and the minimum down by less than a quarter step, so
the levels still span [lo, hi] (the top one within a quarter step of hi); from the min-max
range no value is clipped and the error stays within half a step of the (slightly wider)
scale. With clip=True every candidate is encoded so, and its err is computed as above with
the decoded scale and minimum: e = (code * s + min) - f32(x). A group far from
zero for its spread (|mn| > 32 steps) widens its scale until z reaches it; a constant group
v gets the least scale that does, so it is stored to within |v|/128.

Symmetric groups (sym=True; the values of a config with sym_v 1)
-----------------------------------------------------------------
Only the scale is stored; the minimum is implied, so the levels lie symmetric around zero:

    a     = max(-mn, mx) + 0                    exact (no -0); the range is then [-a, a]
    (clip=True: each candidate narrows [-a, a] as above, d = c_i * f32(a - (-a)))
    t     = (hi - lo) / f32(2^b - 1)
    scale = fp16(t) (param_bits 16), or the ufp8 s8 of t as above (param_bits 8; no z, so no
            widening: the rounded-up scale already covers [lo, hi] = [-hi, hi])
    min   = f32(-(2^b - 1) / 2) * f32(scale)    one f32 multiplication, not stored
    code  = clamp(rint((f32(x) - min) * (1/scale)), 0, 2^b - 1), err as above

A Hadamard-rotated value is close to a Gaussian of mean zero, so the minimum of its group
says little; without it a value group of 64 channels takes 8 bits instead of 16.

Dequantization is `x̂ = code·scale + min`. It is not part of the bit-exact contract (native
code may use an FMA); this module evaluates it in float64, where it is exact.

Error bound: for every element |x - x̂| <= scale/2 up to the fp16 rounding of the scale
(relative 2^-11) and the float32 steps above; tests check scale/2·(1 + 2^-9).

Packing
-------
`bits` in 1..8. Codes are packed LSB-first as one bit stream per row: bit k of code i is
bit i·bits + k of the row, and bit n of the row is bit n mod 8 of byte n/8. For bits that
divide 8 a code never crosses a byte: code i lands in byte i·bits/8 at bit offset
(i mod (8/bits))·bits; at 2 bits byte j holds codes 4j .. 4j+3 as `c0 | c1<<2 | c2<<4 |
c3<<6`, at 4 bits `c0 | c1<<4`. At 3 bits eight codes fill three bytes, code 2 spanning
bytes 0 and 1.
"""

from __future__ import annotations

import numpy as np

from ott_gguf.errors import InvalidArgumentError

# c_i of the clipped ranges: candidate i narrows [mn, mx] by c_i of its width at each end
CLIP_SHRINK = np.array([0.0, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.225, 0.25, 0.275, 0.3], dtype=np.float32)


def _encode(xf: np.ndarray, lo: np.ndarray, hi: np.ndarray, levels: np.float32, param_bits: int, sym: bool):
    """Codes of each group of float32 xf [..., group] for the range [lo, hi] (f32 [...]) by the
    recipe above: (codes uint8 [..., group], (scale, min) as stored (min None if sym), scale and
    min as f32 [...])."""
    if sym:
        if param_bits == 8:
            scale = _scale8((hi - lo) / levels)
            s32 = decode_scale8(scale)
        else:
            scale = ((hi - lo) / levels).astype(np.float16)
            s32 = scale.astype(np.float32)
        m32 = sym_min(s32, levels)
        stored = (scale, None)
    elif param_bits == 8:
        s8, z = _params8(lo, hi, levels)
        s32 = decode_scale8(s8)
        m32 = decode_min8(z, s32)
        stored = (s8, z)
    else:
        scale = ((hi - lo) / levels).astype(np.float16)  # fp16 [...]
        mn16 = lo.astype(np.float16)  # fp16 [...]
        s32, m32 = scale.astype(np.float32), mn16.astype(np.float32)
        stored = (scale, mn16)
    inv = np.zeros_like(s32)
    np.divide(np.float32(1.0), s32, out=inv, where=s32 != 0)  # f32 [...]
    t = (xf - m32[..., None]) * inv[..., None]  # f32 [..., group]
    return np.clip(np.rint(t), 0, levels).astype(np.uint8), stored, s32, m32


def decode_scale8(s8: np.ndarray) -> np.ndarray:
    """ufp8 scales (uint8 [...]) -> float32 [...]: fp16 with bit pattern s8 << 7."""
    return (s8.astype(np.uint16) << 7).view(np.float16).astype(np.float32)


def decode_min8(z: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 minima with their float32 scales -> float32 [...]."""
    return (z.astype(np.float32) * np.float32(0.25)) * scale


def sym_min(scale: np.ndarray, levels: np.float32) -> np.ndarray:
    """The implied minimum of symmetric groups: f32(-levels/2) · scale (float32 [...])."""
    return np.float32(-0.5 * float(levels)) * scale


def _scale8(t: np.ndarray) -> np.ndarray:
    """The least ufp8 scale >= t (f32 [...], >= 0) and > 0, as int64 [...]."""
    h16 = t.astype(np.float16)
    h = h16.view(np.uint16).astype(np.int64) + (h16.astype(np.float32) < t)  # least fp16 >= t
    return np.maximum(1, (h + 127) >> 7).astype(np.uint8)  # least ufp8 >= h, > 0


def _params8(mn: np.ndarray, mx: np.ndarray, levels: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The ufp8 scale and int8 minimum of each range [mn, mx] (f32 [...]), by the recipe above."""
    s8 = _scale8((mx - mn) / levels).astype(np.int64)  # f32 [...] -> ufp8
    while True:
        s = decode_scale8(s8.astype(np.uint8))
        z = np.floor((mn / s) * np.float32(4.0))
        out = (z < -128) | (z > 127)
        if not out.any():
            return s8.astype(np.uint8), z.astype(np.int8)
        s8 = s8 + out


def quantize_groups(
    x: np.ndarray, bits: int, clip: bool = False, param_bits: int = 16, sym: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantize each group (last axis) of fp16 `x`; clip: the best of the clipped ranges;
    param_bits 8: one-byte scale (ufp8) and minimum (int8) as above; sym: symmetric groups
    (the scale alone).

    x:      fp16  [..., group]
    return: codes uint8 [..., group], scale [...] and min [...] (fp16, or uint8 and int8;
            min None if sym)
    """
    if x.dtype != np.float16:
        raise InvalidArgumentError(f"quantize_groups: input dtype {x.dtype} is not float16")
    xf = x.astype(np.float32)  # exact
    mn = xf.min(axis=-1)  # f32 [...]
    mx = xf.max(axis=-1)  # f32 [...]
    if sym:
        mx = np.where(-mn > mx, -mn, mx) + np.float32(0)  # a, as native code compares; no -0
        mn = -mx
    levels = np.float32(2**bits - 1)
    if not clip:
        codes, (scale, mn_stored), _, _ = _encode(xf, mn, mx, levels, param_bits, sym)
        return codes, scale, mn_stored
    width = mx - mn  # f32 [...]
    best = best_err = None
    for c in CLIP_SHRINK:
        d = c * width
        codes, (scale, mn_stored), s32, m32 = _encode(xf, mn + d, mx - d, levels, param_bits, sym)
        y = codes.astype(np.float32) * s32[..., None] + m32[..., None]
        e = (y - xf).astype(np.float64)
        err = np.cumsum(e * e, axis=-1)[..., -1]  # sequential float64 sum
        if best_err is None:
            best, best_err = (codes, scale, mn_stored), err
            continue
        won = err < best_err
        best = (
            np.where(won[..., None], codes, best[0]),
            np.where(won, scale, best[1]),
            None if sym else np.where(won, mn_stored, best[2]),
        )
        best_err = np.where(won, err, best_err)
    return best


def dequantize_groups(codes: np.ndarray, scale: np.ndarray, mn: np.ndarray | None, bits: int = 0) -> np.ndarray:
    """x̂ = code·scale + min in float64 (exact).

    codes uint8 [..., group], scale and mn fp16 [...] (or uint8 and int8: 8-bit parameters,
    decoded as above; mn None: symmetric groups of `bits`-bit codes) -> float64 [..., group]
    """
    if scale.dtype == np.uint8:
        s = decode_scale8(scale)
        scale, mn = s, (None if mn is None else decode_min8(mn, s))
    if mn is None:
        mn = sym_min(scale.astype(np.float32), np.float32(2**bits - 1))
    return codes.astype(np.float64) * scale.astype(np.float64)[..., None] + mn.astype(np.float64)[..., None]


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack the last axis LSB-first: uint8 [..., n] -> uint8 [..., n·bits/8]."""
    n = codes.shape[-1]
    if not 1 <= bits <= 8 or n * bits % 8:
        raise InvalidArgumentError(f"pack_codes: {n} codes at {bits} bits do not fill whole bytes")
    shifts = np.arange(bits, dtype=np.uint8)  # [bits]
    stream = (codes[..., None] >> shifts) & np.uint8(1)  # [..., n, bits]
    return np.packbits(stream.reshape(*codes.shape[:-1], n * bits), axis=-1, bitorder="little")


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of pack_codes: uint8 [..., m] -> uint8 [..., m·8/bits]."""
    m = packed.shape[-1]
    stream = np.unpackbits(packed, axis=-1, bitorder="little")  # [..., 8m]
    stream = stream.reshape(*packed.shape[:-1], m * 8 // bits, bits)
    weights = np.uint8(1) << np.arange(bits, dtype=np.uint8)  # [bits]
    return (stream * weights).sum(axis=-1, dtype=np.uint16).astype(np.uint8)
