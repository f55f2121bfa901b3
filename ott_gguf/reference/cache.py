"""The KV cache of one layer of one sequence (docs/design.md §2): stores, schedule, appends.

Every KV head has its own state (`HeadCache`); the heads of a layer receive the same tokens,
so their schedules agree and only their outlier choices differ.

Stores of a head, in attention order:

    sink        fp16, the first `sink` tokens of the sequence, kept forever
    blocks      quantized blocks (block.py), oldest first, block j = positions
                sink + j·block .. sink + (j+1)·block - 1
    pool        fp16, up to `pool` outlier tokens (OTT), ascending position
    extra       fp16, up to `extra_pool` tokens evicted from the pool, in eviction order
    window      fp16, the most recent tokens, ascending position

Schedule: a token goes to the sink while the sink holds fewer than `sink` tokens, otherwise
to the window. When the window holds `window + block` tokens (R + block), its oldest `block`
tokens are quantized at once (one quantization event, outliers.py then block.py), so after
every append the window holds R .. R+block-1 tokens (fewer only before R tokens arrived).
The fp16 mode (bits 16) never quantizes: every token stays in the window.

Recent blocks (recent = N > 0): an event codes its block with `cfg.recent_cfg` (4-bit keys
and values); the same event first re-codes the block N events older into the cache's own
codes: its keys and values dequantized (float64, exact), rounded to float32 and then to
fp16, the masked slots substituted by the mean again, quantized as any block (block.py). So
the newest min(N, blocks) blocks are always those of recent_cfg. The 2-bit errors of the
newest tokens cost about half of ottr2t's KL to f16 (docs/results.md).

Skip layers (il < skip_layers) and configs with pool 0 never trace: they have no pool and
no extra pool, never substitute, and all their mask bits are 0 (KIVI).

Positions are sequence positions: the n-th token appended has position n (0-based).

The KVQuant scheme (kvq = 1) keeps this schedule and replaces what an event stores: a
KVQBlock (kvquant.py) from the head's calibrated tables; it traces outlier tokens only with
a pool (the specification's composition of the two schemes; the runtime refuses it). With
pre_rope its stores (sink and window too) hold keys before RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ott_gguf.errors import InvalidArgumentError

from . import kvquant
from .block import QuantBlock, quantize_block
from .config import KVConfig
from .outliers import can_trace, substitute_mean, trace
from .store import TokenStore, to_fp16


@dataclass
class HeadCache:
    cfg: KVConfig  # resolved for head_dim (KVConfig.for_head_dim)
    head_dim: int
    sink: TokenStore  # fp16 [<= sink, head_dim]
    pool: TokenStore  # fp16 [<= pool, head_dim]
    extra: TokenStore  # fp16 [<= extra_pool, head_dim]
    window: TokenStore  # fp16 [R .. R+block-1, head_dim] once R tokens arrived
    tracing: bool  # OTT active; False for non-tracing layers and after the stop rule
    blocks: list[QuantBlock | kvquant.KVQBlock] = field(default_factory=list)
    kvq: kvquant.KVQHead | None = None  # calibrated tables of the KVQuant scheme
    tier_scale: np.ndarray | None = None  # float32 [head_dim] query scale of the key tiers (block.py)
    n_tokens: int = 0  # tokens appended so far = position of the next one

    @classmethod
    def new(cls, cfg: KVConfig, il: int, head_dim: int, kvq: kvquant.KVQHead | None = None) -> HeadCache:
        if cfg.kvq and kvq is None:
            raise InvalidArgumentError(f"kv cache: layer {il}: the KVQuant scheme needs its calibrated tables")
        e = TokenStore.empty(head_dim)
        return cls(cfg.for_head_dim(head_dim), head_dim, e, e, e, e, tracing=cfg.traces(il), kvq=kvq)

    def tokens_until_event(self) -> int | None:
        """Appends until the next quantization event fires (after the last of them); None: never."""
        if not self.cfg.quantized:
            return None
        return (self.cfg.sink - len(self.sink)) + (self.cfg.window + self.cfg.block - len(self.window))

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append tokens in order, firing quantization events on the way. k, v: fp16 [n, head_dim]."""
        cfg, i, n = self.cfg, 0, len(k)
        while i < n:
            to_sink = len(self.sink) < cfg.sink
            if to_sink:
                take = min(n - i, cfg.sink - len(self.sink))
            elif cfg.quantized:
                take = min(n - i, self.tokens_until_event())
            else:
                take = n - i
            new = TokenStore(
                k[i : i + take], v[i : i + take], np.arange(self.n_tokens, self.n_tokens + take, dtype=np.int32)
            )
            if to_sink:
                self.sink = self.sink.concat(new)
            else:
                self.window = self.window.concat(new)
            i += take
            self.n_tokens += take
            if cfg.quantized and len(self.window) == cfg.window + cfg.block:
                self._quantize_oldest_block()

    def _quantize_oldest_block(self) -> None:
        blk = self.window.select(slice(0, self.cfg.block))
        self.window = self.window.select(slice(self.cfg.block, None))
        masked = np.zeros(self.cfg.block, dtype=bool)
        if self.tracing and not can_trace(self.pool, self.extra, self.cfg.extra_pool):
            self.tracing = False
        if self.tracing:
            self.pool, self.extra, masked = trace(self.pool, self.extra, blk, self.cfg.pool)
        k = substitute_mean(blk.k, masked)
        v = substitute_mean(blk.v, masked)
        if self.cfg.kvq:
            self.blocks.append(kvquant.quantize_block(k, v, int(blk.pos[0]), self.cfg, self.kvq, masked))
        elif self.cfg.recent:
            if len(self.blocks) >= self.cfg.recent:
                j = len(self.blocks) - self.cfg.recent
                self.blocks[j] = self._recode(self.blocks[j])
            self.blocks.append(quantize_block(k, v, masked, int(blk.pos[0]), self.cfg.recent_cfg))
        else:
            self.blocks.append(quantize_block(k, v, masked, int(blk.pos[0]), self.cfg, self.tier_scale))

    def _recode(self, b: QuantBlock) -> QuantBlock:
        """A recent block in the cache's own codes (module docstring)."""
        k, v = (x.astype(np.float32).astype(np.float16) for x in b.dequantize(self.cfg.recent_cfg))
        masked = b.masked
        return quantize_block(
            substitute_mean(k, masked), substitute_mean(v, masked), masked, b.pos0, self.cfg, self.tier_scale
        )

    def block_cfg(self, j: int) -> KVConfig:
        """The config block j is coded with: recent_cfg for the newest `recent` blocks."""
        return self.cfg.recent_cfg if j >= len(self.blocks) - self.cfg.recent else self.cfg

    def tokens(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every live token once, in attention order (sink, blocks minus masked slots, pool,
        extra, window): positions int64 [n], k̂ float64 [n, head_dim], v̂ float64 [n, head_dim]."""
        parts = [(self.sink.pos, self.sink.k, self.sink.v)]
        for j, b in enumerate(self.blocks):
            k, v = b.dequantize(self.cfg, self.kvq) if self.cfg.kvq else b.dequantize(self.block_cfg(j))
            live = ~b.masked
            parts.append((b.positions[live], k[live], v[live]))
        parts += [(s.pos, s.k, s.v) for s in (self.pool, self.extra, self.window)]
        pos, ks, vs = zip(*parts)
        return (
            np.concatenate(pos).astype(np.int64),
            np.concatenate(ks).astype(np.float64),
            np.concatenate(vs).astype(np.float64),
        )


@dataclass
class LayerCache:
    cfg: KVConfig
    il: int  # layer index
    n_head_kv: int
    head_dim: int
    heads: list[HeadCache]  # [n_head_kv]

    @classmethod
    def new(
        cls,
        cfg: KVConfig,
        il: int,
        n_head_kv: int,
        head_dim: int,
        kvq: kvquant.KVQLayer | None = None,
        tier_scale: np.ndarray | None = None,
    ) -> LayerCache:
        """kvq: the layer's calibrated tables, needed by the KVQuant scheme only; tier_scale:
        float32 [n_head_kv, head_dim], the key tiers' query scale (tier_scale.py; None: 1)."""
        if n_head_kv <= 0:
            raise InvalidArgumentError(f"kv cache: n_head_kv={n_head_kv} must be > 0")
        cfg = cfg.for_head_dim(head_dim)
        heads = [HeadCache.new(cfg, il, head_dim, kvq.head(h) if cfg.kvq and kvq else None) for h in range(n_head_kv)]
        for h, head in enumerate(heads):
            head.tier_scale = None if tier_scale is None else tier_scale[h]
        return cls(cfg, il, n_head_kv, head_dim, heads)

    @property
    def n_tokens(self) -> int:
        return self.heads[0].n_tokens

    def tokens_until_event(self) -> int | None:
        return self.heads[0].tokens_until_event()

    def check_kv(self, k: np.ndarray, v: np.ndarray) -> None:
        """k, v must be [n_tokens, n_head_kv, head_dim] and alike."""
        want = (self.n_head_kv, self.head_dim)
        if k.ndim != 3 or k.shape[1:] != want or v.shape != k.shape:
            raise InvalidArgumentError(
                f"layer {self.il} kv: k {k.shape} / v {v.shape} are not [n_tokens, {want[0]}, {want[1]}]"
            )

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append new tokens of this layer: k, v float32 [n_tokens, n_head_kv, head_dim], keys
        post-RoPE (before RoPE with cfg.pre_rope)."""
        k, v = np.asarray(k), np.asarray(v)
        self.check_kv(k, v)
        k16 = to_fp16(k, f"layer {self.il} k")
        v16 = to_fp16(v, f"layer {self.il} v")
        for h, head in enumerate(self.heads):
            head.append(k16[:, h], v16[:, h])
