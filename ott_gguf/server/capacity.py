"""How many slots the server runs: asked for, or as many as fit a KV memory budget.

A slot is one sequence of n_ctx tokens. Its KV bytes are what the cache allocates for it at
most (`Weights.kv_seq_bytes`: the stored data of a full slot, `Weights.kv_footprint`, plus
the alignment of head-block arrays and the whole window ring and pools): this is where a
quantized cache turns into more concurrent users than an f16 cache in the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..model import kv_mode_name
from ..reference.config import KVConfig

MAX_SLOTS = 4096  # the native context's n_seq_max limit (ott.h)


@dataclass(frozen=True)
class SlotPlan:
    n_slots: int
    n_ctx: int  # tokens per slot
    kv: str  # KV mode name
    bytes_per_slot: int  # KV bytes allocated for one slot, at most
    bits_per_element: float  # of a full slot
    kv_memory: int | None  # the budget the count was chosen from, if any
    f16_slots: int | None  # slots an f16 cache would fit in the same budget
    reason: str  # one line: how many slots and why


def plan_slots(
    weights,
    kv_config: KVConfig,
    n_ctx: int,
    parallel: int | None,
    kv_memory: int | None,
    n_ubatch: int = 512,
    prefill_fp16: bool = False,
) -> SlotPlan:
    """parallel None: the most slots whose cache fits kv_memory bytes; else `parallel` slots,
    checked against kv_memory when one is given."""
    kv = kv_mode_name(kv_config)
    fp = weights.kv_footprint(kv_config, n_ctx)
    per_slot = weights.kv_seq_bytes(kv_config, n_ctx, n_ubatch, prefill_fp16)
    what = f"{kv} cache, {fp.bits_per_element:.2f} bits per element, {_mib(per_slot)} per slot of {n_ctx} tokens"
    if parallel is None:
        if kv_memory is None:
            raise InvalidArgumentError("choosing the slot count needs a KV memory budget")
        n_slots = min(MAX_SLOTS, kv_memory // per_slot)
        if n_slots < 1:
            raise InvalidArgumentError(f"a KV budget of {_mib(kv_memory)} holds no slot: {what}")
        f16 = min(MAX_SLOTS, kv_memory // weights.kv_seq_bytes("f16", n_ctx, n_ubatch))
        reason = f"{n_slots} slots fit the KV budget of {_mib(kv_memory)} ({what}; an f16 cache would fit {f16})"
        return SlotPlan(n_slots, n_ctx, kv, per_slot, fp.bits_per_element, kv_memory, f16, reason)
    if not 1 <= parallel <= MAX_SLOTS:
        raise InvalidArgumentError(f"slots must be in [1, {MAX_SLOTS}], got {parallel}")
    if kv_memory is not None and parallel * per_slot > kv_memory:
        raise InvalidArgumentError(
            f"{parallel} slots need {_mib(parallel * per_slot)} of KV cache, more than the "
            f"budget of {_mib(kv_memory)} ({what})"
        )
    reason = f"{parallel} slots as asked, {_mib(parallel * per_slot)} of KV cache when full ({what})"
    return SlotPlan(parallel, n_ctx, kv, per_slot, fp.bits_per_element, kv_memory, None, reason)


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"
