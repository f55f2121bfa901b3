"""KV cache footprint: bytes per token per layer and average bits per element, all counted.

Accounting per KV head (one sequence), by store:

    sink        n_sink · 2·head_dim fp16 (K and V); positions implicit
    codes       per block: head_dim·block·(bits_k + bits_v)/8 bytes; with key tiers the keys'
                block·Σ key_row_bits/8 (config.py) instead of head_dim·block·bits_k/8; the
                newest min(recent, blocks) blocks at the widths of recent_cfg (codes and scales)
    scales      per block: scale and min for every group, 2 bytes each (fp16) or 1 (param_bits 8),
                (block·head_dim/group_k + block·head_dim/group_v) · 2 · that (either key axis);
                with key tiers also the channel order, head_dim bytes
    masks       per block: block/8 bytes, only in layers that trace (no mask needed elsewhere)
    sparse      KVQuant per block: n_out keys and n_out values (kvquant.n_outliers), each an
                fp16 value and a uint16 index: 2·n_out·4 bytes
    pool        per token: 2·head_dim fp16 + int32 position
    extra_pool  per token: 2·head_dim fp16 + int32 position
    window      n_window · 2·head_dim fp16; positions implicit
    local       sliding-window (local) layers: their fp16 ring, min(n_ctx, ring_rows) tokens
                · 2·head_dim, whatever the mode (native/src/kv/kv_layered.h)

A masked slot keeps its codes, so an outlier token costs its codes plus its pool entry.

KVQuant blocks (kvq = 1): codes as above; scales = fp16 zero and scale per token of the
values, block·2·2 bytes (keys have no per-block parameters: their calibrated channel ranges
and the codebooks are per model, head_dim·2·4 bytes per layer and KV head plus 2^b·4 per
codebook, constant in n_ctx and not counted); sparse as above. Sink and window hold fp16
tokens as in every scheme.

`footprint` is the formula at a context of n_ctx tokens: the schedule fixes the sink, block
and window counts exactly; after the first event the pool is full; the extra pool is counted
at the most it can hold, min(extra_pool, pool·(events - 1)) — an upper bound, since how many
tokens get evicted depends on the data. `measure` applies the same accounting to real state.

bits_per_element = 8·total_bytes / (n_ctx · n_layer · n_head_kv · 2·head_dim)
bytes_per_token_per_layer = total_bytes / (n_ctx · n_layer)   (all KV heads, K and V)
"""

from __future__ import annotations

from dataclasses import dataclass

from ott_gguf.errors import InvalidArgumentError

from .cache import LayerCache
from .config import KVConfig
from .kvquant import n_outliers

STORES = ("sink", "codes", "scales", "masks", "sparse", "pool", "extra_pool", "window", "local")
SPARSE_BYTES = 4  # one sparse entry: fp16 value + uint16 index
FP16_BYTES = 2
POS_BYTES = 4


@dataclass(frozen=True)
class Footprint:
    n_ctx: int
    bytes: dict[str, int]  # bytes per store (STORES), all layers and KV heads, one sequence
    total_bytes: int
    bytes_per_token_per_layer: float
    bits_per_element: float


def _summarize(by_store: dict[str, int], n_ctx: int, n_layer: int, n_head_kv: int, head_dim: int) -> Footprint:
    total = sum(by_store.values())
    return Footprint(
        n_ctx, by_store, total, total / (n_ctx * n_layer), 8 * total / (n_ctx * n_layer * n_head_kv * 2 * head_dim)
    )


def ring_rows(n_swa: int, n_ctx: int, n_ubatch: int) -> int:
    """Rows per sequence of a local layer's fp16 ring: the window and the largest chunk a step
    appends (kv_layered.cpp), at most the context."""
    return min(n_ctx, n_swa - 1 + n_ubatch)


def footprint(
    cfg: KVConfig,
    n_ctx: int,
    head_dim: int,
    n_head_kv: int,
    n_layer: int,
    local: frozenset[int] = frozenset(),
    ring: int = 0,
) -> Footprint:
    """The formula for one sequence of n_ctx tokens; the layers in `local` keep an fp16 ring
    of `ring` rows instead (ring_rows), the others the cache of `cfg`."""
    if n_ctx <= 0 or n_head_kv <= 0 or n_layer <= 0:
        raise InvalidArgumentError(f"footprint: n_ctx={n_ctx} n_head_kv={n_head_kv} n_layer={n_layer} must be > 0")
    cfg = cfg.for_head_dim(head_dim)
    token = 2 * head_dim * FP16_BYTES
    n_sink = min(cfg.sink, n_ctx)
    n_blocks = max(0, n_ctx - n_sink - cfg.window) // cfg.block if cfg.quantized else 0
    n_window = n_ctx - n_sink - n_blocks * cfg.block
    by_store = dict.fromkeys(STORES, 0)
    for il in range(n_layer):
        head = dict.fromkeys(STORES, 0)
        if il in local:
            head["local"] = min(n_ctx, ring) * token
            by_store["local"] += n_head_kv * head["local"]
            continue
        head["sink"] = n_sink * token
        head["window"] = n_window * token
        n_recent = min(cfg.recent, n_blocks)
        for c, n in ((cfg, n_blocks - n_recent), (cfg.recent_cfg if n_recent else cfg, n_recent)):
            if n == 0:
                continue
            head["codes"] += n * c.block * (sum(c.key_row_bits(head_dim)) + head_dim * c.bits_v) // 8
            if cfg.kvq:
                head["scales"] += n * c.block * 2 * FP16_BYTES
                head["sparse"] += n * 2 * n_outliers(c, head_dim) * SPARSE_BYTES
            else:
                params = 2 * c.block * head_dim // c.group_k + (2 - c.sym_v) * c.block * head_dim // c.group_v
                head["scales"] += n * params * (FP16_BYTES if c.param_bits == 16 else 1)  # either key axis
                head["scales"] += n * head_dim if c.tiered else 0
        if n_blocks and cfg.traces(il):
            head["masks"] = n_blocks * cfg.block // 8
            head["pool"] = cfg.pool * (token + POS_BYTES)
            head["extra_pool"] = min(cfg.extra_pool, cfg.pool * (n_blocks - 1)) * (token + POS_BYTES)
        for name in STORES:
            by_store[name] += n_head_kv * head[name]
    return _summarize(by_store, n_ctx, n_layer, n_head_kv, head_dim)


def measure(layers: list[LayerCache]) -> Footprint:
    """The same accounting over the real state of one sequence's layer caches."""
    first = layers[0]
    by_store = dict.fromkeys(STORES, 0)
    for layer in layers:
        traces = layer.cfg.traces(layer.il)
        for head in layer.heads:
            token = 2 * head.head_dim * FP16_BYTES
            by_store["sink"] += len(head.sink) * token
            by_store["window"] += len(head.window) * token
            by_store["pool"] += len(head.pool) * (token + POS_BYTES)
            by_store["extra_pool"] += len(head.extra) * (token + POS_BYTES)
            for b in head.blocks:
                by_store["codes"] += b.k_codes.nbytes + b.v_codes.nbytes
                by_store["masks"] += b.mask.nbytes if traces else 0
                if layer.cfg.kvq:
                    by_store["scales"] += b.v_zero.nbytes + b.v_scale.nbytes
                    by_store["sparse"] += sum(a.nbytes for a in (b.k_out_idx, b.k_out_val, b.v_out_idx, b.v_out_val))
                    continue
                by_store["scales"] += b.k_scale.nbytes + b.k_min.nbytes + b.v_scale.nbytes + b.v_min.nbytes
                by_store["scales"] += b.k_order.nbytes
    return _summarize(by_store, first.n_tokens, len(layers), first.n_head_kv, first.head_dim)
