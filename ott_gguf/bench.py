"""Prompt and decode speed at given context depths, measured like llama.cpp's `llama-bench`.

For each depth d: the sequence is filled with d random tokens (not timed), then
- pp<n_prompt>: n_prompt random tokens are evaluated as one prompt (in the model's ubatches);
- tg<n_gen>:    n_gen tokens are decoded one at a time, each a separate decode call;
each repeated `reps` times from the same depth-d state (the sequence is truncated back to d
between repetitions). One warm-up prompt and one warm-up decode run first. Reported rates
are medians over the repetitions.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from .errors import ContextFullError, InvalidArgumentError


@dataclass
class BenchRow:
    test: str  # "pp512" (prompt) or "tg128" (decode), llama-bench's names
    depth: int  # tokens already in the sequence when the timing starts
    tokens_per_s: float  # median over the repetitions
    samples: list[float] = field(default_factory=list)  # tokens/s of each repetition

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0


def bench(
    model,
    n_prompt: int = 512,
    n_gen: int = 128,
    depths=(0,),
    reps: int = 5,
    progress: bool = True,
    seed: int = 0,
    seq: int = 0,
    scratch: int | None = None,
) -> list[BenchRow]:
    """Rows (pp then tg for each depth) of median tokens/s; uses and clears sequence `seq`.
    scratch: a second sequence that each repetition at a depth starts from as a copy of `seq`'s
    filled tokens (a quantized cache needs it: it cannot truncate the tokens it has quantized);
    None truncates `seq` back to the depth instead."""
    depths = list(depths)
    if n_prompt < 0 or n_gen < 0 or n_prompt + n_gen == 0:
        raise InvalidArgumentError(f"bench: need n_prompt > 0 or n_gen > 0, got {n_prompt} and {n_gen}")
    if reps < 1 or not depths or min(depths) < 0:
        raise InvalidArgumentError(f"bench: need reps >= 1 and depths >= 0, got reps={reps}, depths={depths}")
    n_needed = max(depths) + max(n_prompt, n_gen)
    if n_needed > model.n_ctx:
        raise ContextFullError(
            f"bench: depth {max(depths)} + {max(n_prompt, n_gen)} tokens = {n_needed} "
            f"exceeds the context of {model.n_ctx} tokens"
        )

    rng = np.random.default_rng(seed)

    def random_tokens(n: int, at_start: bool) -> list[int]:
        ids = rng.integers(0, model.n_vocab, n).tolist()
        if at_start and n and model.tokenizer.add_bos:
            ids[0] = model.tokenizer.bos_id
        return ids

    # Warm-up: page in the weights and let the backend allocate its compute buffers.
    model.truncate(seq, 0)
    if n_prompt:
        model.eval(random_tokens(n_prompt, True), seq)
        model.truncate(seq, 0)
    model.eval(random_tokens(1, True), seq)

    tests = [(f"pp{n_prompt}", n_prompt)] * bool(n_prompt) + [(f"tg{n_gen}", n_gen)] * bool(n_gen)
    run_seq = seq if scratch is None else scratch  # where the timed tokens go
    bar = tqdm(total=len(depths) * len(tests) * reps, desc="bench", unit="run", disable=not progress, leave=False)
    rows = []
    for depth in depths:
        model.truncate(seq, 0)
        if depth:
            model.eval(random_tokens(depth, True), seq)
        for name, n in tests:
            samples = []
            for _ in range(reps):
                if scratch is None:
                    model.truncate(seq, depth)
                else:
                    model.truncate(scratch, 0)
                    model.copy_sequence(seq, scratch)
                if name.startswith("pp"):
                    seconds = _time_prompt(model, random_tokens(n, depth == 0), run_seq)
                else:
                    seconds = _time_decode(model, random_tokens(n, depth == 0), run_seq)
                samples.append(n / seconds)
                bar.update()
            rows.append(BenchRow(name, depth, statistics.median(samples), samples))
    bar.close()
    for s in (seq, scratch):
        if s is not None:
            model.truncate(s, 0)
    return rows


def _time_prompt(model, tokens: list[int], seq: int) -> float:
    t0 = time.perf_counter()
    model.eval(tokens, seq)
    return time.perf_counter() - t0


def _time_decode(model, tokens: list[int], seq: int) -> float:
    t0 = time.perf_counter()
    for token in tokens:
        model.eval([token], seq)
    return time.perf_counter() - t0


def format_table(rows: list[BenchRow]) -> str:
    """A markdown table like llama-bench's: test, depth, median t/s ± standard deviation."""
    lines = ["| test | depth | t/s (median) | ± stdev |", "|---|---:|---:|---:|"]
    lines += [f"| {r.test} | {r.depth} | {r.tokens_per_s:.2f} | {r.stdev:.2f} |" for r in rows]
    return "\n".join(lines)
