"""Decode time of two native builds of ott-gguf, A against B, on one model and cache.

    python bench/ab_decode.py BUILD_A BUILD_B [MODEL] [--kv MODE] [-d 8192] [-t 2] [--pairs 6]
                              [--rounds 6] [-n 32]

BUILD_A and BUILD_B are directories holding a build's libott.so and _ott_cffi module (a
CMake build directory, or a copy of one). Each pair of processes (one per build, started in
turn, A first in even pairs, B first in odd ones) fills a cache with d random tokens, then
both take turns for `rounds` rounds: copy the sequence to a scratch one and decode n tokens
there one at a time, timed. A pair's ratio is the median over its rounds of B's time per
token over A's; the result is the median over pairs, with how many pairs found B faster.

Why pairs of processes and not rounds: a process keeps a bias of a few per cent through all
its rounds (an A/A run of one pair on the development VM gave 0.971 and 1.031 with every
round agreeing), so a change of a few per cent shows only across several fresh pairs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(model: str, mode: str, depth: int, threads: int, n_gen: int) -> None:
    """One build's process: fill, print "ready", then one timed round per line on stdin."""
    import numpy as np

    sys.path.insert(0, str(REPO))
    from ott_gguf.model import Context, Weights
    from ott_gguf.reference.config import parse_mode

    weights = Weights(model)
    ctx = Context(weights, n_ctx=depth + n_gen + 64, n_seq_max=2, n_threads=threads, kv=parse_mode(mode))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ctx.n_vocab, depth).tolist()
    for i in range(0, depth, 512):
        ctx.eval(ids[i : i + 512], 0)
    print("ready", flush=True)
    for _ in sys.stdin:
        ctx.copy_sequence(0, 1)
        toks = rng.integers(0, ctx.n_vocab, n_gen).tolist()
        t0 = time.perf_counter()
        for t in toks:
            ctx.eval([t], 1)
        print(f"{(time.perf_counter() - t0) * 1000 / n_gen:.4f}", flush=True)
        ctx.truncate(1, 0)


def start(build: Path, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, OTT_NATIVE_DIR=str(build), LD_LIBRARY_PATH=str(build), OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--worker", args.model, args.kv]
    cmd += [str(args.depth), str(args.threads), str(args.n_gen)]
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        raise SystemExit(f"error: ab_decode: the worker of {build} did not start (exit {p.wait()})")
    return p


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:  # one build's process (start): MODEL MODE DEPTH THREADS N_GEN
        model, mode, depth, threads, n_gen = sys.argv[2:]
        worker(model, mode, int(depth), int(threads), int(n_gen))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_a", type=Path)
    ap.add_argument("build_b", type=Path)
    ap.add_argument("model", nargs="?", default=str(REPO / ".dev" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--kv", default="ottr2tr", help="cache mode, knobs as MODE:knob=value (default ottr2tr)")
    ap.add_argument("-d", "--depth", type=int, default=8192)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-gen", type=int, default=32, help="decoded tokens a round")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    for b in (args.build_a, args.build_b):
        if not list(b.glob("libott.so*")) or not list(b.glob("_ott_cffi*")):
            raise SystemExit(f"error: ab_decode: {b} holds no libott.so and _ott_cffi module")
    ratios = []
    for k in range(args.pairs):
        order = ("A", "B") if k % 2 == 0 else ("B", "A")
        procs = {name: start(args.build_a if name == "A" else args.build_b, args) for name in order}
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                times[name].append(float(procs[name].stdout.readline()))
        for p in procs.values():
            p.stdin.close()
            p.wait()
        ratio = statistics.median(b / a for a, b in zip(times["A"], times["B"]))
        ratios.append(ratio)
        a_ms, b_ms = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"pair {k + 1}/{args.pairs}: A {a_ms:.3f} B {b_ms:.3f} ms/token, B/A {ratio:.4f}", flush=True)
    faster = sum(r < 1 for r in ratios)
    print(
        f"{args.kv} at {args.depth}: B/A {statistics.median(ratios):.4f} (median of {args.pairs} process pairs), "
        f"B faster in {faster} of {args.pairs}"
    )


if __name__ == "__main__":
    main()
