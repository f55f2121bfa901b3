"""Tokens kept finer when a recent block is re-coded: a replay of `ottr2tr` (docs/results.md,
"Tokens kept finer at the re-coding").

The model runs in torch (ott_gguf/torch_model.py, the GGUF's weights dequantized) with the
numpy specification's cache per layer (reference.LayerCache, events and all), decode-faithful
for a cache with recent blocks: query i sees key j in fp16 while j's block is being filled,
in its 4-bit recent version while the block is among the newest `recent` quantized blocks
when token i is decoded, and in the preset's 2-bit codes after the block was re-coded.
(bench/kvquant_accuracy.py replays caches whose blocks are coded once.)

At the re-coding, `k` tokens of each block — not pooled, with the most attention received
while the block was recent (the softmax weights of every query in that time summed over the
query heads of the KV head; exact attention) — are kept finer, by kind:
    ref    their 2-bit codes plus 2 bits a channel of the residual between the 4-bit version
           and the 2-bit one, over ± half the 2-bit step (levels ±step/8, ±3·step/8, the
           residual clipped there): 2·(2·head_dim) + 7 bits a kept token, no parameters
    4bit   their 4-bit recent version, as it was (no storage defined)
    exact  fp16 (no storage defined)
Variants: RECENT or RECENT+KIND+K, e.g. 5 (ottr2tr), 4+ref+4. `--look-ahead` ranks by the
largest weight any scored query gives a token instead (an oracle, for comparison);
`--head-max` by the one query head of a KV head that received most, not by their sum. Bits
per element at n_ctx count the stores (reference/footprint.py: measure) plus, for ref, the
kept tokens' refinements.

    python bench/kept_replay.py MODEL -f ../shared/data/wikitext-2-raw/wiki.test.raw \
        --variants 5,6,4+ref+4 [--windows 1] [--ctx 4096] [-t 2]

The f16 row is the same torch forward with exact attention; KL and top-1 against it over the
second half of each window. The torch forward leaves out the runtime's 8-bit rounding of
matmul inputs, so its KLs run 0.002–0.004 below `bench/accuracy.py`'s (docs/results.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ott_gguf.model import Weights  # noqa: E402
from ott_gguf.perplexity import kl_and_top1, tokenize_for_windows, windows  # noqa: E402
from ott_gguf.reference import LayerCache, measure  # noqa: E402
from ott_gguf.reference.config import KVConfig, preset  # noqa: E402
from ott_gguf.reference.quant import dequantize_groups  # noqa: E402
from ott_gguf.reference.rotation import hadamard  # noqa: E402
from ott_gguf.torch_model import TorchModel  # noqa: E402

QUERY_ROWS = 512  # query rows per attention slice (bounds the score matrices' memory)
INDEX_BITS = 7  # a kept token's slot in its block of 128


def stored(layer: LayerCache, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each block's stored version at the end of the window: k̂, v̂ float64 [H_kv, n, d] (NaN
    outside the blocks), and pooled bool [H_kv, n]."""
    H, d = layer.n_head_kv, layer.head_dim
    k, v = np.full((H, n, d), np.nan), np.full((H, n, d), np.nan)
    pooled = np.zeros((H, n), bool)
    for h, head in enumerate(layer.heads):
        for j, b in enumerate(head.blocks):
            p = b.positions
            k[h, p], v[h, p] = b.dequantize(head.block_cfg(j))
            pooled[h, p[b.masked]] = True
    return k, v, pooled


def steps(layer: LayerCache, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The code step of every stored key and value: float64 [H_kv, n, d] (NaN outside blocks);
    keys in one group a channel and block (key_axis 0, group_k = block, as ottr2tr)."""
    H, d = layer.n_head_kv, layer.head_dim
    dk, dv = np.full((H, n, d), np.nan), np.full((H, n, d), np.nan)
    for h, head in enumerate(layer.heads):
        for j, b in enumerate(head.blocks):
            cfg, p = head.block_cfg(j), b.positions
            rows = b.k_scale.shape[1]
            step = (
                dequantize_groups(np.ones((rows, 1), np.uint8), b.k_scale[0], b.k_min[0])
                - dequantize_groups(np.zeros((rows, 1), np.uint8), b.k_scale[0], b.k_min[0])
            )[:, 0]
            by_channel = np.empty(d)
            by_channel[b.k_order if len(b.k_order) else np.arange(d)] = step
            dk[h, p] = by_channel
            n_gv, v_min = b.v_scale.shape[1], None if cfg.sym_v else b.v_min
            one = dequantize_groups(np.ones((len(p), n_gv, 1), np.uint8), b.v_scale, v_min, cfg.bits_v)
            zero = dequantize_groups(np.zeros((len(p), n_gv, 1), np.uint8), b.v_scale, v_min, cfg.bits_v)
            dv[h, p] = np.repeat((one - zero)[..., 0], d // n_gv, axis=1)
    return dk, dv


def refine(x2: np.ndarray, x4: np.ndarray, step: np.ndarray) -> np.ndarray:
    """x2 plus the residual x4 - x2 in 2 bits over ± step/2 (levels ±step/8, ±3·step/8)."""
    q = step / 4
    return x2 + (np.clip(np.floor((x4 - x2) / q), -2, 1) + 0.5) * q


class Replay:
    """The attention hook of TorchModel.forward for one window: cfg's cache, kind/k kept."""

    def __init__(
        self, tm: TorchModel, cfg: KVConfig, tier_scale: np.ndarray, kind: str, k: int, ahead: int = 0, head_max=False
    ):
        self.tm, self.cfg, self.tier_scale, self.kind, self.k = tm, cfg, tier_scale, kind, k
        self.ahead = ahead  # > 0: rank by the largest weight from queries >= ahead (looks ahead)
        self.head_max = head_max  # rank by the query head that received most, not the heads' sum
        self.layers: list[LayerCache] = []

    def importance(self, qh, ke_rot, n: int):
        """Attention each key received while its block was recent: float64 [H_kv, n], summed
        over the KV head's query heads (head_max: the largest of their sums; with ahead, the
        largest weight any query from `ahead` on gives it, any of the heads)."""
        import torch

        tm, cfg = self.tm, self.cfg
        rep = tm.n_head // tm.n_head_kv
        imp = torch.zeros(tm.n_head_kv, rep, n, dtype=torch.float64)
        bj = torch.arange(n)[None] // cfg.block
        keys = ke_rot.repeat_interleave(rep, 0).transpose(1, 2)
        for i0 in range(0, n, QUERY_ROWS):
            i = torch.arange(i0, min(n, i0 + QUERY_ROWS))
            s = (qh[:, i] @ keys).masked_fill(torch.arange(n)[None, None] > i[None, :, None], -math.inf)
            p = torch.softmax(s, -1).view(tm.n_head_kv, rep, len(i), n)
            if self.ahead:
                imp = torch.maximum(imp, (p * (i >= self.ahead)[None, None, :, None]).amax(dim=2))
                continue
            nb = (i // cfg.block)[:, None]  # blocks quantized when token i attends
            imp += (p * ((bj < nb) & (bj >= nb - cfg.recent))[None, None]).sum(2)  # [H_kv, rep, n]
        return (imp.amax(1) if self.head_max or self.ahead else imp.sum(1)).numpy()

    def attend(self, il, q, k_pre, k_post, v):
        import torch

        tm, cfg = self.tm, self.cfg
        n, Hk, d = q.shape[1], tm.n_head_kv, tm.head_dim
        rep = tm.n_head // Hk
        k_in = (k_pre if cfg.pre_rope else k_post)[0].detach().numpy()
        R = np.stack([hadamard(d, il, h, True) for h in range(Hk)])  # values rotated as the cache does
        v_in = np.einsum("nhd,hed->nhe", v[0].detach().numpy().astype(np.float64), R).astype(np.float32)
        cache = LayerCache.new(cfg, il, Hk, d, None, self.tier_scale[il])
        cache.append(k_in, v_in)
        recent = LayerCache.new(cfg.with_overrides(recent=n // cfg.block + 1), il, Hk, d, None, self.tier_scale[il])
        recent.append(k_in, v_in)  # every block in its recent version
        self.layers.append(cache)
        k2, v2, pooled = stored(cache, n)
        k4, v4, _ = stored(recent, n)
        ke = k_in.astype(np.float16).astype(np.float64).transpose(1, 0, 2)  # [H_kv, n, d]
        ve = v_in.astype(np.float16).astype(np.float64).transpose(1, 0, 2)

        def rope(x):
            x = tm.rope.apply(x.transpose(1, 0, 2), np.arange(n)).transpose(1, 0, 2) if cfg.pre_rope else x
            return torch.from_numpy(np.ascontiguousarray(x))

        qh = (q[0].transpose(0, 1) / math.sqrt(d)).double()  # [H, n, d]
        kE = rope(ke)
        if self.k:
            imp = self.importance(qh, kE, n)
            kept = np.zeros((Hk, n), bool)
            for h in range(Hk):
                for b0 in range(0, n - cfg.block + 1, cfg.block):
                    cand = b0 + np.flatnonzero(~pooled[h, b0 : b0 + cfg.block])
                    kept[h, cand[np.argsort(-imp[h, cand], kind="stable")[: self.k]]] = True
            if self.kind == "ref":
                dk, dv = steps(cache, n)
                k_new, v_new = refine(k2, k4, dk), refine(v2, v4, dv)
            else:
                k_new, v_new = (k4, v4) if self.kind == "4bit" else (ke, ve)
            k2[kept], v2[kept] = k_new[kept], v_new[kept]
            if self.kind == "exact":
                k4[kept], v4[kept] = ke[kept], ve[kept]
        for x, y in ((k2, ke), (v2, ve), (k4, ke), (v4, ve)):  # pooled slots and the open block: exact
            exact = np.isnan(x[..., 0]) | pooled
            x[exact] = y[exact]
        K2, K4 = rope(k2), rope(k4)
        V2, V4, VE = (torch.from_numpy(x) for x in (v2, v4, ve))
        out = torch.empty(tm.n_head, n, d, dtype=torch.float64)
        for i0 in range(0, n, QUERY_ROWS):
            i1 = min(n, i0 + QUERY_ROWS)
            i, j = torch.arange(i0, i1), torch.arange(i1)
            nb, bj = (i // cfg.block)[:, None], (j // cfg.block)[None]
            old = bj < nb - cfg.recent
            rec = (bj < nb) & ~old

            def part(X, i1=i1):
                return X[:, :i1].repeat_interleave(rep, 0)

            qs = qh[:, i0:i1]
            s = torch.where(
                old,
                qs @ part(K2).transpose(1, 2),
                torch.where(rec, qs @ part(K4).transpose(1, 2), qs @ part(kE).transpose(1, 2)),
            )
            p = torch.softmax(s.masked_fill(j[None, None] > i[None, :, None], -math.inf), -1)
            out[:, i0:i1] = (p * old) @ part(V2) + (p * rec) @ part(V4) + (p * ~(old | rec)) @ part(VE)
        out = out @ torch.from_numpy(R).repeat_interleave(rep, 0)  # the values rotated back
        return out.float().transpose(0, 1)[None]

    def bits(self) -> float:
        """Bits per element of the caches at the end of the window, the kept refinements included."""
        bits = measure(self.layers).bits_per_element
        if self.kind != "ref" or not self.k:
            return bits
        first = self.layers[0]
        old = max(0, len(first.heads[0].blocks) - self.cfg.recent)
        per_token = 2 * 2 * first.head_dim + INDEX_BITS
        n_el = first.n_tokens * 2 * first.head_dim
        return bits + old * self.k * per_token / n_el


def window_tokens(model: str, file: str, n_tokens: int) -> tuple[np.ndarray, int | None, np.ndarray]:
    """The token ids of the text for windows of n_tokens in all (tokenize_for_windows), the
    BOS id when the vocabulary adds one (else None), and the model's key-tier query scales."""
    weights = Weights(model, device="cpu")
    try:
        ids = tokenize_for_windows(weights.tokenize, Path(file).read_text(encoding="utf-8"), n_tokens)
        return ids, weights.tokenizer.bos_id if weights.tokenizer.add_bos else None, weights.tier_scale()
    finally:
        weights.close()


def parse_variant(spec: str) -> tuple[int, str, int]:
    """'5' -> (5, '', 0); '4+ref+4' -> (4, 'ref', 4)."""
    parts = spec.split("+")
    if len(parts) == 1:
        return int(parts[0]), "", 0
    if len(parts) != 3 or parts[1] not in ("ref", "4bit", "exact"):
        raise SystemExit(f"error: variant {spec!r}: RECENT or RECENT+ref|4bit|exact+K")
    return int(parts[0]), parts[1], int(parts[2])


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-f", "--file", required=True)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--variants", default="5,4+ref+4", help="RECENT or RECENT+KIND+K, comma-separated")
    ap.add_argument(
        "--look-ahead",
        action="store_true",
        help="rank the kept tokens by the largest weight a scored query gives them (an oracle)",
    )
    ap.add_argument(
        "--head-max",
        action="store_true",
        help="rank by the query head that received most, instead of the KV head's query heads summed",
    )
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = [(spec, *parse_variant(spec)) for spec in args.variants.split(",")]

    ids, bos, tier_scale = window_tokens(args.model, args.file, args.ctx * args.windows)
    tm = TorchModel(args.model)
    base = preset("ottr2tr")
    results = {spec: {"kl": [], "top1": [], "bits": []} for spec, *_ in variants}
    half = args.ctx // 2
    for w, window in enumerate(windows(ids, args.ctx, min(args.windows, len(ids) // args.ctx), bos)):
        tokens = torch.from_numpy(window.astype(np.int64))[None]
        with torch.no_grad():
            ref = tm.forward(tokens)[0, half:-1].numpy()
        for spec, recent, kind, k in variants:
            t0 = time.perf_counter()
            cfg = base.with_overrides(recent=recent).for_head_dim(tm.head_dim)
            replay = Replay(tm, cfg, tier_scale, kind, k, half if args.look_ahead else 0, args.head_max)
            with torch.no_grad():
                logits = tm.forward(tokens, attend=replay.attend)[0, half:-1].numpy()
            kl, top1 = kl_and_top1(ref, logits)
            r = results[spec]
            r["kl"].append(kl)
            r["top1"].append(top1)
            r["bits"].append(replay.bits())
            print(f"window {w}: {spec} {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        print(f"\n{Path(args.model).name}: {w + 1} windows of {args.ctx}, second halves scored\n")
        print("| recent blocks + kept tokens | bits at ctx | KL to exact | top-1 |\n|---|---:|---:|---:|")
        for spec, r in results.items():
            kl, top1 = np.concatenate(r["kl"]).mean(), 100 * np.concatenate(r["top1"]).mean()
            print(f"| {spec} | {np.mean(r['bits']):.2f} | {kl:.4f} | {top1:.2f} % |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
