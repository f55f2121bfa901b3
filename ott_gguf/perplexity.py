"""Perplexity by llama.cpp's method (`llama-perplexity` without --ppl-stride).

The text is tokenized once (with BOS when the vocab adds it) and cut into non-overlapping
windows of n_ctx tokens. Each window is evaluated from an empty sequence, with its first
token replaced by BOS when the vocab adds BOS, and only its second half is scored: the
logits at positions n_ctx/2 .. n_ctx-2 predict the tokens at n_ctx/2+1 .. n_ctx-1, so
every scored token has at least n_ctx/2 tokens of context. PPL = exp(mean NLL); its
standard error is llama.cpp's: sqrt(var(NLL) / (count - 1)) * PPL.

With a quantized KV cache each chunk attends to the cache as earlier chunks left it
(docs/design.md §3), so the chunking is part of the result. By default a quantized cache is fed in
decode-faithful chunks: each chunk ends exactly where the cache's next quantization event
fires (`Model.tokens_until_event`), so every token sees the cache it would see in
token-by-token decoding. With a `reference` model (the same weights with an fp16 cache) the
run also reports the mean KL divergence from the reference's next-token distributions and
how often both rank the same token first.

The reference is fed the chunks the model was fed, so that the KL measures what the cache
changes and nothing else: ggml's batched matmul and attention kernels can round differently
for other chunk sizes, and the 8-bit activation blocks of quantized weights turn such
differences into flipped codes (SmolLM2's f16 cache fed token by token is KL ~0.004 nats from
the same cache fed the window at once; chunks of 128 tokens give bit for bit the logits of
one pass on an AVX-512 CPU, docs/results.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from .errors import InvalidArgumentError

# Rows of logits turned into float64 at a time when scoring (bounds the temporary memory).
_SCORE_ROWS = 64


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float  # standard error of ppl (llama.cpp's "+/-")
    n_tokens_scored: int
    chunks: int  # windows evaluated
    per_chunk: list[float] = field(default_factory=list)  # running PPL after each window, as llama.cpp prints it
    chunking: str = ""  # how windows were fed: "ubatch N" or "decode-faithful"
    kl: float | None = None  # mean KL(reference || model) over scored tokens, nats (same chunks)
    top1: float | None = None  # fraction of scored tokens whose argmax equals the reference's


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """F64 [rows, n_vocab] log-probabilities of F32 logits."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under a log-softmax taken in float64.

    logits: F32 [n, n_vocab]; targets: [n] token ids; returns F64 [n].
    """
    out = np.empty(len(targets), dtype=np.float64)
    for r0 in range(0, len(targets), _SCORE_ROWS):
        lp = log_softmax(logits[r0 : r0 + _SCORE_ROWS])  # [rows, n_vocab]
        out[r0 : r0 + len(lp)] = -lp[np.arange(len(lp)), targets[r0 : r0 + len(lp)]]
    return out


def kl_and_top1(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: KL(ref || model) in nats (F64 [n]) and whether both argmaxes agree (bool [n])."""
    kl = np.empty(len(logits), dtype=np.float64)
    for r0 in range(0, len(logits), _SCORE_ROWS):
        lr = log_softmax(ref_logits[r0 : r0 + _SCORE_ROWS])
        lm = log_softmax(logits[r0 : r0 + _SCORE_ROWS])
        kl[r0 : r0 + len(lr)] = (np.exp(lr) * (lr - lm)).sum(axis=1)
    return kl, ref_logits.argmax(axis=1) == logits.argmax(axis=1)


def tokenize_for_windows(tokenize: Callable[[str], list[int]], text: str, n_tokens: int | None) -> list[int]:
    """The first `n_tokens` tokens of tokenize(text) (all of them when n_tokens is None),
    tokenizing only a prefix of the text when that suffices.

    Why a prefix gives the same tokens: the pre-tokenizer splits left to right, and each
    split depends only on the text up to its end plus one character of look-ahead; BPE then
    works inside one split. So the tokens of text[:cut] and of text agree except for the
    splits touching the cut. The cut is put after a newline, and the prefix must yield at
    least `margin` tokens (256, or 1/16 of those used) beyond those used, far more than the
    splits at the cut can cover.
    """
    if n_tokens is None:
        return tokenize(text)
    margin = max(256, n_tokens // 16)
    n_chars = 6 * (n_tokens + margin)  # English BPE: about 4-5 characters per token
    while True:
        cut = text.find("\n", n_chars)
        if cut < 0:
            return tokenize(text)
        tokens = tokenize(text[: cut + 1])
        if len(tokens) >= n_tokens + margin:
            return tokens
        n_chars *= 2


def windows(tokens: Sequence[int], n_ctx: int, n_windows: int, bos: int | None) -> list[np.ndarray]:
    """The first n_windows windows of n_ctx tokens (int32 [n_ctx] each), BOS first when the
    vocabulary adds it (bos not None), as llama.cpp's perplexity feeds them."""
    out = []
    for i in range(n_windows):
        window = np.asarray(tokens[i * n_ctx : (i + 1) * n_ctx], dtype=np.int32).copy()
        if bos is not None:
            window[0] = bos
        out.append(window)
    return out


def perplexity(
    model,
    text: str,
    n_ctx: int,
    n_chunks: int | None = None,
    ubatch: int | None = None,
    progress: bool = True,
    on_chunk: Callable[[int, float], None] | None = None,
    seq: int = 0,
    reference=None,
) -> PerplexityResult:
    """Perplexity of `model` on `text` over windows of `n_ctx` tokens (llama.cpp's method).

    n_chunks limits the number of windows (None: all that fit); ubatch is the number of
    tokens per decode call (None: the whole window, or decode-faithful chunks for a
    quantized cache); on_chunk(i, running_ppl) is called after window i (1-based).
    reference: a model with an fp16 cache for KL and top-1 agreement. Uses (and clears)
    sequence `seq` of each model.
    """
    if n_ctx < 4 or n_ctx % 2:
        raise InvalidArgumentError(f"perplexity: context must be an even number >= 4, got {n_ctx}")
    for m in (model, reference):
        if m is not None and n_ctx > m.n_ctx:
            raise InvalidArgumentError(f"perplexity: window of {n_ctx} tokens exceeds the model context of {m.n_ctx}")
    if n_chunks is not None and n_chunks < 1:
        raise InvalidArgumentError(f"perplexity: chunks must be >= 1, got {n_chunks}")
    if ubatch is not None and ubatch < 1:
        raise InvalidArgumentError(f"perplexity: ubatch must be >= 1, got {ubatch}")

    # At least two windows are needed, as in llama.cpp.
    needed = None if n_chunks is None else max(n_chunks, 2) * n_ctx
    tokens = np.asarray(tokenize_for_windows(model.tokenize, text, needed), dtype=np.int32)  # [n_tokens]
    if len(tokens) < 2 * n_ctx:
        raise InvalidArgumentError(
            f"perplexity: the text has {len(tokens)} tokens, at least {2 * n_ctx} (two windows of {n_ctx}) are needed"
        )
    n_windows = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)

    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    first = n_ctx // 2
    nll_sum = nll2_sum = kl_sum = 0.0
    count = agree = 0
    running = []
    wins = windows(tokens, n_ctx, n_windows, bos)  # [n_ctx] each
    for i, window in enumerate(tqdm(wins, desc="perplexity", unit="window", disable=not progress, leave=False)):
        logits, bounds = window_logits(model, window, first, ubatch, seq)  # [n_ctx - first - 1, n_vocab]
        nll = token_nll(logits, window[first + 1 :])
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(nll)
        if reference is not None:
            kl, same = kl_and_top1(window_logits(reference, window, first, ubatch, seq, chunks=bounds)[0], logits)
            kl_sum += float(kl.sum())
            agree += int(same.sum())
        running.append(math.exp(nll_sum / count))
        if on_chunk is not None:
            on_chunk(i + 1, running[-1])

    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    stderr = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    faithful = ubatch is None and model.tokens_until_event(seq) is not None
    return PerplexityResult(
        ppl=ppl,
        stderr=stderr,
        n_tokens_scored=count,
        chunks=n_windows,
        per_chunk=running,
        chunking="decode-faithful" if faithful else f"ubatch {ubatch or n_ctx}",
        kl=kl_sum / count if reference is not None else None,
        top1=agree / count if reference is not None else None,
    )


def event_chunks(model, n_tokens: int, seq: int = 0, ubatch: int | None = None):
    """Bounds (b0, b1) of the chunks that evaluate tokens 0 .. n_tokens-1 of an empty sequence:
    `ubatch` tokens each, or with ubatch None each up to the cache's next quantization event
    (the whole rest for fp16), so that the cache ends as token-by-token decoding leaves it.
    Evaluate each chunk before taking the next: the event distance is read then."""
    b0 = 0
    while b0 < n_tokens:
        b1 = min(n_tokens, b0 + (ubatch or model.tokens_until_event(seq) or n_tokens))
        yield b0, b1
        b0 = b1


def window_logits(
    model, window: np.ndarray, first: int, ubatch: int | None, seq: int, chunks: list[tuple[int, int]] | None = None
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Evaluate one window from an empty sequence; logits F32 [n_ctx - first - 1, n_vocab] at
    positions first .. n_ctx-2 (each predicts the next token), and the chunks' bounds. Chunks:
    the given bounds, else `ubatch` tokens, or with ubatch None up to the cache's next
    quantization event (the whole window for fp16)."""
    n_ctx = len(window)
    model.truncate(seq, 0)
    out = []
    bounds = []
    for b0, b1 in chunks if chunks is not None else event_chunks(model, n_ctx, seq, ubatch):
        bounds.append((b0, b1))
        pos = np.arange(b0, b1, dtype=np.int32)  # [n_chunk]
        want = (pos >= first) & (pos <= n_ctx - 2)  # [n_chunk] positions whose next token is scored
        logits = model.decode_batch(window[pos], pos, np.full(len(pos), seq, dtype=np.int32), want)  # [n_want, n_vocab]
        if want.any():
            out.append(logits)
    model.truncate(seq, 0)
    return np.concatenate(out), bounds
