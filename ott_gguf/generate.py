"""Text generation as small named steps: prefill, decode_one_token, generate.

`generate_text` streams the text of one sequence; `generate_batch` decodes several prompts
together, one batch per step with one token per live sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from .errors import ContextFullError, InvalidArgumentError, UnsupportedError
from .model import Model
from .sampling import Sampler, SamplingParams


def check_fits(model: Model, n_prompt: int, what: str = "prompt") -> None:
    if n_prompt >= model.n_ctx:
        raise ContextFullError(
            f"{what} has {n_prompt} tokens but the context holds {model.n_ctx} (raise -c/--ctx-size)"
        )


def prefill(model: Model, ids: Sequence[int], seq: int = 0, n_keep: int = 0) -> np.ndarray:
    """Evaluate the prompt in sequence `seq`, whose first n_keep tokens are already there
    (a quantized cache that cannot drop the rest starts over); logits of its last token."""
    check_fits(model, len(ids))
    n_keep = min(n_keep, len(ids) - 1)
    try:
        model.truncate(seq, n_keep)
    except UnsupportedError:
        n_keep = 0
        model.truncate(seq, 0)
    return model.eval(ids[n_keep:], seq=seq)


def decode_one_token(model: Model, token: int, seq: int = 0) -> np.ndarray:
    return model.eval([token], seq=seq)


def generate_tokens(
    model: Model, prompt_ids: Sequence[int], max_tokens: int, sampler: Sampler, seq: int = 0, n_keep: int = 0
) -> Iterator[int]:
    """Yield sampled tokens until an end-of-generation token, max_tokens or a full context.
    n_keep: leading prompt tokens already cached in `seq` (see prefill)."""
    if not prompt_ids:
        raise InvalidArgumentError("generate: empty prompt")
    history = list(prompt_ids)
    logits = prefill(model, prompt_ids, seq, n_keep)
    for step in range(max_tokens):
        tok = sampler.sample(logits, history)
        if model.tokenizer.is_eog(tok):
            return
        yield tok
        history.append(tok)
        if step + 1 == max_tokens or model.seq_len(seq) + 1 >= model.n_ctx:
            return
        logits = decode_one_token(model, tok, seq)


def stream_text(tokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """Text pieces of a token stream, complete UTF-8 characters only."""
    from .tokenizer import StreamDecoder

    stream = StreamDecoder(tokenizer)
    for tok in tokens:
        piece = stream.feed(tok)
        if piece:
            yield piece
    rest = stream.flush()
    if rest:
        yield rest


def generate_text(
    model: Model,
    prompt: str | Sequence[int],
    max_tokens: int,
    sampling: SamplingParams,
    *,
    seq: int = 0,
    parse_special: bool = True,
) -> Iterator[str]:
    """Stream the continuation of `prompt` as text pieces (complete UTF-8 only)."""
    ids = model.tokenize(prompt, parse_special=parse_special) if isinstance(prompt, str) else list(prompt)
    yield from stream_text(model.tokenizer, generate_tokens(model, ids, max_tokens, Sampler(sampling), seq=seq))


def generate_batch(
    model: Model, prompts: Sequence[str], max_tokens: int, sampling: SamplingParams, *, parse_special: bool = True
) -> list[str]:
    """Generate for several prompts at once: sequence i holds prompt i."""
    if len(prompts) > model.n_seq_max:
        raise InvalidArgumentError(
            f"{len(prompts)} prompts but the context holds {model.n_seq_max} sequences (raise n_seq_max)"
        )
    ids = [model.tokenize(p, parse_special=parse_special) for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise InvalidArgumentError(f"generate_batch: prompt {i} is empty")
        check_fits(model, len(p), f"prompt {i}")
        model.truncate(i, 0)

    # one batch with every prompt; logits of each prompt's last token
    tokens = [t for p in ids for t in p]
    pos = [j for p in ids for j in range(len(p))]
    seqs = [i for i, p in enumerate(ids) for _ in p]
    want = [j == len(p) - 1 for p in ids for j in range(len(p))]
    logits = model.decode_batch(tokens, pos, seqs, want)

    samplers = [Sampler(sampling) for _ in ids]
    history = [list(p) for p in ids]
    out: list[list[int]] = [[] for _ in ids]
    live = list(range(len(ids)))
    for n_done in range(1, max_tokens + 1):
        step = []
        for row, i in enumerate(live):
            tok = samplers[i].sample(logits[row], history[i])
            if model.tokenizer.is_eog(tok):
                continue
            out[i].append(tok)
            history[i].append(tok)
            if len(history[i]) < model.n_ctx:
                step.append((i, tok))
        live = [i for i, _ in step]
        if not live or n_done == max_tokens:
            break
        logits = model.decode_batch(
            [t for _, t in step], [len(history[i]) - 1 for i, _ in step], live, [True] * len(step)
        )
    return [model.detokenize(o) for o in out]
