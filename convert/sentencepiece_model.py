"""The pieces of a SentencePiece tokenizer.model, read without the sentencepiece package.

tokenizer.model is a protobuf `ModelProto`; only its `pieces` are needed:
    message ModelProto      { repeated SentencePiece pieces = 1; ... }
    message SentencePiece   { string piece = 1; float score = 2; Type type = 3 [default = NORMAL]; }
    enum Type { NORMAL = 1; UNKNOWN = 2; CONTROL = 3; USER_DEFINED = 4; UNUSED = 5; BYTE = 6; }
The Type values are those of gguf's TokenType.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ott_gguf.errors import ModelFileError

NORMAL = 1


@dataclass(frozen=True)
class Piece:
    text: str
    score: float
    type: int  # SentencePiece Type == gguf TokenType


class _Truncated(Exception):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise _Truncated
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one message; value is an int or the raw bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"wire type {wire}")
        if pos > len(buf):
            raise _Truncated
        yield field, wire, value


def read_pieces(path: Path) -> list[Piece]:
    try:
        buf = path.read_bytes()
        pieces = []
        for field, wire, value in _fields(buf):
            if field != 1 or wire != 2:
                continue
            text, score, kind = "", 0.0, NORMAL
            for f, w, v in _fields(value):
                if f == 1 and w == 2:
                    text = v.decode("utf-8")
                elif f == 2 and w == 5:
                    (score,) = struct.unpack("<f", v)
                elif f == 3 and w == 0:
                    kind = v
            pieces.append(Piece(text, score, kind))
    except _Truncated:
        raise ModelFileError(f"{path}: truncated SentencePiece model") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not a SentencePiece model ({e})") from None
    if not pieces:
        raise ModelFileError(f"{path}: SentencePiece model without pieces")
    return pieces
