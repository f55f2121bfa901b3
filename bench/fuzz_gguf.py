"""Fuzz the GGUF loader with a seeded mutator, by hand (not run by the tests).

    python bench/fuzz_gguf.py [--minutes 10] [--seed 1] [--record]

Each iteration takes a small valid model (the corpus base of tests/test_malformed_corpus.py),
applies `malformed_gguf.mutate(base, seed, iteration)` (1 to 4 random edits), loads the
result and, when that works, decodes three tokens. A worker process runs the iterations and
says which one it starts; the parent restarts it after a crash. A finding is an iteration
that aborted or crashed the worker, raised something other than an OttError, printed a
multi-line message, or took over --timeout seconds. Findings are recipes, {"seed", "iteration"},
rebuilt from the base by the same function: --record appends them to
tests/data/fuzz_regressions.json, where the corpus picks them up as cases.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


def worker(base: Path, seed: int, start: int, tmp: Path) -> None:
    """Run iterations start, start+1, ... forever, printing `start N` then `done N RESULT`."""
    from malformed_gguf import mutate, run_case

    data = base.read_bytes()
    path = tmp / "case.gguf"
    for it in range(start, 1 << 62):
        path.write_bytes(mutate(data, seed, it))
        print(f"start {it}", flush=True)
        try:
            result = run_case(path)
            print(f"done {it} {'ok' if result == 'ok' else 'error'}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported as a finding
            print(f"done {it} TRACEBACK {type(e).__name__}: {e}".replace("\n", " ")[:500], flush=True)


def _pump(stream, lines: queue.Queue) -> None:
    """The worker's output lines into `lines`, then None at its end."""
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds one iteration may take")
    ap.add_argument("--record", action="store_true", help="append findings to tests/data/fuzz_regressions.json")
    ap.add_argument("--worker", nargs=3, metavar=("BASE", "SEED", "START"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory() as tmp:
            worker(Path(args.worker[0]), int(args.worker[1]), int(args.worker[2]), Path(tmp))
        return 0

    from make_gguf import write_random_model

    tmp = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    base = write_random_model(
        tmp / "base.gguf", arch="llama", n_embd=32, n_head=2, n_head_kv=1, n_ff=32, n_layer=1, dtype="f32"
    )
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    deadline = time.monotonic() + 60 * args.minutes
    findings, counts, start = [], {"ok": 0, "error": 0}, 0
    while time.monotonic() < deadline:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(base), str(args.seed), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        current, started = None, time.monotonic()
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        while True:
            if time.monotonic() > deadline:  # checked before every line: a fast worker never pauses
                proc.kill()
                proc.wait()
                break
            try:
                line = lines.get(timeout=0.05)
            except queue.Empty:
                line = ""
            if line:
                kind, it, *rest = line.split(" ", 2)
                if kind == "start":
                    current, started = int(it), time.monotonic()
                elif rest and rest[0].startswith("TRACEBACK"):
                    findings.append({"seed": args.seed, "iteration": int(it), "what": rest[0]})
                    current = None
                else:
                    counts[rest[0]] = counts.get(rest[0], 0) + 1
                    current = None
                continue
            if line is None:
                proc.wait()
                if current is not None:
                    findings.append({"seed": args.seed, "iteration": current, "what": f"exit {proc.returncode}"})
                break
            if current is not None and time.monotonic() - started > args.timeout:
                proc.kill()
                proc.wait()
                findings.append({"seed": args.seed, "iteration": current, "what": f"over {args.timeout:g} s"})
                break
        start = (current if current is not None else start) + 1
        if findings and findings[-1]["iteration"] == current:
            print(f"finding: {findings[-1]}", flush=True)
    n = counts["ok"] + counts["error"] + len(findings)
    print(
        f"{n} inputs in {args.minutes:g} min: {counts['ok']} ran, {counts['error']} refused with one line, "
        f"{len(findings)} findings"
    )
    for f in findings:
        print(f"  seed {f['seed']} iteration {f['iteration']}: {f['what']}")
    if args.record and findings:
        path = REPO / "tests" / "data" / "fuzz_regressions.json"
        old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
        path.write_text(
            json.dumps(old + [{"seed": f["seed"], "iteration": f["iteration"]} for f in findings], indent=1) + "\n",
            encoding="utf-8",
        )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
