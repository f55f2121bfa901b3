"""One quantized block of one KV head: the raw arrays a native implementation must reproduce.

A block holds `block` consecutive token slots; slot t is position `pos0 + t`.

Keys are quantized per channel: a key group is `group_k` consecutive slots of one channel;
with key_axis 1 per token instead, as values are: `group_k` consecutive channels of one slot.
Values are quantized per token: a value group is `group_v` consecutive channels of one slot.

Byte layout (all arrays C-contiguous, row-major):

    k_codes  uint8 [head_dim, block·bits_k/8]   row c = channel c; its `block` codes packed
                                                LSB-first along slots (2 bits: byte j of row c
                                                holds slots 4j..4j+3 of channel c)
    k_scale  fp16  [block/group_k, head_dim]    [g, c] = group g (slots g·group_k ..) of channel c
    k_min    fp16  [block/group_k, head_dim]    (scales uint8 and mins int8 with param_bits 8)
                   key_axis 1: k_codes [block, head_dim·bits_k/8] and k_scale, k_min
                   [block, head_dim/group_k], laid out as the values' (same byte counts)
    v_codes  uint8 [block, head_dim·bits_v/8]   row t = slot t; its head_dim codes packed
                                                LSB-first along channels
    v_scale  fp16  [block, head_dim/group_v]    [t, g] = channels g·group_v .. of slot t
    v_min    fp16  [block, head_dim/group_v]    (sym_v 1: [block, 0], the minimum is implied)
    mask     uint8 [block/8]                    bit t (byte t//8, bit t%8) = 1: slot t is masked,
                                                its token lives in the outlier or extra pool
    k_order  uint8 [head_dim] with key tiers (else empty): the channels by rank, below

Key tiers (hi_k, lo_k > 0; keys per channel, one group per channel and block, bits_k 2)
------------------------------------------------------------------------------------------
A key error weighs in the score by the size of its channel's range times the query's value
there, and a few channels carry most of it (the RoPE pairs of large magnitude). So the
channels of a head-block are ranked by w_c = (f32(max) - f32(min)) * u_c over the block (two
float32 operations on fp16 values; u: the head's query scale, float32 [head_dim], from the
weights (ott_gguf/tier_scale.py), or 1), largest first, ties by ascending channel:
k_order[r] is the channel of rank r.
The n_hi = hi_k·head_dim/16 first ranks are coded with TIER_HI_BITS (4) bits, the n_lo =
lo_k·head_dim/16 last with TIER_LO_BITS (1), the others with bits_k; each tier's channels
are groups quantized as above at their width. Row r of the keys is the channel of rank r:
k_scale[0, r], k_min[0, r] are its parameters, and k_codes is the rows' packed codes one
after the other (n_hi rows of block·4/8 bytes, then block·2/8, then block/8), flat uint8.

A masked slot still has codes: those of the substituted values (outliers.py), which attention
never reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import KVConfig
from .quant import dequantize_groups, pack_codes, quantize_groups, unpack_codes


@dataclass
class QuantBlock:
    pos0: int  # position of slot 0
    k_codes: np.ndarray  # uint8 [head_dim, block*bits_k/8]
    k_scale: np.ndarray  # fp16  [block/group_k, head_dim] (uint8 / int8 with param_bits 8)
    k_min: np.ndarray  # fp16  [block/group_k, head_dim]
    v_codes: np.ndarray  # uint8 [block, head_dim*bits_v/8]
    v_scale: np.ndarray  # fp16  [block, head_dim/group_v]
    v_min: np.ndarray  # fp16  [block, head_dim/group_v] ([block, 0] with sym_v)
    mask: np.ndarray  # uint8 [block/8]
    k_order: np.ndarray  # uint8 [head_dim] channel of each key row (key tiers), else [0]

    @property
    def masked(self) -> np.ndarray:
        """bool [block]: True where the slot is masked out of attention."""
        return np.unpackbits(self.mask, bitorder="little").astype(bool)

    @property
    def positions(self) -> np.ndarray:
        """int64 [block]: the position of each slot."""
        return self.pos0 + np.arange(self.v_codes.shape[0], dtype=np.int64)

    def dequantize(self, cfg: KVConfig) -> tuple[np.ndarray, np.ndarray]:
        """(k̂, v̂), both float64 [block, head_dim], masked slots included."""
        block = self.v_codes.shape[0]
        head_dim = self.v_codes.shape[1] * 8 // cfg.bits_v
        v_min = None if cfg.sym_v else self.v_min
        v = _dequantize_rows(self.v_codes, self.v_scale, v_min, cfg.bits_v, cfg.group_v)
        if cfg.key_axis == 1:
            return _dequantize_rows(self.k_codes, self.k_scale, self.k_min, cfg.bits_k, cfg.group_k), v
        if cfg.tiered:
            k = np.empty((head_dim, block))
            at = 0
            for r, bits in enumerate(cfg.key_row_bits(head_dim)):
                n = block * bits // 8
                codes = unpack_codes(self.k_codes[at : at + n], bits)
                k[self.k_order[r]] = dequantize_groups(codes, self.k_scale[0, r], self.k_min[0, r])
                at += n
            return k.T, v
        n_gk = block // cfg.group_k
        k_codes = unpack_codes(self.k_codes, cfg.bits_k).reshape(head_dim, n_gk, cfg.group_k)
        k = dequantize_groups(k_codes, self.k_scale.T, self.k_min.T)  # [head_dim, n_gk, group_k]
        return k.reshape(head_dim, block).T, v


def _dequantize_rows(codes: np.ndarray, scale: np.ndarray, mn: np.ndarray | None, bits: int, group: int) -> np.ndarray:
    """Per-token groups: packed codes [block, head_dim·bits/8], parameters [block, head_dim/group]
    (mn None: symmetric groups) -> float64 [block, head_dim]."""
    block = codes.shape[0]
    c = unpack_codes(codes, bits).reshape(block, -1, group)  # [block, n_g, group]
    return dequantize_groups(c, scale, mn, bits).reshape(block, -1)


def _quantize_rows(x: np.ndarray, bits: int, group: int, cfg: KVConfig, sym: bool = False):
    """Per-token groups of x fp16 [block, head_dim] -> (packed codes, scale, min; with sym
    min is [block, 0])."""
    block, head_dim = x.shape
    xg = x.reshape(block, head_dim // group, group)
    codes, scale, mn = quantize_groups(xg, bits, bool(cfg.clip), cfg.param_bits, sym)
    if mn is None:
        mn = np.zeros((block, 0), scale.dtype)
    return pack_codes(codes.reshape(block, head_dim), bits), scale, mn


def quantize_block(
    k: np.ndarray, v: np.ndarray, masked: np.ndarray, pos0: int, cfg: KVConfig, tier_scale: np.ndarray | None = None
) -> QuantBlock:
    """Quantize one block of one KV head.

    k, v:       fp16 [block, head_dim], masked slots already substituted (outliers.py)
    masked:     bool [block]
    tier_scale: float32 [head_dim], the query scale u of the key tiers (None: 1)
    """
    block, head_dim = k.shape
    k_order = np.zeros(0, np.uint8)
    if cfg.key_axis == 1:
        k_packed, k_scale, k_min = _quantize_rows(k, cfg.bits_k, cfg.group_k, cfg)
    elif cfg.tiered:
        k_packed, k_scale, k_min, k_order = _quantize_tiers(k, cfg, tier_scale)
    else:
        kg = k.T.reshape(head_dim, block // cfg.group_k, cfg.group_k)  # [head_dim, n_gk, group_k]
        k_codes, k_scale, k_min = quantize_groups(kg, cfg.bits_k, bool(cfg.clip), cfg.param_bits)
        k_packed = pack_codes(k_codes.reshape(head_dim, block), cfg.bits_k)
        k_scale, k_min = np.ascontiguousarray(k_scale.T), np.ascontiguousarray(k_min.T)
    v_packed, v_scale, v_min = _quantize_rows(v, cfg.bits_v, cfg.group_v, cfg, bool(cfg.sym_v))
    return QuantBlock(
        pos0=pos0,
        k_codes=k_packed,
        k_scale=k_scale,
        k_min=k_min,
        v_codes=v_packed,
        v_scale=v_scale,
        v_min=v_min,
        mask=np.packbits(masked.astype(np.uint8), bitorder="little"),
        k_order=k_order,
    )


def _quantize_tiers(k: np.ndarray, cfg: KVConfig, tier_scale: np.ndarray | None):
    """Keys fp16 [block, head_dim] in tiers (above) -> (k_codes flat, k_scale, k_min [1, head_dim]
    in rank order, k_order)."""
    block, head_dim = k.shape
    kf = k.astype(np.float32)
    weight = kf.max(axis=0) - kf.min(axis=0)  # f32 [head_dim]
    if tier_scale is not None:
        weight = weight * tier_scale.astype(np.float32)
    order = np.lexsort((np.arange(head_dim), -weight))  # largest first, ties by channel
    row_bits = np.array(cfg.key_row_bits(head_dim))
    packed, scales, mins = [], [], []
    for bits in dict.fromkeys(row_bits.tolist()):  # the tiers in rank order
        rows = order[row_bits == bits]
        codes, scale, mn = quantize_groups(k.T[rows], bits, bool(cfg.clip), cfg.param_bits)  # [n, block], [n]
        packed.append(pack_codes(codes, bits).reshape(-1))
        scales.append(scale)
        mins.append(mn)
    return np.concatenate(packed), np.concatenate(scales)[None], np.concatenate(mins)[None], order.astype(np.uint8)
