"""CUDA benchmarks of the quantized KV cache on a Llama-2-7B-shaped model (random F16 weights).

    python bench/cuda_bench.py --model 7b.gguf [--contexts 4096,16384] [--steps 5] [--json out.json]

1. Kernels (`ott-cuda-ops perf`): the card's device-to-device copy bandwidth, then the fused
   ott2 attention of one layer (32 KV heads of 128) at each context and batch: bytes the
   kernel must read over its median time, as a fraction of the copy bandwidth.
2. Decode throughput: for f16 and ott2 and each context, one context with the largest batch
   that fits in the GPU's free memory (from the per-sequence KV bytes; shrunk by 10% until
   creation succeeds); sequence 0 is prefilled to the context in chunks of 512 and copied
   into the others; then for batch b = 1, 2, 4, ... up to that largest, tokens per second
   summed over b sequences decoding one token each (median of --steps steps after 2
   warm-up steps; each step is one ott_decode of b tokens with their logits copied back).
3. KV bytes per token from the allocations (ott_kv_stats): bytes of the live tokens per
   token, and the allocation per token slot (n_seq_max * n_ctx).
The model is written with bench/llama7b_gguf.py when --model does not exist.
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
from ott_gguf.model import Model

RESERVE = 4 << 30  # compute buffers, prefill activations, CUDA context


def free_gpu_bytes() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[0]) << 20


def kv_bytes_per_seq(kv: str, n_ctx: int, n_layer: int = 32, n_kv: int = 32, hd: int = 128) -> float:
    """Bytes one sequence of n_ctx tokens allocates (as the caches lay them out)."""
    if kv == "f16":
        return 2.0 * n_layer * n_kv * hd * 2 * n_ctx
    block, window, pool, extra = 128, 32, 3, 32
    head_block = 9792  # kv_layout.h for head_dim 128, ott2
    n_blocks = (n_ctx - window) // block
    win_cap = (window + block + block - 1) // block * block
    per_head = n_blocks * head_block + win_cap * hd * 4 + (pool + extra) * (hd * 4 + 4) + 12
    return float(n_layer * n_kv * per_head)


def kernel_bench(contexts: list[int]) -> list[dict]:
    import ott_gguf._native as native

    exe = Path(native._mod.__file__).parent / "ott-cuda-ops"
    out = subprocess.run([str(exe), "perf", *map(str, contexts)], capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def open_largest(path: Path, kv: str, n_ctx: int, weights: int, cap: int) -> Model:
    free = free_gpu_bytes() - weights - RESERVE
    n_seq = max(1, min(cap, int(free // kv_bytes_per_seq(kv, n_ctx))))
    while True:
        try:
            return Model(path, n_ctx=n_ctx, n_seq_max=n_seq, n_ubatch=512, kv=kv, device="cuda")
        except BackendError:
            if n_seq == 1:
                raise
            n_seq = max(1, int(n_seq * 0.9))


def fill(model: Model, depth: int, rng: np.random.Generator) -> float:
    """Sequence 0 prefilled to `depth` tokens, copied into every other sequence; seconds."""
    t = time.perf_counter()
    tokens = rng.integers(0, model.n_vocab, depth).tolist()
    for i in range(0, depth, 512):
        model.eval(tokens[i : i + 512], seq=0)
    for s in range(1, model.n_seq_max):
        model.copy_sequence(0, s)
    return time.perf_counter() - t


def decode_rate(model: Model, batch: int, steps: int, rng: np.random.Generator) -> tuple[float, float]:
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
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if not args.model.exists():
        sys.path.insert(0, str(Path(__file__).parent))
        from llama7b_gguf import write

        t = time.perf_counter()
        write(args.model)
        print(f"wrote {args.model} in {time.perf_counter() - t:.0f} s", flush=True)

    results: dict = {"kernels": [], "decode": [], "kv": []}
    if not args.skip_kernels:
        results["kernels"] = kernel_bench(sorted(set(contexts) | {8192}))
        for r in results["kernels"]:
            print(json.dumps(r), flush=True)

    weights = args.model.stat().st_size
    rng = np.random.default_rng(0)
    for kv in ("f16", "ott2"):
        for ctx in contexts:
            model = open_largest(args.model, kv, ctx + 128, weights, args.max_batch)  # room for the steps
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
        best = {
            kv: max(r["tok_s"] for r in results["decode"] if r["kv"] == kv and r["ctx"] == ctx)
            for kv in ("f16", "ott2")
        }
        largest = {k["kv"]: k["n_seq_max"] for k in results["kv"] if k["ctx"] == ctx}
        print(
            f"ctx {ctx}: ott2/f16 best throughput {best['ott2'] / best['f16']:.2f}x, "
            f"largest batch {largest['ott2'] / largest['f16']:.1f}x"
        )
    for r in results["kernels"]:
        if r["op"] == "attn" and r["chosen"]:
            print(
                f"attn ott2 ctx {r['ctx']} batch {r['batch']}: {r['GBps']:.0f} GB/s = {100 * r['of_copy']:.0f}% of copy"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
