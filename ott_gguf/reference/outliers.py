"""Outlier Token Tracing at one quantization event of one KV head (docs/design.md §2).

This is a reconstruction of arXiv 2505.10938 (the paper body and code could not be read);
the choices below that the paper may make differently are marked DEVIATION.

1. Candidates: the `block` tokens being quantized plus the tokens now in the outlier pool.
2. Score: L1 norm of the token's key as stored (post-RoPE, fp16). The score is the exact
   sum of |k_c| over the channels: every fp16 value is a multiple of 2^-24 below 2^16, so a
   float64 sum of at most 8192 of them is exact in any order (native code may sum in double
   or in int64 units of 2^-24, in any order, and gets the same number).
3. The `pool` candidates with the smallest score form the new pool; equal scores are broken
   by position, the lower position wins. The pool is stored in ascending position.
4. Pool tokens that lose their place move to the extra pool, appended in ascending position.
5. Stop rule (DEVIATION, a precise reading of "when the extra pool is full"): a head traces
   at an event only if its extra pool has room for every token the event could evict, i.e.
   `extra_capacity - len(extra) >= len(pool)`. Otherwise tracing stops for that head for
   good (the pool stays as it is and is still attended); later blocks are quantized plainly.
   The extra pool therefore never overflows and ends holding more than
   `extra_capacity - pool` tokens.
6. Selected block tokens are masked in their block; before min/max are taken their K and V
   rows are replaced by the mean of the block's other (unselected) tokens, channel by
   channel: exact float64 sum, float64 division by the count, rounded to float32 and then
   to fp16 (both round to nearest even). DEVIATION note: the mean is over the whole block,
   also when group_k < block.
"""

from __future__ import annotations

import numpy as np

from .store import TokenStore


def l1_scores(k: np.ndarray) -> np.ndarray:
    """Exact L1 norm of each key: fp16 [n, head_dim] -> float64 [n]."""
    return np.abs(k.astype(np.float64)).sum(axis=1)


def can_trace(pool: TokenStore, extra: TokenStore, extra_capacity: int) -> bool:
    """The stop rule: the extra pool must have room for every possible eviction."""
    return extra_capacity - len(extra) >= len(pool)


def trace(
    pool: TokenStore, extra: TokenStore, blk: TokenStore, capacity: int
) -> tuple[TokenStore, TokenStore, np.ndarray]:
    """One OTT selection. Returns the new pool, the new extra pool and masked: bool [block].

    pool holds older positions than blk and both are in ascending position, so the candidate
    list pool ∪ blk is in ascending position too.
    """
    cand = pool.concat(blk)  # [len(pool) + block]
    order = np.lexsort((cand.pos, l1_scores(cand.k)))  # score, then position
    keep = np.zeros(len(cand), dtype=bool)
    keep[order[:capacity]] = True
    n_old = len(pool)
    evicted = pool.select(~keep[:n_old])
    return cand.select(keep), extra.concat(evicted), keep[n_old:]


def substitute_mean(x: np.ndarray, masked: np.ndarray) -> np.ndarray:
    """Replace the masked rows by the mean of the others: fp16 [block, head_dim] -> same."""
    if not masked.any():
        return x
    others = x[~masked].astype(np.float64)  # [n_other, head_dim]
    mean = (others.sum(axis=0) / np.float64(len(others))).astype(np.float32).astype(np.float16)
    out = x.copy()
    out[masked] = mean
    return out
