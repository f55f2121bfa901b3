"""Token sampling from a logits vector: greedy, logit bias, penalties, top-k, top-p, min-p,
temperature.

The filters run in the order of llama.cpp's default sampler chain:
logit bias -> penalties -> top-k -> top-p -> min-p -> temperature -> draw.
Top-p and min-p therefore see the distribution at temperature 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ott_gguf.errors import InvalidArgumentError


@dataclass
class SamplingParams:
    """Sampling settings; the defaults are llama.cpp's.

    temperature <= 0 means greedy (argmax after the penalties).
    top_k = 0, top_p = 1 and min_p = 0 each switch their filter off.
    repeat_last_n = -1 penalises the whole history, 0 switches the penalties off.
    frequency_penalty and presence_penalty (OpenAI's, 0 = off) look at the same recent tokens.
    logit_bias: token id -> a value added to its logit before everything else (OpenAI's, each
    in [-100, 100]: -100 bans a token in practice, +100 all but forces it).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature):
            raise InvalidArgumentError(f"sampling: temperature must be finite, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise InvalidArgumentError(f"sampling: top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgumentError(f"sampling: min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0.0):
            raise InvalidArgumentError(f"sampling: repeat_penalty must be > 0, got {self.repeat_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidArgumentError(f"sampling: {name} must be in [-2, 2], got {getattr(self, name)}")
        if (
            isinstance(self.repeat_last_n, bool)
            or not isinstance(self.repeat_last_n, (int, np.integer))
            or self.repeat_last_n < -1
        ):
            raise InvalidArgumentError(
                f"sampling: repeat_last_n must be an integer >= -1 (-1 = whole history), got {self.repeat_last_n!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0
        ):
            raise InvalidArgumentError(f"sampling: seed must be None or an integer >= 0, got {self.seed!r}")
        for tok, bias in (self.logit_bias or {}).items():
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)) or tok < 0:
                raise InvalidArgumentError(f"sampling: logit_bias token ids are integers >= 0, got {tok!r}")
            if not -100.0 <= bias <= 100.0:
                raise InvalidArgumentError(f"sampling: logit_bias of token {tok} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Draws one token id per call; owns the random generator, so a seed fixes the whole sequence of draws."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params if params is not None else SamplingParams()
        self.rng = np.random.Generator(np.random.PCG64(self.params.seed))

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits: F32 [n_vocab] for the next position; history: token ids seen so far (prompt + generated)."""
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise InvalidArgumentError(f"sampling: logits must be a non-empty 1-D array, got shape {logits.shape}")
        logits = self._penalize(self._bias(logits.astype(np.float32, copy=True)), history)
        if self.params.greedy:
            return int(np.argmax(logits))

        ids = self._top_k(logits)  # [n_cand] candidate token ids
        cand = logits[ids].astype(np.float64)  # [n_cand] their logits
        if self.params.top_p < 1.0:
            ids, cand = self._top_p(ids, cand)
        if self.params.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); the max always survives
            keep = cand >= cand.max() + math.log(self.params.min_p)
            ids, cand = ids[keep], cand[keep]

        z = cand / self.params.temperature
        probs = np.exp(z - z.max())  # [n_cand] unnormalised
        cdf = np.cumsum(probs)
        pick = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return int(ids[min(pick, ids.size - 1)])

    def _bias(self, logits: np.ndarray) -> np.ndarray:
        """logit_bias added (in place on the copy it is given)."""
        if not self.params.logit_bias:
            return logits
        ids = np.fromiter(self.params.logit_bias, dtype=np.int64)
        if ids.max() >= logits.size:
            raise InvalidArgumentError(f"sampling: logit_bias names token {ids.max()}, outside [0, {logits.size})")
        logits[ids] += np.fromiter(self.params.logit_bias.values(), dtype=np.float32)
        return logits

    def _penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp's penalties over the recent tokens (in place on the copy it is given): each
        distinct token's logit is divided by repeat_penalty when positive and multiplied by it
        otherwise, then lowered by count·frequency_penalty + presence_penalty."""
        p = self.params
        if (
            (p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)
            or p.repeat_last_n == 0
            or len(history) == 0
        ):
            return logits
        recent = np.asarray(history if p.repeat_last_n == -1 else history[-p.repeat_last_n :], dtype=np.int64)
        if recent.min() < 0 or recent.max() >= logits.size:
            raise InvalidArgumentError(
                f"sampling: history holds a token id outside [0, {logits.size}) "
                f"(min {recent.min()}, max {recent.max()})"
            )
        ids, counts = np.unique(recent, return_counts=True)
        seen = logits[ids]
        seen = np.where(seen > 0.0, seen / p.repeat_penalty, seen * p.repeat_penalty)
        logits[ids] = seen - counts * np.float32(p.frequency_penalty) - np.float32(p.presence_penalty)
        return logits

    def _top_k(self, logits: np.ndarray) -> np.ndarray:
        """Ids of the top_k largest logits (all ids when top_k is 0 or >= n_vocab), in no particular order."""
        k = self.params.top_k
        if k == 0 or k >= logits.size:
            return np.arange(logits.size)
        return np.argpartition(logits, logits.size - k)[logits.size - k :]

    def _top_p(self, ids: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Smallest prefix of the candidates sorted by probability whose mass reaches top_p.

        Sorting all 151k logits costs ~20 ms, so only the m most likely candidates are sorted,
        m growing until they hold top_p of the mass (usually the first try)."""
        probs = np.exp(cand - cand.max())
        probs /= probs.sum()  # [n_cand]
        n, m = probs.size, min(256, probs.size)
        while True:
            head = np.arange(n) if m == n else np.argpartition(-probs, m - 1)[:m]
            if m == n or probs[head].sum() >= self.params.top_p:
                break
            m = min(n, m * 16)
        head = head[np.argsort(-probs[head], kind="stable")]  # [m] most likely first
        n_keep = int(np.searchsorted(np.cumsum(probs[head]), self.params.top_p, side="left")) + 1
        keep = head[:n_keep]
        return ids[keep], cand[keep]
