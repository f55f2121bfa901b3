"""The KVQuant scheme (arXiv 2401.18079): one quantized block of one KV head, as a third scheme
of the shared cache (cache.py keeps the schedule: sink, blocks of `block` tokens, window).

What a block stores, and how (config knob kvq = 1):

- keys per channel, **before RoPE** (pre_rope = 1; attention.py rotates each dequantized key
  at its position), normalized by the calibrated per-channel range of the layer and KV head
  (nuq.py: channel_params of thresholds lo, hi from the sidecar) — no per-block key
  parameters at all;
- values per token, normalized by the token's own range over its entries that are not
  outliers (nuq.py: token_params), fp16 zero and scale per token;
- codes index the layer's codebook of 2^b levels (K and V each; Fisher-weighted k-means from
  calibration, or uniform levels when uniform = 1), nearest level (nuq.py);
- dense-and-sparse: per block, n_out = 2 · round(outliers/20000 · block · head_dim) values of
  the keys and as many of the values are kept exactly (fp16) in a sparse store with their
  index t·head_dim + c (uint16) and replace the dense value in attention:
    keys    the n_out largest |t| of the normalized keys (t outside -1 .. 1 lies beyond the
            calibrated thresholds, which are the outliers/2 % and 1 - outliers/2 % quantiles);
    values  the n_out/2 largest values of the block, then the n_out/2 smallest of the rest.
  Equal scores: the lower index first. DEVIATION: the paper's value thresholds are per
  token over the whole hidden size (thousands of channels); one KV head's token here has
  64-128, where a 0.5 % quantile is not one value, so the budget is spent over the block.
  A fixed count keeps every head-block the same size.
- codes of an outlier are those of its own value (the nearest end level): never read.
- with an OTT pool (pool > 0; the numpy specification only, the runtime refuses it), an
  event first traces the block as the OTT scheme does (outliers.py: the tokens of smallest
  key L1 norm as stored, pre-RoPE with pre_rope), substitutes the mean for the pooled
  tokens' keys and values, and then quantizes the block as above; `mask` marks the pooled
  slots (a bit per slot, block.py's layout), which attention skips.

Byte layout of a head-block (native/src/kv/kv_layout.h: ott_kvq_block_layout):

    v_zero     fp16   [block]                     per-token zero, slot t
    v_scale    fp16   [block]
    k_codes    uint8  [head_dim, block·bits_k/8]  row c = channel c, LSB-first along slots (quant.py)
    v_codes    uint8  [block, head_dim·bits_v/8]  row t = slot t, LSB-first along channels
    k_out_idx  uint16 [n_out]                     ascending t·head_dim + c
    k_out_val  fp16   [n_out]
    v_out_idx  uint16 [n_out]
    v_out_val  fp16   [n_out]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ott_gguf.errors import InvalidArgumentError

from . import nuq
from .config import KVConfig
from .quant import pack_codes, unpack_codes


@dataclass(frozen=True)
class KVQHead:
    """Calibrated tables of one KV head of one layer."""

    k_zero: np.ndarray  # float32 [head_dim]   per-channel key zero (nuq.channel_params)
    k_scale: np.ndarray  # float32 [head_dim]
    levels_k: np.ndarray  # float32 [2^bits_k]   the layer's key codebook, ascending
    levels_v: np.ndarray  # float32 [2^bits_v]


@dataclass(frozen=True)
class KVQLayer:
    """Calibrated tables of one layer (per KV head ranges, one codebook per kind)."""

    k_lo: np.ndarray  # float32 [n_head_kv, head_dim]  lower key thresholds
    k_hi: np.ndarray  # float32 [n_head_kv, head_dim]
    levels_k: np.ndarray  # float32 [2^bits_k]
    levels_v: np.ndarray  # float32 [2^bits_v]

    def head(self, h: int) -> KVQHead:
        zero, scale = nuq.channel_params(self.k_lo[h], self.k_hi[h])
        return KVQHead(zero, scale, self.levels_k, self.levels_v)


def n_outliers(cfg: KVConfig, head_dim: int) -> int:
    """Sparse entries per block of keys (and of values): twice round(outliers/2 % of the block)."""
    return 2 * ((cfg.outliers * cfg.block * head_dim + 10000) // 20000)


def top_mask(score: np.ndarray, count: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """bool [..., n]: the `count` largest scores of the last axis (float32 [..., n]), equal
    scores by lower index, never an excluded one."""
    if exclude is not None:
        score = np.where(exclude, -np.inf, score)
    order = np.argsort(-score, axis=-1, kind="stable")[..., :count]
    mask = np.zeros(score.shape, dtype=bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask


def key_outliers(t: np.ndarray, n_out: int) -> np.ndarray:
    """Outlier mask of normalized keys t float32 [..., block, head_dim] (largest |t|)."""
    flat = np.abs(t).reshape(*t.shape[:-2], -1)
    return top_mask(flat, n_out).reshape(t.shape)


def value_outliers(v: np.ndarray, n_out: int) -> np.ndarray:
    """Outlier mask of fp16 values [..., block, head_dim]: the n_out/2 largest, then the
    n_out/2 smallest of the rest."""
    flat = v.astype(np.float32).reshape(*v.shape[:-2], -1)
    hi = top_mask(flat, n_out // 2)
    lo = top_mask(-flat, n_out // 2, exclude=hi)
    return (hi | lo).reshape(v.shape)


def normalize_keys(k: np.ndarray, tab: KVQHead) -> np.ndarray:
    """t of fp16 keys [..., head_dim] by the head's calibrated channel ranges: float32."""
    return nuq.normalize(k, tab.k_zero, tab.k_scale)


def normalize_values(v: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t float32 [..., head_dim], zero fp16 [...], scale fp16 [...]) of fp16 values whose
    entries `out` are outliers (excluded from the token's range)."""
    zero, scale = nuq.token_params(v, ~out)
    return nuq.normalize(v, zero[..., None], scale[..., None]), zero, scale


def _sparse(x: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 indices ascending, fp16 values) of the masked entries of x [block, head_dim]."""
    idx = np.flatnonzero(mask.reshape(-1))
    return idx.astype(np.uint16), x.reshape(-1)[idx].astype(np.float16)


@dataclass
class KVQBlock:
    pos0: int  # position of slot 0
    v_zero: np.ndarray  # fp16   [block]
    v_scale: np.ndarray  # fp16   [block]
    k_codes: np.ndarray  # uint8  [head_dim, block*bits_k/8]
    v_codes: np.ndarray  # uint8  [block, head_dim*bits_v/8]
    k_out_idx: np.ndarray  # uint16 [n_out]
    k_out_val: np.ndarray  # fp16   [n_out]
    v_out_idx: np.ndarray  # uint16 [n_out]
    v_out_val: np.ndarray  # fp16   [n_out]
    mask: np.ndarray  # uint8 [block/8], block.py's bits: slots whose token is in the OTT pool

    @property
    def masked(self) -> np.ndarray:
        """bool [block]: True where the slot is masked out of attention (its token is pooled)."""
        return np.unpackbits(self.mask, bitorder="little").astype(bool)

    @property
    def positions(self) -> np.ndarray:
        return self.pos0 + np.arange(len(self.v_zero), dtype=np.int64)

    def dequantize(self, cfg: KVConfig, tab: KVQHead) -> tuple[np.ndarray, np.ndarray]:
        """(k̂, v̂), both float64 [block, head_dim], sparse values put back."""
        block, head_dim = len(self.v_zero), self.k_codes.shape[0]
        kc = unpack_codes(self.k_codes, cfg.bits_k).T  # [block, head_dim]
        vc = unpack_codes(self.v_codes, cfg.bits_v)  # [block, head_dim]
        k = nuq.dequantize(kc, tab.levels_k, tab.k_zero, tab.k_scale).reshape(-1)
        v = nuq.dequantize(vc, tab.levels_v, self.v_zero[:, None], self.v_scale[:, None]).reshape(-1)
        k[self.k_out_idx.astype(np.int64)] = self.k_out_val
        v[self.v_out_idx.astype(np.int64)] = self.v_out_val
        return k.reshape(block, head_dim), v.reshape(block, head_dim)


def check_geometry(cfg: KVConfig, head_dim: int) -> None:
    """The sparse indices t·head_dim + c must fit in uint16."""
    if cfg.block * head_dim > 65536:
        raise InvalidArgumentError(
            f"kv config: kvq block={cfg.block} times head_dim={head_dim} exceeds 65536 (sparse indices are 16-bit)"
        )


def quantize_block(
    k: np.ndarray, v: np.ndarray, pos0: int, cfg: KVConfig, tab: KVQHead, masked: np.ndarray | None = None
) -> KVQBlock:
    """Quantize one block of one KV head. k, v: fp16 [block, head_dim] (keys pre-RoPE with
    pre_rope); masked: bool [block], the pooled slots, already substituted (outliers.py), or
    None: no slot."""
    if masked is None:
        masked = np.zeros(len(k), dtype=bool)
    n_out = n_outliers(cfg, k.shape[1])
    tk = normalize_keys(k, tab)
    k_out = key_outliers(tk, n_out)
    v_out = value_outliers(v, n_out)
    tv, v_zero, v_scale = normalize_values(v, v_out)
    kc = nuq.nearest_codes(tk, tab.levels_k)  # [block, head_dim]
    vc = nuq.nearest_codes(tv, tab.levels_v)
    k_idx, k_val = _sparse(k, k_out)
    v_idx, v_val = _sparse(v, v_out)
    return KVQBlock(
        pos0,
        v_zero,
        v_scale,
        pack_codes(np.ascontiguousarray(kc.T), cfg.bits_k),
        pack_codes(vc, cfg.bits_v),
        k_idx,
        k_val,
        v_idx,
        v_val,
        np.packbits(masked.astype(np.uint8), bitorder="little"),
    )
