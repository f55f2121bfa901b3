"""Continuous batching: one worker thread owns the decoding context and serves every request.

Each step is one `decode_batch` over all active slots: one token for each slot that is
generating, and the next prompt chunk of slots still reading their prompt, as many as the
step's token budget takes (at least one). A prompt chunk ends at the cache's next
quantization event (decode-faithful, docs/design.md §3) or after `chunk` tokens, whichever comes
first, so a request's chunks and hence its greedy output do not depend on what else is in
the batch. Requests wait in a bounded queue and take a free slot between steps; a finished,
failed or cancelled request frees its slot at once.

With `prompt_cache`, a free slot keeps the tokens its cache holds, and a new request takes
the free slot whose tokens share the longest prefix with its prompt: the cache is cut back to
that prefix (where the cache can: a quantized one only within its fp16 window) and only the
rest of the prompt is read, as a chat's next turn resends the conversation so far. The
reused tokens were computed in other steps (an earlier reply token by token, where a fresh
request reads them as one prompt chunk), so its output may then differ from the request
alone by that rounding.

Results go back through each job's `emit` callback, called on the worker thread with
`Delta` (and, where the request asks for them, a `Logprob` per prompt token as it is read
with `echo`, and per generated token before the text it adds), then one `Done` or `Failed`.
A request for no tokens (`max_tokens` 0) reads its prompt and is done. An exception while
serving one request fails that request only; the others go on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import OttError
from ..sampling import Sampler, SamplingParams
from ..tokenizer import StreamDecoder
from .metrics import KVUse, ServerStats
from .stops import StopScanner

log = logging.getLogger("ott_gguf.server")

# prompt tokens a slot reads in one step when every position's logits come back (echo with
# log probabilities): a chunk's logits are [chunk, n_vocab] floats
ECHO_CHUNK = 64


class UnavailableError(OttError):
    """The engine takes no request now: every slot is busy and the queue is full, or it is stopping."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]  # token ids, 1 <= len < the slot's context
    max_tokens: int  # tokens to generate at most (0: the prompt only, for its log probabilities)
    sampling: SamplingParams
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings
    logprobs: int | None = None  # None: none; N: each generated token's log probability and the N likeliest
    echo: bool = False  # with logprobs, the prompt's tokens' too (read whole, never from a cached prefix)

    @property
    def scores_prompt(self) -> bool:
        """Whether every prompt position's logits are wanted (echo with log probabilities)."""
        return self.echo and self.logprobs is not None


@dataclass(frozen=True)
class Delta:
    text: str  # the next piece of generated text


@dataclass(frozen=True)
class Logprob:
    """A token's natural-log probability under the model (softmax of the logits before it,
    before any sampling setting) and the `top` likeliest tokens with theirs, likeliest first;
    a prompt's first token has neither (None)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None

    @classmethod
    def of(cls, logits: np.ndarray, token: int, n_top: int) -> Logprob:
        x = logits.astype(np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))  # log-softmax [n_vocab]
        best = np.argpartition(-lp, n_top - 1)[:n_top] if n_top else np.empty(0, np.int64)
        best = best[np.argsort(-lp[best], kind="stable")]
        return cls(token, float(lp[token]), tuple((int(t), float(lp[t])) for t in best))


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: Exception


class Job:
    """A request and where its events go; `cancel()` may be called from any thread."""

    def __init__(self, request: Request, emit: Callable[[Delta | Done | Failed], None]):
        self.request = request
        self.emit = emit
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Slot:
    """One sequence of the context, serving one job."""

    def __init__(self, seq: int, job: Job, tokenizer):
        self.seq = seq
        self.job = job
        self.n_cached = 0  # tokens of this sequence in the cache
        self.history = list(job.request.prompt)  # prompt + generated ids (for the penalties)
        self.sampler = Sampler(job.request.sampling)
        self.decoder = StreamDecoder(tokenizer)
        self.stops = StopScanner(job.request.stop)
        self.n_generated = 0
        self.pending: int | None = None  # sampled, fed at the next step

    @property
    def prompt(self) -> list[int]:
        return self.job.request.prompt

    @property
    def reading_prompt(self) -> bool:
        return self.n_cached < len(self.prompt)


class Engine:
    """The worker thread, its slots (sequences 0 .. n_seq_max-1 of `ctx`) and the queue."""

    def __init__(
        self,
        ctx,
        *,
        batch: int,
        chunk: int,
        max_queue: int,
        stats: ServerStats | None = None,
        prompt_cache: bool = False,
    ):
        """ctx: a Context with one sequence per slot and n_ubatch >= batch + n_seq_max, so a
        step is one graph. batch: tokens per step (decode tokens first, then whole prompt
        chunks while they fit). chunk: the most prompt tokens a slot feeds in one step.
        max_queue: requests that may wait while every slot is busy. prompt_cache: reuse a free
        slot's cached prefix of a new prompt (above)."""
        self.ctx = ctx
        self.batch, self.chunk, self.max_queue = batch, chunk, max_queue
        self.prompt_cache = prompt_cache
        self.stats = stats or ServerStats()
        self._queue: deque[Job] = deque()
        self._free = list(range(ctx.n_seq_max))[::-1]  # free sequence ids, lowest last
        self._held: dict[int, list[int]] = {}  # free sequence id -> the tokens its cache holds
        self._active: list[Slot] = []  # in admission order
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ott-engine", daemon=True)

    # ---- any thread -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Fail what is queued or running, and end the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise UnavailableError("the server is shutting down")
            if len(self._queue) >= self.max_queue + len(self._free):  # free slots take jobs at the next step
                self.stats.record_request("rejected")
                raise UnavailableError(
                    f"all {self.ctx.n_seq_max} slots are busy and {len(self._queue)} requests are waiting"
                )
            self._queue.append(job)
            self.stats.record_load(len(self._queue), len(self._active))
            self._cond.notify()

    # ---- the worker -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._active and not self._queue:
                    self._cond.wait()
                if self._stopping:
                    break
                self._admit()
            try:
                self._release_cancelled()
                if self._active:
                    self._step()
            except Exception as e:  # a failure outside any one request: fail the running ones, go on
                log.exception("engine step failed")
                for slot in list(self._active):
                    self._fail(slot, e)
            self._record_load()
        self._shut_down()

    def _admit(self) -> None:
        """Move queued jobs into free slots (called with the lock held)."""
        while self._free and self._queue:
            job = self._queue.popleft()
            if job.cancelled:
                self.stats.record_request("cancelled")
                continue
            try:
                slot = Slot(self._free[-1], job, self.ctx.tokenizer)
            except Exception as e:
                self.stats.record_request("error")
                _tell(job, Failed(e))
                continue
            self._take_sequence(slot)
            self._active.append(slot)

    def _take_sequence(self, slot: Slot) -> None:
        """Give the slot the free sequence whose cached tokens share the longest prefix with its
        prompt (none shares one: the next free sequence), cut back to that prefix; at least the
        prompt's last token is read again, for its logits."""
        prompt = slot.prompt
        best, n_best = self._free[-1], 0
        for seq in reversed(self._free) if not slot.job.request.scores_prompt else ():
            n = _common_prefix(self._held.get(seq, ()), prompt, len(prompt) - 1)
            if n > n_best:
                best, n_best = seq, n
        self._free.remove(best)
        held = self._held.pop(best, [])
        if n_best < len(held):
            try:
                self.ctx.truncate(best, n_best)
            except OttError:  # a quantized cache keeps what has left its fp16 window
                self.ctx.truncate(best, 0)
                n_best = 0
        slot.seq, slot.n_cached = best, n_best
        self.stats.record_cached(n_best)

    def _release_cancelled(self) -> None:
        for slot in [s for s in self._active if s.job.cancelled]:
            self.stats.record_request("cancelled")
            self._release(slot)

    def _step(self) -> None:
        plan = self._plan()
        rows = self._decode(plan)
        self._record_load()  # before any event goes out: a client that reads /metrics next sees this step
        n_prompt = n_generated = 0
        for slot, tokens in plan:
            if slot not in rows:
                continue  # failed in _decode
            if slot.reading_prompt:
                n_prompt += len(tokens)
            slot.n_cached += len(tokens)
            if rows[slot] is None:
                continue  # the prompt goes on at the next step
            try:
                n_generated += self._advance(slot, rows[slot])
            except Exception as e:
                self._fail(slot, e)
        self.stats.record_step(n_prompt, n_generated)

    def _plan(self) -> list[tuple[Slot, list[int]]]:
        """The tokens each slot feeds this step: its last sampled token, or its next prompt chunk."""
        plan = [(s, [s.pending]) for s in self._active if not s.reading_prompt]
        budget = self.batch - len(plan)
        n_chunks = 0
        for slot in (s for s in self._active if s.reading_prompt):
            chunk = self._prompt_chunk(slot)
            if n_chunks and len(chunk) > budget:
                break  # prompts are read in admission order
            plan.append((slot, chunk))
            budget -= len(chunk)
            n_chunks += 1
        return plan

    def _prompt_chunk(self, slot: Slot) -> list[int]:
        """Up to `chunk` prompt tokens (ECHO_CHUNK where every position's logits come back),
        ending at the cache's next quantization event."""
        chunk = min(self.chunk, ECHO_CHUNK) if slot.job.request.scores_prompt else self.chunk
        n = min(len(slot.prompt) - slot.n_cached, chunk)
        n = min(n, self.ctx.tokens_until_event(slot.seq) or n)
        return slot.prompt[slot.n_cached : slot.n_cached + n]

    def _decode(self, plan) -> dict[Slot, np.ndarray | None]:
        """Logits row of each slot that samples after this step (None for a slot whose prompt
        goes on). When the batch fails, each slot is retried alone so that only the failing
        ones fail (a failed batch leaves every sequence as it was)."""
        try:
            return self._decode_batch(plan)
        except Exception as e:
            if len(plan) == 1:
                self._fail(plan[0][0], e)
                return {}
        rows = {}
        for entry in plan:
            try:
                rows.update(self._decode_batch([entry]))
            except Exception as e:
                self._fail(entry[0], e)
        return rows

    def _decode_batch(self, plan) -> dict[Slot, np.ndarray | None]:
        tokens, pos, seqs, want, samples, echoes = [], [], [], [], [], []
        for slot, chunk in plan:
            samples.append(slot.n_cached + len(chunk) >= len(slot.prompt))  # sampling follows this chunk
            echoes.append(slot.reading_prompt and slot.job.request.scores_prompt)
            tokens += chunk
            pos += range(slot.n_cached, slot.n_cached + len(chunk))
            seqs += [slot.seq] * len(chunk)
            want += [echoes[-1]] * (len(chunk) - 1) + [samples[-1] or echoes[-1]]
        logits = iter(self.ctx.decode_batch(tokens, pos, seqs, want))  # F32 [n_want, n_vocab], batch order
        rows = {}
        for (slot, chunk), sample, echo in zip(plan, samples, echoes):
            if echo:  # each position's logits give the next prompt token's log probability
                if slot.n_cached == 0:
                    slot.job.emit(Logprob(slot.prompt[0], None, None))
                for j in range(len(chunk)):
                    row, nxt = next(logits), slot.n_cached + j + 1
                    if nxt < len(slot.prompt):
                        slot.job.emit(Logprob.of(row, slot.prompt[nxt], slot.job.request.logprobs))
            elif sample:
                row = next(logits)
            rows[slot] = row if sample else None  # the chunk's last position's logits
        return rows

    def _advance(self, slot: Slot, logits: np.ndarray) -> int:
        """Sample the slot's next token and pass on its text; 1 if a token was generated, else 0."""
        if slot.job.request.max_tokens == 0:  # the prompt alone was asked for
            self._finish(slot, "length")
            return 0
        tok = slot.sampler.sample(logits, slot.history)
        if self.ctx.tokenizer.is_eog(tok):
            self._finish(slot, "stop")
            return 0
        if slot.job.request.logprobs is not None:
            slot.job.emit(Logprob.of(logits, tok, slot.job.request.logprobs))
        slot.history.append(tok)
        slot.n_generated += 1
        self._emit_text(slot, slot.stops.feed(slot.decoder.feed(tok)))
        if slot.stops.stopped:
            self._finish(slot, "stop")
        elif slot.n_generated >= slot.job.request.max_tokens or slot.n_cached >= self.ctx.n_ctx:
            self._finish(slot, "length")
        else:
            slot.pending = tok
        return 1

    def _finish(self, slot: Slot, reason: str) -> None:
        if not slot.stops.stopped:  # what the decoder and the stop scanner still hold
            self._emit_text(slot, slot.stops.feed(slot.decoder.flush()))
            self._emit_text(slot, slot.stops.flush())
        reason = "stop" if slot.stops.stopped else reason
        self.stats.record_request(reason)
        self._release(slot)
        slot.job.emit(Done(reason, len(slot.prompt), slot.n_generated))

    def _fail(self, slot: Slot, error: Exception) -> None:
        log.warning("request failed: %s: %s", type(error).__name__, error)
        self.stats.record_request("error")
        self._release(slot, keep=False)  # its cache may hold more than it counted
        _tell(slot.job, Failed(error))

    @staticmethod
    def _emit_text(slot: Slot, text: str) -> None:
        if text:
            slot.job.emit(Delta(text))

    def _release(self, slot: Slot, keep: bool = True) -> None:
        """Free the slot's sequence at once (with prompt_cache and keep, it keeps its tokens for a
        later prompt)."""
        if slot in self._active:
            self._active.remove(slot)
            if self.prompt_cache and keep:
                self._held[slot.seq] = slot.history[: slot.n_cached]
            else:
                self.ctx.truncate(slot.seq, 0)
            self._free.append(slot.seq)

    def _record_load(self) -> None:
        st = self.ctx.kv_stats()
        with self._cond:
            n_queued = len(self._queue)
        self.stats.record_load(
            n_queued, len(self._active), KVUse(st.bytes_used, st.bytes_allocated, st.bits_per_element)
        )

    def _shut_down(self) -> None:
        error = UnavailableError("the server is shutting down")
        for slot in list(self._active):
            self._fail(slot, error)
        while self._queue:
            _tell(self._queue.popleft(), Failed(error))


def _common_prefix(a, b, limit: int) -> int:
    """Length of the common prefix of a and b, at most limit."""
    n = 0
    for x, y in zip(a, b):
        if n >= limit or x != y:
            break
        n += 1
    return n


def _tell(job: Job, event: Failed) -> None:
    """Pass a failure on; a job that cannot take it has nobody left to tell."""
    try:
        job.emit(event)
    except Exception:
        log.exception("could not report a failed request")
