"""Where the GPU time of a prefill and of a decode step goes, by kernel, for each KV mode.

    python bench/cuda_profile.py --model 7b.gguf [--kv f16,ott2,kvquant2] [--depth 4096]
                                 [--batch 8] [--json out.json]

For each mode: one context on the same weights (n_seq_max = --batch); sequence 0 prefilled to
--depth tokens in chunks of 512 under torch's profiler (CUPTI sees every kernel of the
process, ggml's and ours), then copied into the other sequences, then 4 decode steps of the
whole batch under the profiler. Prints the kernels' summed GPU time per phase, largest first,
and the wall time of each phase; for a decode step also how long the GPU was busy (the
union of its kernels' intervals) and idle before, between and after them. Needs a CUDA
build of torch beside the runtime; the model is written with bench/llama7b_gguf.py when
--model does not exist (and a made-up KVQuant sidecar beside such a model for kvquant modes:
tests/make_gguf.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from ott_gguf.model import Context, Weights

STEP = "decode_step"  # the record_function around each profiled decode step


def gpu_events(prof) -> list:
    """Every GPU activity CUPTI recorded, whether a torch op launched it or not; not the GPU
    side of the STEP annotations, which spans a whole step."""
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events()
    return [e for e in events if e.device_type() == DeviceType.CUDA and e.name() != STEP]


def kernel_ms(prof) -> dict[str, float]:
    """Summed device time (ms) per kernel name over the profiled region."""
    out: dict[str, float] = defaultdict(float)
    for ev in gpu_events(prof):
        out[ev.name()] += ev.duration_ns() / 1e6
    return dict(out)


def step_gaps(prof) -> dict[str, float]:
    """Per STEP (on the host): where its wall time goes, averaged over the steps, in ms: the
    GPU busy (the union of every kernel's and copy's interval inside it), and idle before
    its first GPU activity, after its last one, and between them."""
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events()
    steps = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns())
        for e in events
        if e.name() == STEP and e.device_type() == DeviceType.CPU
    )
    gpu = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in gpu_events(prof))
    out = {"busy": 0.0, "idle_before": 0.0, "idle_between": 0.0, "idle_after": 0.0}
    for s0, s1 in steps:
        spans = [(max(a, s0), min(b, s1)) for a, b in gpu if b > s0 and a < s1]
        if not spans:
            continue
        busy, cur0, cur1 = 0, spans[0][0], spans[0][1]
        for a, b in spans[1:]:
            if a > cur1:
                busy += cur1 - cur0
                cur0, cur1 = a, b
            else:
                cur1 = max(cur1, b)
        busy += cur1 - cur0
        first, last = spans[0][0], cur1  # cur1: the latest end, the union's last run
        out["busy"] += busy
        out["idle_before"] += first - s0
        out["idle_after"] += s1 - last
        out["idle_between"] += (last - first) - busy
    return {k: v / max(1, len(steps)) / 1e6 for k, v in out.items()}


def short(name: str) -> str:
    """The kernel's name without its namespace noise and argument list."""
    name = name.replace("(anonymous namespace)::", "").split("(")[0]
    return name if len(name) <= 90 else name[:87] + "..."


def profile_mode(weights: Weights, kv: str, depth: int, batch: int, rng: np.random.Generator) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    model = Context(weights, n_ctx=depth + 64, n_seq_max=batch, n_ubatch=512, kv=kv)
    tokens = rng.integers(0, model.n_vocab, depth).tolist()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for i in range(0, depth, 512):
            model.eval(tokens[i : i + 512], seq=0)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t
    prefill = kernel_ms(prof)
    for s in range(1, batch):
        model.copy_sequence(0, s)
    seqs = list(range(batch))
    model.decode_batch(rng.integers(0, model.n_vocab, batch).tolist(), [depth] * batch, seqs, [True] * batch)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for step in range(4):
            pos = [depth + 1 + step] * batch
            toks = rng.integers(0, model.n_vocab, batch).tolist()
            with record_function(STEP):
                model.decode_batch(toks, pos, seqs, [True] * batch)
        torch.cuda.synchronize()
        decode_s = (time.perf_counter() - t) / 4
    decode = {k: v / 4 for k, v in kernel_ms(prof).items()}
    gaps = step_gaps(prof)
    model.close()
    return {
        "kv": kv,
        "prefill_s": prefill_s,
        "decode_step_s": decode_s,
        "prefill": prefill,
        "decode": decode,
        "decode_gaps_ms": gaps,
    }


def report(r: dict, top: int) -> None:
    print(f"\n## {r['kv']}: prefill {r['prefill_s']:.2f} s, decode step {r['decode_step_s'] * 1e3:.2f} ms")
    for phase in ("prefill", "decode"):
        ks = sorted(r[phase].items(), key=lambda kv: -kv[1])
        total = sum(v for _, v in ks)
        print(f"{phase}: kernels {total:.1f} ms")
        for name, ms in ks[:top]:
            print(f"  {ms:10.2f} ms {100 * ms / total:5.1f} %  {short(name)}")
    g = r["decode_gaps_ms"]
    print(
        f"decode step: GPU busy {g['busy']:.2f} ms; GPU idle {g['idle_before']:.2f} ms before its first kernel, "
        f"{g['idle_between']:.2f} ms between kernels, {g['idle_after']:.2f} ms after its last"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--kv", default="f16,ott2,kvquant2")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from llama7b_gguf import ensure

    ensure(args.model, args.kv.split(","))
    weights = Weights(args.model, device="cuda")
    rng = np.random.default_rng(0)
    results = []
    for kv in args.kv.split(","):
        r = profile_mode(weights, kv, args.depth, args.batch, rng)
        report(r, args.top)
        results.append(r)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
