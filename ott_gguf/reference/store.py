"""fp16 token stores: the sink, the outlier pool, the extra pool and the window.

K and V arrive as float32 and are rounded to fp16 (round to nearest even) when they are
stored; everything downstream (quantization, OTT scores, attention) reads the fp16 values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ott_gguf.errors import InvalidArgumentError


def to_fp16(x: np.ndarray, what: str) -> np.ndarray:
    """float32 (anything else is first converted to float32) -> fp16, finite values only."""
    x16 = np.asarray(x, dtype=np.float32).astype(np.float16)
    if not np.isfinite(x16).all():
        raise InvalidArgumentError(f"{what}: values are not finite in fp16 (outside ±65504 or NaN)")
    return x16


@dataclass
class TokenStore:
    """Tokens of one KV head kept in fp16, with their positions."""

    k: np.ndarray  # fp16  [n, head_dim]
    v: np.ndarray  # fp16  [n, head_dim]
    pos: np.ndarray  # int32 [n]

    @classmethod
    def empty(cls, head_dim: int) -> TokenStore:
        return cls(np.zeros((0, head_dim), np.float16), np.zeros((0, head_dim), np.float16), np.zeros(0, np.int32))

    def __len__(self) -> int:
        return len(self.pos)

    def concat(self, other: TokenStore) -> TokenStore:
        return TokenStore(
            np.concatenate([self.k, other.k]), np.concatenate([self.v, other.v]), np.concatenate([self.pos, other.pos])
        )

    def select(self, rows: np.ndarray | slice) -> TokenStore:
        """The tokens picked by a bool mask, an index array or a slice, in that order."""
        return TokenStore(self.k[rows], self.v[rows], self.pos[rows])
