"""Accuracy of the KVQuant cache (issue "KVQuant mode"), by the protocol of bench/accuracy.py:
WikiText-2 windows of n_ctx tokens (BOS first when the vocabulary adds it), the second half
scored, decode-faithful; perplexity, mean KL to the f16 cache, top-1 agreement, and bits per
element at n_ctx counted from the stores (reference/footprint.py: measure).

This runs the model in torch (ott_gguf/torch_model.py, the GGUF's own weights dequantized)
with the cache of the numpy specification, so it also measures what the runtime does not run
(the compositions of --compose; bench/accuracy.py measures the runtime's cache): per layer, the
window's keys (before RoPE with pre_rope) and values go through reference.LayerCache, events
and all, and attention mixes, for query i and key j, the dequantized key and value when
token j is already in a quantized block as token i is decoded (j in sink .. sink + nb(i)·block,
nb(i) = (i - sink - R) // block), else the fp16 ones — which is what decoding token by token
sees, since a block is quantized from its own tokens only. A token an event puts into the OTT
pool (--compose) stays exact from then on, in the pool or the extra pool. The f16 row is the
same torch forward with exact fp16 attention.

    python bench/kvquant_accuracy.py MODEL --sidecar MODEL.kvcalib.gguf \
        -f ../shared/data/wikitext-2-raw/wiki.test.raw --windows 2 [--ablate] [--compose]

Prints the markdown table after every window (the windows done so far).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from ott_gguf.kvq_calibration import read_sidecar  # noqa: E402
from ott_gguf.model import Weights  # noqa: E402
from ott_gguf.perplexity import kl_and_top1, token_nll, tokenize_for_windows, windows  # noqa: E402
from ott_gguf.reference import LayerCache, measure  # noqa: E402
from ott_gguf.reference.config import mode_config, preset  # noqa: E402
from ott_gguf.torch_model import TorchModel  # noqa: E402

QUERY_ROWS = 512  # query rows per attention slice (bounds the score matrices' memory)

ABLATIONS = {  # what each part buys, on kvquant2
    "kvquant2 post-RoPE keys": dict(pre_rope=0),
    "kvquant2 uniform levels": dict(uniform=1),
    "kvquant2 0 % outliers": dict(outliers=0),
    "kvquant2 no sink": dict(sink=0),
}

COMPOSITIONS = {  # OTT's pool on top (ott2's sizes): the tokens of smallest key norm in fp16
    "kvquant2 + OTT pool": ("kvquant2", dict(pool=3, extra_pool=32)),
    "kvquant3 + OTT pool": ("kvquant3", dict(pool=3, extra_pool=32)),
}


class SimulatedCache:
    """The attention hook of TorchModel.forward for one window through a reference cache."""

    def __init__(self, tm: TorchModel, cfg, tables):
        self.tm, self.cfg, self.tables = tm, cfg.for_head_dim(tm.head_dim), tables
        self.layers: list[LayerCache] = []

    def stored(self, layer: LayerCache, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """k, v [n, H_kv, d] with every quantized token replaced by its dequantized value
        (float64); pooled tokens keep theirs."""
        k, v = k.astype(np.float64), v.astype(np.float64)
        for h, head in enumerate(layer.heads):
            for b in head.blocks:
                kh, vh = b.dequantize(self.cfg, head.kvq)
                live = ~b.masked
                k[b.positions[live], h], v[b.positions[live], h] = kh[live], vh[live]
        return k, v

    def attend(self, il, q, k_pre, k_post, v):
        import torch

        cfg, tm = self.cfg, self.tm
        n = q.shape[1]
        k_in = (k_pre if cfg.pre_rope else k_post)[0].detach().numpy()
        layer = LayerCache.new(cfg, il, tm.n_head_kv, tm.head_dim, self.tables[il])
        layer.append(k_in, v[0].detach().numpy())
        self.layers.append(layer)
        kq, vq = self.stored(layer, k_in, v[0].detach().numpy())
        if cfg.pre_rope:
            kq = tm.rope.apply(kq, np.arange(n))
        rep = tm.n_head // tm.n_head_kv

        def as_t(x):
            t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
            return t.repeat_interleave(rep, dim=1).transpose(0, 1)

        ke, ve = (
            k_post[0].repeat_interleave(rep, dim=1).transpose(0, 1),
            v[0].repeat_interleave(rep, dim=1).transpose(0, 1),
        )
        kq, vq = as_t(kq), as_t(vq)  # [H, n, d]
        qh = q[0].transpose(0, 1) / math.sqrt(tm.head_dim)  # [H, n, d]
        out = torch.empty_like(qh)
        for i0 in range(0, n, QUERY_ROWS):
            i1 = min(n, i0 + QUERY_ROWS)
            i, j = torch.arange(i0, i1), torch.arange(i1)  # queries, the keys they may see
            nb = torch.clamp(i - cfg.sink - cfg.window, min=0) // cfg.block  # blocks quantized at query i
            quant = (j[None] >= cfg.sink) & (j[None] < cfg.sink + nb[:, None] * cfg.block)  # [rows, i1]
            causal = j[None] <= i[:, None]
            s = torch.where(quant, qh[:, i0:i1] @ kq[:, :i1].transpose(1, 2), qh[:, i0:i1] @ ke[:, :i1].transpose(1, 2))
            p = torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1)
            out[:, i0:i1] = (p * quant) @ vq[:, :i1] + (p * ~quant) @ ve[:, :i1]
        return out.transpose(0, 1)[None]


def print_table(rows, args) -> None:
    """The markdown table of the windows done so far."""
    f16_ppl = math.exp(np.concatenate(rows["f16"]["nll"]).mean())
    n_scored = sum(len(x) for x in rows["f16"]["nll"])
    print(
        f"\n{Path(args.model).name}: {len(rows['f16']['nll'])} windows of {args.ctx}, {n_scored} tokens scored, "
        f"decode-faithful (torch forward, reference cache)\n"
    )
    print("| cache | bits/elem | PPL | ΔPPL | mean KL | top-1 |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        ppl = math.exp(np.concatenate(r["nll"]).mean())
        print(
            f"| {name} | {np.mean(r['bits']):.2f} | {ppl:.3f} | {100 * (ppl / f16_ppl - 1):+.2f} % | "
            f"{np.concatenate(r['kl']).mean():.4f} | {100 * np.concatenate(r['top1']).mean():.1f} % |",
            flush=True,
        )


def metrics(ref_logits, logits, targets):
    """(NLL [m], KL [m], top-1 [m]) over the scored rows."""
    kl, top1 = kl_and_top1(ref_logits, logits)
    return token_nll(logits, targets), kl, top1


def sidecar_replay_parser(doc: str, windows: int) -> argparse.ArgumentParser:
    """The arguments of the replays that read a sidecar (this and bench/layer_scheme.py):
    MODEL, --sidecar, -f, --ctx, --windows (default `windows`); -t is added by the caller last."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--sidecar", required=True, help="calibration sidecar with KVQuant tables")
    ap.add_argument("-f", "--file", required=True)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=windows)
    return ap


def main(argv=None) -> int:
    import torch

    ap = sidecar_replay_parser(__doc__, windows=2)
    ap.add_argument("--modes", default="kvquant2,kvquant3,kvquant4", help="presets, with knobs: kvquant2:outliers=116")
    ap.add_argument("--ablate", action="store_true", help="also the ablations of kvquant2")
    ap.add_argument("--compose", action="store_true", help="also kvquant2/3 with OTT's pool")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    weights = Weights(args.model, device="cpu")
    text = Path(args.file).read_text(encoding="utf-8")
    ids = tokenize_for_windows(weights.tokenize, text, args.ctx * args.windows)
    bos = weights.tokenizer.bos_id if weights.tokenizer.add_bos else None
    weights.close()
    tm = TorchModel(args.model)
    cal = read_sidecar(args.sidecar, tm.n_layer)
    configs = {spec: mode_config(spec) for spec in args.modes.split(",")}
    if args.ablate:
        configs.update({name: preset("kvquant2").with_overrides(**o) for name, o in ABLATIONS.items()})
    if args.compose:
        configs.update({name: preset(base).with_overrides(**o) for name, (base, o) in COMPOSITIONS.items()})
    rows = {name: {"nll": [], "kl": [], "top1": [], "bits": []} for name in ["f16", *configs]}
    half = args.ctx // 2
    for w, window in enumerate(windows(ids, args.ctx, min(args.windows, len(ids) // args.ctx), bos)):
        tokens = torch.from_numpy(window.astype(np.int64))[None]
        targets = window[half + 1 :]
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = tm.forward(tokens)[0, half:-1].numpy()
        r = rows["f16"]
        for key, x in zip(("nll", "kl", "top1"), metrics(ref, ref, targets)):
            r[key].append(x)
        r["bits"].append(16.0)
        print(f"window {w}: f16 {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        for name, cfg in configs.items():
            t0 = time.perf_counter()
            sim = SimulatedCache(tm, cfg, cal.layers(cfg))
            with torch.no_grad():
                logits = tm.forward(tokens, attend=sim.attend)[0, half:-1].numpy()
            r = rows[name]
            for key, x in zip(("nll", "kl", "top1"), metrics(ref, logits, targets)):
                r[key].append(x)
            r["bits"].append(measure(sim.layers).bits_per_element)
            print(f"window {w}: {name} {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        print_table(rows, args)  # after every window: a long run reports as it goes

    return 0


if __name__ == "__main__":
    sys.exit(main())
