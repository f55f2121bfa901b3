"""Decode throughput at a long context on one GPU: our caches and llama.cpp's, in one run.

    python bench/cuda_vs_llamacpp.py --model 7b.gguf --llama-batched-bench PATH
                                     [--ctx 16384] [--kv ottr2tg,ottr2,f16]
                                     [--llama q4_0:24,f16:7] [--steps 5] [--json out.json]

llama.cpp first: for each TYPE:BATCH of --llama, `llama-batched-bench -npp CTX -ntg 8 -npl
BATCH -fa on -ctk TYPE -ctv TYPE -ngl 99` (its KV cache sized for the batch; a batch whose
cache or compute buffers do not fit is reported and skipped), and its decode tokens/s summed
over the batch (S_TG). Then ours, on the same weights: for each --kv mode the largest batch
that fits, filled to CTX tokens and decoded (bench/cuda_bench.py: open_largest, fill,
decode_rate; the median of --steps steps). The table gives each side's tokens/s and every mode
against llama.cpp's best. The model is written with bench/llama7b_gguf.py when --model does not
exist, and a made-up KVQuant sidecar beside such a model when a kvquant mode has none.
llama-batched-bench comes from `LLAMA_CUDA=1 bash shared/peers/build_llamacpp.sh DIR`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from cuda_bench import decode_rate, fill, open_largest  # noqa: E402
from llama7b_gguf import ensure  # noqa: E402

from ott_gguf.model import Weights  # noqa: E402

N_GEN = 8  # tokens llama-batched-bench decodes per sequence after the prompt


def parse_batched_bench(text: str) -> list[dict]:
    """The result rows of llama-batched-bench's table: PP, TG, B, N_KV, T_PP s, S_PP t/s,
    T_TG s, S_TG t/s, T s, S t/s (a row per batch it ran)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[0].isdigit():
            continue
        rows.append({"pp": int(cells[0]), "batch": int(cells[2]), "s_pp": float(cells[5]), "s_tg": float(cells[7])})
    return rows


def llama_decode(exe: Path, model: Path, ctx: int, cache_type: str, batch: int) -> tuple[list[str], float | None]:
    """(the command, llama.cpp's decode tokens/s summed over `batch` sequences at `ctx`), or
    None for the rate when it did not run (its last error line says why, e.g. out of memory)."""
    cmd = [str(exe), "-m", str(model), "-c", str(batch * (ctx + 32)), "-b", "4096", "-ub", "1024"]
    cmd += ["-npp", str(ctx), "-ntg", str(N_GEN), "-npl", str(batch), "-fa", "on"]
    cmd += ["-ctk", cache_type, "-ctv", cache_type, "-ngl", "99"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = [r for r in parse_batched_bench(proc.stdout) if r["batch"] == batch]
    if proc.returncode != 0 or not rows:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1])  # e.g. out of memory
        print(f"llama.cpp {cache_type} batch {batch}: did not run ({why.strip()})", flush=True)
        return cmd, None
    return cmd, rows[0]["s_tg"]


def ours_decode(weights: Weights, kv: str, ctx: int, steps: int) -> dict:
    """Our decode tokens/s at the largest batch of `kv` that fits, after a `ctx`-token fill."""
    rng = np.random.default_rng(ctx)
    model = open_largest(weights, kv, ctx + 128, 1 << 16)
    try:
        fill_s = fill(model, ctx, rng)
        rate, step = decode_rate(model, model.n_seq_max, steps, rng)
        bits = model.kv_stats().bits_per_element
    finally:
        model.close()
    return {"kv": kv, "batch": model.n_seq_max, "tok_s": rate, "step_ms": step * 1e3, "fill_s": fill_s, "bits": bits}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--llama-batched-bench", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--kv", default="ottr2tg,ottr2,f16", help="our KV modes, comma-separated")
    ap.add_argument("--llama", default="q4_0:24,f16:7", help="llama.cpp's TYPE:BATCH runs, comma-separated")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.llama_batched_bench.is_file():
        sys.exit(f"error: llama-batched-bench not found at {args.llama_batched_bench}")
    ensure(args.model, args.kv.split(","))

    llama = []
    for spec in args.llama.split(","):
        cache_type, batch = spec.split(":")
        cmd, rate = llama_decode(args.llama_batched_bench, args.model, args.ctx, cache_type, int(batch))
        llama.append({"cache": cache_type, "batch": int(batch), "tok_s": rate, "cmd": " ".join(cmd)})
        if rate is not None:
            print(f"llama.cpp {cache_type} batch {batch}: {rate:.1f} tok/s", flush=True)
    ran = [r for r in llama if r["tok_s"] is not None]
    if not ran:
        sys.exit("error: no llama.cpp run fitted on this GPU (lower the batches of --llama)")
    best = max(ran, key=lambda r: r["tok_s"])

    weights = Weights(args.model, device="cuda")
    ours = []
    for kv in args.kv.split(","):
        ours.append(ours_decode(weights, kv, args.ctx, args.steps))
        print(json.dumps(ours[-1]), flush=True)

    print(
        f"\n| cache | batch | decode tok/s at {args.ctx} | vs llama.cpp's best ({best['cache']}, batch {best['batch']}) |"
    )
    print("|---|---:|---:|---:|")
    for r in ours:
        print(f"| ours {r['kv']} | {r['batch']} | {r['tok_s']:.1f} | {r['tok_s'] / best['tok_s']:.2f}x |")
    for r in ran:
        print(f"| llama.cpp {r['cache']} | {r['batch']} | {r['tok_s']:.1f} | {r['tok_s'] / best['tok_s']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"ctx": args.ctx, "ours": ours, "llama": llama}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
