"""Prompt and decode speed of ott-gguf side by side with llama.cpp's llama-bench, in one run.

    python bench/speed_vs_llamacpp.py [MODEL] [-t 2] [-p 512] [-n 128] [-r 5] [-d 0,1024]
                                      [--llama-bench PATH]

Both sides use an fp16 KV cache on the same GGUF with the same thread count and report
tokens/s; llama.cpp runs without and with flash attention (`-fa off` / `-fa on`). The
sides are interleaved: each of `--rounds` rounds runs ours, llama.cpp fa off and llama.cpp
fa on once (each with `-r` repetitions, median taken), and the table reports the median
over rounds, so a change in machine load hits every side alike. The table gives
ours / llama.cpp for each. Targets (issue "Runtime foundation"): decode >= 0.9x and
prompt >= 0.8x llama.cpp's fp16 cache.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ott_gguf.bench import bench  # noqa: E402
from ott_gguf.model import Model  # noqa: E402
from ott_gguf.resolve import resolve_model  # noqa: E402

DEFAULT_LLAMA_BENCH = REPO.parent / "peers" / "llamacpp" / "build" / "bin" / "llama-bench"


def require_llama_bench(exe: Path) -> None:
    """Exit with one line when llama-bench is not at exe."""
    if not exe.is_file():
        sys.exit(
            f"error: llama-bench not found at {exe} (build it with "
            f"shared/peers/build_llamacpp.sh, or pass --llama-bench)"
        )


def llama_bench(
    exe: Path,
    model: Path,
    threads: int,
    n_prompt: int,
    n_gen: int,
    reps: int,
    depths: list[int],
    flash_attn: bool,
    cache_type: str = "f16",
) -> tuple[str, dict[tuple[str, int], float]]:
    """Run llama-bench once; (its command line, {(test, depth): median tokens/s})."""
    cmd = [
        str(exe),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        str(n_prompt),
        "-n",
        str(n_gen),
        "-r",
        str(reps),
        "-d",
        ",".join(map(str, depths)),
        "-ctk",
        cache_type,
        "-ctv",
        cache_type,
        "-fa",
        "on" if flash_attn else "off",
        "-o",
        "json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"error: llama-bench failed ({shlex.join(cmd)}): {tail}")
    medians = {}
    for entry in json.loads(proc.stdout):
        test = f"pp{entry['n_prompt']}" if entry["n_gen"] == 0 else f"tg{entry['n_gen']}"
        medians[(test, entry["n_depth"])] = statistics.median(entry["samples_ts"])
    return shlex.join(cmd), medians


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF path or Hub repo id (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=5, help="repetitions per side and round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over rounds)")
    ap.add_argument("-d", "--depths", default="0", help="comma-separated context depths")
    ap.add_argument("--llama-bench", type=Path, default=DEFAULT_LLAMA_BENCH)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    require_llama_bench(args.llama_bench)

    path = resolve_model(args.model)
    print(
        f"model {path}, {args.threads} threads, pp{args.n_prompt} / tg{args.n_gen}, depths {depths}, "
        f"median of {args.reps} per round, {args.rounds} rounds, fp16 KV cache",
        flush=True,
    )

    model = Model(path, n_ctx=max(depths) + max(args.n_prompt, args.n_gen), n_threads=args.threads, kv="f16")
    rounds = {"ours": [], False: [], True: []}  # per round: {(test, depth): tokens/s}
    for _ in range(args.rounds):
        rounds["ours"].append(
            {
                (r.test, r.depth): r.tokens_per_s
                for r in bench(model, args.n_prompt, args.n_gen, depths, args.reps, progress=False)
            }
        )
        for fa in (False, True):
            cmd, medians = llama_bench(
                args.llama_bench, path, args.threads, args.n_prompt, args.n_gen, args.reps, depths, fa
            )
            rounds[fa].append(medians)
    model.close()
    print(
        f"ours: python -m ott_gguf bench {path} -t {args.threads} -p {args.n_prompt} -n {args.n_gen} "
        f"-d {args.depths} -r {args.reps}"
    )
    print(f"llama.cpp: {cmd} (and -fa off); {args.rounds} interleaved rounds")

    def median_over_rounds(side):
        return {key: statistics.median(r[key] for r in rounds[side]) for key in rounds[side][0]}

    ours = median_over_rounds("ours")
    theirs = {fa: median_over_rounds(fa) for fa in (False, True)}

    print()
    print("| test | depth | ours t/s | llama.cpp fa off | ours/llama.cpp | llama.cpp fa on | ours/llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, ours_ts in ours.items():
        off, on = theirs[False][key], theirs[True][key]
        print(
            f"| {key[0]} | {key[1]} | {ours_ts:.2f} | {off:.2f} | {ours_ts / off:.2f} | {on:.2f} | {ours_ts / on:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
