"""How far a sequence's logits move when it is decoded in a batch of B sequences instead of alone.

    python bench/batch_drift.py MODEL [--device cuda] [--kv f16,ott2] [--batch 64,256] [-n 16]

For each cache mode and batch size B, one context of B slots of `-c` tokens:
- a few tracked slots (the first, middle and last ones) each read a random prompt and decode
  n greedy tokens alone, every other slot empty;
- then all B slots read their prompts (decode-faithful chunks, as the server reads them) and
  decode n steps in lock step, the tracked slots fed their own greedy tokens from alone, so
  every step compares the same input.
Printed per (mode, B): the largest logit difference per step (median, p90, max), how many
steps' argmax differ, and the top-2 logit gap alone (a flip needs a difference larger than
it). On the CPU every difference is 0; on CUDA it is the batch-size-dependent rounding that
docs/server.md's load test sees as answers that differ from the request alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ott_gguf.model import Context, Weights  # noqa: E402


def read_prompt(ctx: Context, seq: int, tokens: list[int], chunk: int) -> np.ndarray:
    """Feed the prompt in chunks that end at the cache's quantization events; its last logits."""
    i = 0
    while i < len(tokens):
        n = min(len(tokens) - i, chunk, ctx.tokens_until_event(seq) or chunk)
        logits = ctx.eval(tokens[i : i + n], seq)
        i += n
    return logits


def drift(w: Weights, kv: str, batch: int, n_ctx: int, steps: int, chunk: int, rng) -> str:
    ctx = Context(w, n_ctx=n_ctx, n_seq_max=batch, n_ubatch=chunk + batch, kv=kv)
    prompts = [rng.integers(100, w.n_vocab - 100, size=int(rng.integers(20, 90))).tolist() for _ in range(batch)]
    tracked = sorted({0, 1, 2, batch // 2, batch // 2 + 1, batch - 3, batch - 2, batch - 1} & set(range(batch)))
    alone: dict[int, tuple[np.ndarray, list[int]]] = {}
    for s in tracked:
        logits = [read_prompt(ctx, s, prompts[s], chunk)]
        toks = [int(logits[0].argmax())]
        for _ in range(steps - 1):
            logits.append(ctx.eval([toks[-1]], s))
            toks.append(int(logits[-1].argmax()))
        alone[s] = (np.array(logits), toks)
        ctx.truncate(s, 0)

    last = [read_prompt(ctx, s, prompts[s], chunk) for s in range(batch)]
    together = {s: [last[s]] for s in tracked}
    cur = [int(x.argmax()) for x in last]
    for k in range(steps - 1):
        feed = [alone[s][1][k] if s in alone else cur[s] for s in range(batch)]
        out = ctx.decode_batch(feed, [len(p) + k for p in prompts], range(batch), [True] * batch)
        cur = [int(x.argmax()) for x in out]
        for s in tracked:
            together[s].append(out[s])
    ctx.close()

    diff, gaps, flips = [], [], 0
    for s in tracked:
        a, b = alone[s][0], np.array(together[s])
        diff.append(np.abs(a - b).max(axis=1))
        flips += int((a.argmax(1) != b.argmax(1)).sum())
        top2 = np.sort(a, axis=1)[:, -2:]
        gaps.append(top2[:, 1] - top2[:, 0])
    d, g = np.concatenate(diff), np.concatenate(gaps)
    return (
        f"| {kv} | {batch} | {np.median(d):.3g} | {np.quantile(d, 0.9):.3g} | {d.max():.3g} | "
        f"{flips} / {len(d)} | {np.median(g):.3g} | {np.quantile(g, 0.1):.3g} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="GGUF file")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cpu)")
    ap.add_argument("--kv", default="f16,ott2", help="cache modes, comma-separated")
    ap.add_argument("--batch", default="64,256", help="batch sizes, comma-separated")
    ap.add_argument("-c", "--ctx", type=int, default=512, help="tokens per slot (default 512)")
    ap.add_argument("-n", "--steps", type=int, default=16, help="compared steps per tracked slot (default 16)")
    ap.add_argument("-b", "--chunk", type=int, default=512, help="prompt chunk at most (default 512)")
    args = ap.parse_args()
    w = Weights(args.model, device=args.device)
    rng = np.random.default_rng(0)
    print(f"{args.model.name}, {args.device or 'cpu'}, {args.steps} steps per tracked slot\n")
    print("| kv | batch | max abs logit diff per step: median | p90 | max | argmax differs | top-2 gap median | p10 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kv in args.kv.split(","):
        for batch in map(int, args.batch.split(",")):
            print(drift(w, kv, batch, args.ctx, args.steps, args.chunk, rng), flush=True)


if __name__ == "__main__":
    main()
