"""Accuracy of the KV cache modes, side by side in one run (issue "OTT 2-bit KV cache").

Perplexity on WikiText-2 in decode-faithful chunks (each chunk ends at the cache's next
quantization event, docs/design.md §3), mean KL divergence to the f16 cache's next-token
distribution and top-1 agreement (the f16 cache runs in the same process), and the
footprint (average bits per K/V element at the window size, everything counted, and its
mean over the cache sizes the scored tokens saw: a block being filled is fp16, so the
footprint at a whole number of blocks is the least it gets). Then,
optionally, passkey retrieval: filler text with a random 5-digit key at a random depth,
greedy answer, fraction of trials that return the key.

    python bench/accuracy.py MODEL -f ../shared/data/wikitext-2-raw/wiki.test.raw \
        --modes f16,kivi2,ott2,kivi4,ott4 --chunks 20 [--ablate] [--passkey 1024,2048 --trials 20] \
        [--llamacpp BIN_DIR --llamacpp-types q4_0]

A mode is a preset name, optionally with knobs: `ott2:rot_k=1:rot_v=1` is ott2 with
Hadamard-rotated keys and values (rotation kinds: 1 hadamard, 2 calibrated, which reads the
sidecar <model>.kvcalib.gguf written by `python -m ott_gguf calibrate`). --llamacpp adds
llama.cpp's quantized caches as peers: its llama-perplexity over the same windows (it too
scores each window's second half), KL against its own f16 run, flash attention on.

Prints markdown tables; the numbers in the README come from this script.
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ott_gguf.model import Context, Weights  # noqa: E402
from ott_gguf.perplexity import event_chunks, perplexity  # noqa: E402
from ott_gguf.reference.config import KVConfig, preset  # noqa: E402
from ott_gguf.reference.config import parse_mode as parse_kv_mode  # noqa: E402

# llama.cpp's cache types -> bits per element (ggml block sizes: 32 values + fp16 scale [+ min])
LLAMACPP_BITS = {"f16": 16.0, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5}


def parse_mode(spec: str) -> tuple[str, str | KVConfig]:
    """'ott2' -> ('ott2', 'ott2'); 'ott2:rot_k=1:pool=0' -> (spec, ott2 with those knobs)."""
    return spec, parse_kv_mode(spec)


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def scored_bits(model, n_ctx):
    """Mean bits/element of the cache over the sizes it had when the scored tokens' logits were
    computed: the window's second half (ott_gguf/perplexity.py), the logits at position p with
    p + 1 tokens cached."""
    sizes = range(n_ctx // 2 + 1, n_ctx)
    return sum(model.kv_footprint(n).bits_per_element for n in sizes) / len(sizes)


def ppl_rows(weights, text, modes, n_ctx, chunks, threads, configs=None):
    """One row per mode spec (parse_mode) or named KVConfig in `configs`, each a context on the
    same weights."""
    reference = Context(weights, n_ctx=n_ctx, n_threads=threads)
    rows = []
    entries = [parse_mode(m) for m in modes] + list((configs or {}).items())
    for name, kv in entries:
        model = Context(weights, n_ctx=n_ctx, n_threads=threads, kv=kv)
        t0 = time.perf_counter()
        r = perplexity(
            model, text, n_ctx, n_chunks=chunks, progress=False, reference=None if name == "f16" else reference
        )
        bits = model.kv_footprint(n_ctx).bits_per_element
        rows.append((name, r.ppl, r.stderr, r.kl, r.top1, bits, scored_bits(model, n_ctx), time.perf_counter() - t0))
        print(
            f"  {name}: PPL {r.ppl:.4f} ± {r.stderr:.4f}, KL {r.kl}, top-1 {r.top1}, {bits:.2f} bits "
            f"({r.chunking}, {time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
        )
        model.close()
    reference.close()
    return rows


def llamacpp_rows(bin_dir: Path, model: Path, text_file: Path, types, n_ctx, chunks):
    """llama.cpp's llama-perplexity on the same windows: f16 (the KL base), then each cache type."""
    exe = str(bin_dir / "llama-perplexity")
    common = [
        exe,
        "-m",
        str(model),
        "-f",
        str(text_file),
        "-c",
        str(n_ctx),
        "-b",
        str(n_ctx),
        "--chunks",
        str(chunks),
        "-fa",
        "on",
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "kl-base.bin")
        for t in ["f16", *types]:
            kl = ["--kl-divergence-base", base] if t == "f16" else ["--kl-divergence-base", base, "--kl-divergence"]
            t0 = time.perf_counter()
            out = subprocess.run(common + kl + ["-ctk", t, "-ctv", t], capture_output=True, text=True)
            log = out.stdout + out.stderr
            if out.returncode != 0:
                raise SystemExit(f"error: llama-perplexity -ctk {t} failed: {log.strip().splitlines()[-1:]}")
            if t == "f16":
                m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
                row = (f"llama.cpp {t}", float(m[1]), float(m[2]), None, None)
            else:
                m = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+) ± +([\d.]+)", log)
                kld = re.search(r"Mean +KLD: +([\d.]+)", log)
                top = re.search(r"Same top p: +([\d.]+)", log)
                row = (f"llama.cpp {t}", float(m[1]), float(m[2]), float(kld[1]), float(top[1]) / 100)
            rows.append((*row, LLAMACPP_BITS[t], LLAMACPP_BITS[t], time.perf_counter() - t0))
            print(f"  llama.cpp {t}: PPL {row[1]:.4f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return rows


def print_ppl_table(title, rows, n_ctx):
    f16 = next((r[1] for r in rows if r[0] == "f16"), None)
    print(f"\n### {title}\n")
    print(
        f"| KV mode | PPL | ± | vs f16 | KL to f16 (nats) | top-1 agreement | bits/element at {n_ctx} "
        "| bits/element, mean while scored |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, ppl, err, kl, top1, bits, mean_bits, _ in rows:
        if name == "llama.cpp f16":  # llama.cpp's rows compare with its own f16 run
            f16 = ppl
        rel = f"{100 * (ppl / f16 - 1):+.2f} %" if f16 else "–"
        kl_s = "–" if kl is None else f"{kl:.4f}"
        top_s = "–" if top1 is None else f"{100 * top1:.2f} %"
        print(f"| {name} | {ppl:.4f} | {err:.4f} | {rel} | {kl_s} | {top_s} | {bits:.2f} | {mean_bits:.2f} |")


def passkey_prompt(model, n_tokens, rng):
    """A prompt of about n_tokens tokens with the key at a random depth; returns (ids, key)."""
    key = f"{rng.randrange(10000, 100000)}"
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? The pass key is"
    per_filler = len(model.tokenize(FILLER, add_special=False))
    n_fill = max(1, (n_tokens - 64) // per_filler)
    at = rng.randrange(n_fill + 1)
    text = (
        "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        + FILLER * at
        + needle
        + FILLER * (n_fill - at)
        + question
    )
    return model.tokenize(text), key


def passkey(weights, modes, lengths, trials, threads, seed=0):
    rows = []
    for n in lengths:
        for mode in modes:
            model = Context(weights, n_ctx=n + 64, n_threads=threads, kv=parse_mode(mode)[1])
            rng = random.Random(seed)  # the same keys and depths for every mode
            ok = 0
            for _ in range(trials):
                ids, key = passkey_prompt(model, n, rng)
                model.truncate(0)
                logits, out = None, []
                # decode-faithful prefill, then greedy decoding
                for b0, b1 in event_chunks(model, len(ids)):
                    logits = model.eval(ids[b0:b1])
                for _ in range(8):
                    tok = int(logits.argmax())
                    out.append(tok)
                    logits = model.eval([tok])
                ok += key in model.detokenize(out)
            rows.append((n, mode, ok / trials))
            print(f"  passkey {n} {mode}: {ok}/{trials}", file=sys.stderr)
            model.close()
    print("\n### Passkey retrieval (fraction of trials answered with the key)\n")
    print("| tokens | " + " | ".join(modes) + " |")
    print("|---:|" + "---:|" * len(modes))
    for n in lengths:
        print(f"| {n} | " + " | ".join(f"{acc:.2f}" for (m_n, _, acc) in rows if m_n == n) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("-f", "--file", type=Path, required=True, help="text for perplexity (WikiText-2 raw test)")
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--modes", default="f16,kivi2,ott2,kivi4,ott4", help="'' skips the perplexity table")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument(
        "--ablate",
        action="store_true",
        help="ott2 with pool 0/1/8, group_v 16/32, group_k 32/64, window 128 "
        "(the defaults: pool 3, group_v 64, group_k 128, window 32)",
    )
    ap.add_argument("--passkey", default="", help="comma-separated prompt lengths, e.g. 1024,2048,4096,8192")
    ap.add_argument("--passkey-modes", default="f16,kivi2,ott2")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--llamacpp", type=Path, default=None, help="llama.cpp's bin folder: its caches as peers")
    ap.add_argument("--llamacpp-types", default="q4_0", help="llama.cpp cache types (comma-separated)")
    args = ap.parse_args()

    text = args.file.read_text(encoding="utf-8")
    weights = Weights(args.model)
    modes = [m for m in args.modes.split(",") if m]
    rows = ppl_rows(weights, text, modes, args.ctx, args.chunks, args.threads) if modes else []
    if args.llamacpp:
        rows += llamacpp_rows(
            args.llamacpp, args.model, args.file, args.llamacpp_types.split(","), args.ctx, args.chunks
        )
    if rows:
        print(f"model {args.model.name}, WikiText-2 windows of {args.ctx}, first {args.chunks}, decode-faithful chunks")
        print_ppl_table("Perplexity, KL and top-1 by KV mode", rows, args.ctx)
    if args.ablate:
        ott2 = preset("ott2")
        configs = {
            f"ott2 pool {p}": ott2.with_overrides(pool=p, extra_pool=0 if p == 0 else ott2.extra_pool)
            for p in (0, 1, 8)
        }
        configs.update({f"ott2 group_v {g}": ott2.with_overrides(group_v=g) for g in (16, 32)})
        configs.update({f"ott2 group_k {g}": ott2.with_overrides(group_k=g) for g in (32, 64)})
        configs["ott2 window 128"] = ott2.with_overrides(window=128)
        configs["ott2 group_k 32, window 128"] = ott2.with_overrides(group_k=32, window=128)
        print_ppl_table(
            "Ablation: ott2 pool size, value group, key group and window",
            ppl_rows(weights, text, ["f16", "ott2"], args.ctx, args.chunks, args.threads, configs),
            args.ctx,
        )
    if args.passkey:
        passkey(
            weights, args.passkey_modes.split(","), [int(x) for x in args.passkey.split(",")], args.trials, args.threads
        )


if __name__ == "__main__":
    main()
