"""Byte-level BPE vocabulary (GPT-2 style, tokenizer.ggml.model = "gpt2") from tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import TokenType

from ott_gguf.errors import ModelFileError, UnsupportedError


def looks_special(text: str) -> bool:
    """Added tokens that some models forget to mark special but which are control tokens."""
    return (text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))


def _merge_text(merge: Any, where: Path) -> str:
    if isinstance(merge, str):
        return merge
    if isinstance(merge, list) and len(merge) == 2 and all(isinstance(p, str) for p in merge):
        # the pair form (transformers >= 4.45) allows spaces inside a piece; GGUF's "a b" form
        # cannot, so a space is written as U+0120 like llama.cpp does
        return " ".join(p.replace(" ", chr(ord(" ") + 256)) for p in merge)
    raise ModelFileError(f"{where}: unknown merges format {merge!r}")


def bpe_tokens(tokenizer: dict[str, Any], n_vocab: int, where: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) with len(tokens) == n_vocab; ids without a token become
    "[PAD<id>]" of type UNUSED, as in llama.cpp."""
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        raise UnsupportedError(
            f"{where}: tokenizer is not a byte-level BPE (model {model.get('type')}, decoder "
            f"{(tokenizer.get('decoder') or {}).get('type')}); a SentencePiece model needs "
            f"tokenizer.model"
        )
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [TokenType.UNUSED] * n_vocab

    def place(text: str, tid: int, kind: TokenType) -> None:
        if not 0 <= tid < n_vocab:
            raise ModelFileError(f"{where}: token {text!r} has id {tid}, outside config.json's vocab_size {n_vocab}")
        tokens[tid] = text
        types[tid] = kind

    for text, tid in model.get("vocab", {}).items():
        place(text, tid, TokenType.NORMAL)
    for added in tokenizer.get("added_tokens", []):
        text = added["content"]
        if added.get("special", False) or looks_special(text):
            place(text, added["id"], TokenType.CONTROL)
        else:
            place(text.replace("\u2581", " "), added["id"], TokenType.USER_DEFINED)  # pre-normalized, as llama.cpp
    merges = [_merge_text(m, where) for m in model.get("merges", [])]
    return tokens, [int(t) for t in types], merges
