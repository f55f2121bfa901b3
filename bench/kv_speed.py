"""Decode speed by context depth: our f16 and ott2 caches against llama.cpp, in one run.

    python bench/kv_speed.py [MODEL] [-t 2] [-d 0,1024,4096,8192] [-n 32] [--rounds 3]
                             [--modes f16,ott2,ott2@float] [--kv-calib SIDECAR] [--llama-bench PATH]

For each depth d, decode tokens/s after d tokens of context, for
- ours: each mode's cache holds d random tokens in a sequence of its own (filled once); a
  round copies it to a scratch sequence and decodes n tokens there one at a time (whole
  steps, timed), then copies it again and decodes n more with profiling on (ott.h:
  ott_set_profile), which splits a token's time into attention (our fused attention for the
  quantized modes, ggml's flash attention for f16), appends and quantization events,
  rotations, and the rest (projections, FFN, output head); MODE@float is MODE with the CPU
  attention's dot products in float where the process would use integer ones (AVX-512
  VNNI, ott.h: ott_set_cpu_int_dots), so both run side by side;
- llama.cpp's llama-bench (`-p 0 -n N -d ...`) with an f16 cache without and with flash
  attention, and with a q4_0 cache (flash attention on, which a quantized V cache needs).
Each round runs every side once; the table gives medians over rounds, so a change in machine
load hits every side alike. Targets: each quantized mode's whole step at 8K
against llama.cpp's best setting (ott2: faster; the recommended preset: 3x), its attention
against our f16 attention.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from accuracy import parse_mode  # noqa: E402
from speed_vs_llamacpp import DEFAULT_LLAMA_BENCH, llama_bench, require_llama_bench  # noqa: E402

from ott_gguf.model import Context, Weights, set_cpu_int_dots  # noqa: E402
from ott_gguf.reference import KVConfig, preset  # noqa: E402
from ott_gguf.resolve import resolve_model  # noqa: E402

LLAMA_SETTINGS = {  # name: (flash attention, cache type)
    "llama.cpp f16": (False, "f16"),
    "llama.cpp f16 fa": (True, "f16"),
    "llama.cpp q4_0 fa": (True, "q4_0"),
}


def fill(model: Context, seq: int, n: int, rng: np.random.Generator) -> None:
    """Sequence seq := n random tokens, fed in the model's ubatches (not timed)."""
    ids = rng.integers(0, model.n_vocab, n).tolist()
    for i in range(0, n, 512):
        model.eval(ids[i : i + 512], seq)


def float_dots(label: str) -> bool:
    """Whether a mode label asks for the CPU dot products in float ("MODE@float")."""
    suffix = label.partition("@")[2]
    if suffix not in ("", "float"):
        raise SystemExit(f"error: --modes {label}: the only suffix is @float")
    return suffix == "float"


def decode_from(model: Context, src: int, n_gen: int, rng: np.random.Generator, profile: bool):
    """Copy sequence src to the scratch sequence (the last one) and decode n_gen tokens
    there, one per step; seconds, or with profile the ms per token of each kind of node
    (attention, append, rotate, other)."""
    scratch = model.n_seq_max - 1
    model.copy_sequence(src, scratch)
    model.set_profile(profile)
    ids = rng.integers(0, model.n_vocab, n_gen).tolist()
    t0 = time.perf_counter()
    for tok in ids:
        model.eval([tok], scratch)
    seconds = time.perf_counter() - t0
    model.set_profile(False)
    model.truncate(scratch, 0)
    if not profile:
        return seconds
    prof = model.profile()
    return tuple(x / n_gen for x in (prof.attn_ms, prof.append_ms, prof.rotate_ms, prof.other_ms))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF path or Hub repo id (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-d", "--depths", default="0,1024,4096,8192")
    ap.add_argument("-n", "--n-gen", type=int, default=32, help="decoded tokens per side, depth and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--modes",
        default="f16,ott2",
        help="our cache modes, with knobs as in accuracy.py (ottr2:hi_k=4); MODE@float: the CPU attention's "
        "dot products in float where it would use integer ones (AVX-512 VNNI)",
    )
    ap.add_argument("--kv-calib", type=Path, help="calibration sidecar of the calibrated and KVQuant modes")
    ap.add_argument("--llama-bench", type=Path, default=DEFAULT_LLAMA_BENCH)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    modes = args.modes.split(",")
    for m in modes:
        float_dots(m)  # a bad suffix fails before any work
    require_llama_bench(args.llama_bench)
    path = resolve_model(args.model)
    print(
        f"model {path}, {args.threads} threads, tg{args.n_gen} at depths {depths}, {args.rounds} interleaved rounds",
        flush=True,
    )

    rng = np.random.default_rng(0)
    n_ctx = max(depths) + 2 * args.n_gen + 256
    # one context per mode on the same weights; sequence i holds depths[i] tokens, the last one is the scratch
    weights = Weights(path)
    models = {
        m: Context(
            weights,
            n_ctx=n_ctx,
            n_seq_max=len(depths) + 1,
            n_threads=args.threads,
            kv=kv,
            kv_calib=args.kv_calib if (kv if isinstance(kv, KVConfig) else preset(kv)).calibrated else None,
        )
        for m, kv in ((m, parse_mode(m.partition("@")[0])[1]) for m in modes)
    }
    int_dots = set_cpu_int_dots(None)  # the process default: the modes without @float
    for model in models.values():
        for i, d in enumerate(depths):
            fill(model, i, d, rng)
    tps = {(side, d): [] for d in depths for side in modes + list(LLAMA_SETTINGS)}
    attn = {(m, d): [] for d in depths for m in modes}
    cmds = {}
    for rnd in range(args.rounds):
        for i, d in enumerate(depths):
            for m, model in models.items():
                set_cpu_int_dots(int_dots and not float_dots(m))
                tps[(m, d)].append(args.n_gen / decode_from(model, i, args.n_gen, rng, profile=False))
                attn[(m, d)].append(decode_from(model, i, args.n_gen, rng, profile=True))
        for name, (fa, ctype) in LLAMA_SETTINGS.items():
            cmds[name], medians = llama_bench(
                args.llama_bench, path, args.threads, 0, args.n_gen, 1, depths, fa, cache_type=ctype
            )
            for d in depths:
                tps[(name, d)].append(medians[(f"tg{args.n_gen}", d)])
        print(f"  round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for model in models.values():
        model.close()

    med = {k: statistics.median(v) for k, v in tps.items()}
    split = {k: [statistics.median(part) for part in zip(*v)] for k, v in attn.items()}
    amed = {k: v[0] for k, v in split.items()}
    quantized = [m for m in modes if m != "f16"]
    print(
        f"ours: {', '.join(modes)} caches, Context(n_threads={args.threads}), "
        f"{args.n_gen} decode steps per depth and round"
    )
    for name, cmd in cmds.items():
        print(f"{name}: {cmd}")
    print()
    head = ["depth"] + [f"ours {m} t/s" for m in modes] + [f"{n} t/s" for n in LLAMA_SETTINGS]
    head += [f"{m} attention ms/token" for m in modes]
    head += [f"{m} / llama.cpp best (whole step)" for m in quantized]
    if "f16" in modes:
        head += [f"{m} / f16 attention time" for m in quantized]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for d in depths:
        row = [str(d)] + [f"{med[(m, d)]:.2f}" for m in modes] + [f"{med[(n, d)]:.2f}" for n in LLAMA_SETTINGS]
        row += [f"{amed[(m, d)]:.2f}" for m in modes]
        row += [f"{med[(m, d)] / max(med[(n, d)] for n in LLAMA_SETTINGS):.2f}" for m in quantized]
        if "f16" in modes:
            row += [f"{amed[(m, d)] / amed[('f16', d)]:.2f}" for m in quantized]
        print("| " + " | ".join(row) + " |")
    print("\nms per token by kind of node (profile), medians over rounds\n")
    print("| mode | depth | attention | append + events | rotations | other |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in modes:
        for d in depths:
            print(f"| {m} | {d} | " + " | ".join(f"{x:.3f}" for x in split[(m, d)]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
