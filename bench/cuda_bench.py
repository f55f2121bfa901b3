"""CUDA benchmarks of the quantized KV cache on a Llama-2-7B-shaped model (random F16 weights).

    python bench/cuda_bench.py --model 7b.gguf [--kv f16,ott2,ottr2] [--contexts 4096,16384]
                               [--steps 5] [--json out.json]

1. Kernels (`ott-cuda-ops perf`): the card's device-to-device copy bandwidth, then the fused
   attention of one layer (32 KV heads of 128) of each quantized mode it times at each
   context and batch: bytes the kernel must read over its median time, as a fraction of
   the copy bandwidth.
2. Decode throughput: for each --kv mode and context, one context on the same weights with
   the largest batch that fits in the GPU's free memory (from what the mode allocates per
   sequence, Weights.kv_seq_bytes; shrunk by 10% until creation succeeds); sequence 0
   prefilled to the context in chunks of 512 ("fill_s", the seconds of the second of two
   such fills: the first warms kernels and memory pools up), then copied into the others;
   then for batch b = 1, 2, 4, ... up to that largest, tokens per second summed over b
   sequences decoding one token each (median of --steps steps after 2 warm-up steps; each
   step is one ott_decode of b tokens with their logits copied back).
3. KV bytes per token from the allocations (ott_kv_stats): bytes of the live tokens per
   token, and the allocation per token slot (n_seq_max * n_ctx).
The model is written with bench/llama7b_gguf.py when --model does not exist, and a made-up
KVQuant sidecar beside such a model when a kvquant mode has none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ott_gguf.errors import BackendError
from ott_gguf.model import Context, Weights
from ott_gguf.reference.config import parse_mode

RESERVE = 4 << 30  # compute buffers, prefill activations, CUDA context


def free_gpu_bytes() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[0]) << 20


def kernel_bench(contexts: list[int]) -> list[dict]:
    import ott_gguf._native as native

    exe = Path(native._mod.__file__).parent / "ott-cuda-ops"
    out = subprocess.run([str(exe), "perf", *map(str, contexts)], capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def open_largest(weights: Weights, kv: str, n_ctx: int, cap: int) -> Context:
    free = free_gpu_bytes() - RESERVE
    per_seq = weights.kv_seq_bytes(parse_mode(kv), n_ctx) * 1.01  # what the cache allocates, and its arrays' alignment
    n_seq = max(1, min(cap, int(free // per_seq)))
    while True:
        try:
            return Context(weights, n_ctx=n_ctx, n_seq_max=n_seq, n_ubatch=512, kv=parse_mode(kv))
        except BackendError:
            if n_seq == 1:
                raise
            n_seq = max(1, int(n_seq * 0.9))


def fill(model: Context, depth: int, rng: np.random.Generator) -> float:
    """Sequence 0 prefilled to `depth` tokens, then copied into every other sequence; seconds
    of the prefill alone (the time to first token of a `depth`-token prompt, as a server that
    has run a while sees it). The same prefill runs once before and is dropped: the first use
    of a kernel loads its module and the first long prompt grows ggml's memory pools, which
    the first mode of a run would pay alone (a warm-up of 1,024 tokens left it 4 % slower)."""
    tokens = rng.integers(0, model.n_vocab, depth).tolist()
    for _ in range(2):  # the second is timed
        model.truncate(0)
        t = time.perf_counter()
        for i in range(0, depth, 512):
            model.eval(tokens[i : i + 512], seq=0)
        secs = time.perf_counter() - t
    for s in range(1, model.n_seq_max):
        model.copy_sequence(0, s)
    return secs


def decode_rate(model: Context, batch: int, steps: int, rng: np.random.Generator) -> tuple[float, float]:
    """(tokens/s summed over the batch, median seconds per step)."""
    seqs = list(range(batch))
    times = []
    for i in range(steps + 2):
        pos = [model.seq_len(s) for s in seqs]
        toks = rng.integers(0, model.n_vocab, batch).tolist()
        t = time.perf_counter()
        model.decode_batch(toks, pos, seqs, [True] * batch)
        if i >= 2:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    return batch / step, step


def batches_upto(n: int) -> list[int]:
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--kv", default="f16,ott2,ottr2", help="KV modes, comma-separated (name:knob=value:...)")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    modes = args.kv.split(",")
    sys.path.insert(0, str(Path(__file__).parent))
    from llama7b_gguf import ensure

    ensure(args.model, modes)

    results: dict = {"kernels": [], "decode": [], "kv": []}
    if not args.skip_kernels:
        results["kernels"] = kernel_bench(sorted(set(contexts) | {8192}))
        for r in results["kernels"]:
            print(json.dumps(r), flush=True)

    weights = Weights(args.model, device="cuda")
    for kv in modes:
        for ctx in contexts:
            rng = np.random.default_rng(ctx)  # every mode fills and decodes the same tokens
            model = open_largest(weights, kv, ctx + 128, args.max_batch)  # room for the steps
            secs = fill(model, ctx, rng)
            st = model.kv_stats()
            kv_row = {
                "kv": kv,
                "ctx": ctx,
                "n_seq_max": model.n_seq_max,
                "bytes_per_token": st.bytes_per_token_layer * model.info.n_layer,
                "alloc_per_token_slot": st.bytes_allocated / (model.n_seq_max * model.n_ctx),
                "bits_per_element": st.bits_per_element,
                "fill_s": secs,
            }
            results["kv"].append(kv_row)
            print(json.dumps(kv_row), flush=True)
            for b in batches_upto(model.n_seq_max):
                rate, step = decode_rate(model, b, args.steps, rng)
                row = {"kv": kv, "ctx": ctx, "batch": b, "tok_s": rate, "step_ms": step * 1e3}
                results["decode"].append(row)
                print(json.dumps(row), flush=True)
            model.close()

    # summary
    print("\n| kv | ctx | largest batch | best tok/s (batch) | KV bytes/token | alloc/token slot |")
    print("|---|---|---|---|---|---|")
    for k in results["kv"]:
        rows = [r for r in results["decode"] if r["kv"] == k["kv"] and r["ctx"] == k["ctx"]]
        best = max(rows, key=lambda r: r["tok_s"])
        print(
            f"| {k['kv']} | {k['ctx']} | {k['n_seq_max']} | {best['tok_s']:.0f} ({best['batch']}) | "
            f"{k['bytes_per_token']:.0f} | {k['alloc_per_token_slot']:.0f} |"
        )
    for ctx in contexts:
        best = {kv: max(r["tok_s"] for r in results["decode"] if r["kv"] == kv and r["ctx"] == ctx) for kv in modes}
        largest = {k["kv"]: k["n_seq_max"] for k in results["kv"] if k["ctx"] == ctx}
        fill_s = {k["kv"]: k["fill_s"] for k in results["kv"] if k["ctx"] == ctx}
        for kv in modes[1:]:
            print(
                f"ctx {ctx}: {kv}/{modes[0]} best throughput {best[kv] / best[modes[0]]:.2f}x, "
                f"largest batch {largest[kv] / largest[modes[0]]:.1f}x, prefill speed "
                f"{fill_s[modes[0]] / fill_s[kv]:.2f}x"
            )
    for r in results["kernels"]:
        if r["op"] == "attn" and r["chosen"]:
            print(
                f"attn {r.get('mode', 'ott2')} ctx {r['ctx']} batch {r['batch']}: {r['GBps']:.0f} GB/s = "
                f"{100 * r['of_copy']:.0f}% of copy"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
