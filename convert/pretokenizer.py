"""tokenizer.ggml.pre: llama.cpp's name for a byte-level BPE pre-tokenizer, found by table.

llama.cpp's converter tokenizes a probe text with the HF tokenizer and looks the hash of the
ids up in a list of known models. This converter does not run the HF tokenizer; instead it
reads the pre-tokenizer configuration of tokenizer.json, reduces it to the sequence of
regex splits it performs, and finds that sequence in a table of the pre-tokenizers llama.cpp
implements. Where llama.cpp has several names for one split sequence, they differ in
`clean_spaces` (whether decoding removes spaces before punctuation), which tokenizer_config's
clean_up_tokenization_spaces states.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ott_gguf.errors import UnsupportedError

# the split a ByteLevel pre-tokenizer with use_regex=true performs (GPT-2's regex)
BYTE_LEVEL = "ByteLevel(use_regex)"
DIGITS = r"\p{N}"  # Digits(individual_digits=true)
DIGIT_RUNS = r"\p{N}+"  # Digits(individual_digits=false)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k split (Phi-4-mini)
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class KnownPre:
    name: str  # tokenizer.ggml.pre
    splits: tuple[str, ...]  # isolated regex splits, in order, before the byte-level mapping
    clean_spaces: bool  # llama.cpp's decoding behaviour for this name


# first entry of a split sequence is the choice when clean_up_tokenization_spaces is not stated
KNOWN_PRES = (
    KnownPre("gpt-2", (BYTE_LEVEL,), True),
    KnownPre("smollm", (DIGITS, BYTE_LEVEL), False),
    KnownPre("starcoder", (DIGITS, BYTE_LEVEL), True),
    KnownPre("llama-bpe", (LLAMA3_SPLIT,), True),
    KnownPre("qwen2", (QWEN2_SPLIT,), False),
    KnownPre("stablelm2", (QWEN2_SPLIT,), True),
    KnownPre("gpt-4o", (GPT4O_SPLIT,), False),
)

# normalizers whose effect llama.cpp's byte-level BPE does not reproduce but which leave
# already-composed text unchanged
IGNORED_NORMALIZERS = (None, "NFC")


def _splits(pre: dict[str, Any] | None, where: Path) -> list[str]:
    """The pre-tokenizer as a list of isolated regex splits; ByteLevel(use_regex) as BYTE_LEVEL."""
    if pre is None:
        return []
    kind = pre.get("type")
    if kind == "Sequence":
        return [s for p in pre.get("pretokenizers", []) for s in _splits(p, where)]
    if kind == "ByteLevel":
        if pre.get("add_prefix_space", False):
            raise UnsupportedError(f"{where}: ByteLevel pre-tokenizer with add_prefix_space is not supported")
        return [BYTE_LEVEL] if pre.get("use_regex", True) else []
    if kind == "Digits":
        return [DIGITS if pre.get("individual_digits", False) else DIGIT_RUNS]
    if kind == "Split":
        pattern = pre.get("pattern", {})
        regex = pattern.get("Regex")
        if regex is None or pre.get("behavior") != "Isolated" or pre.get("invert", False):
            raise UnsupportedError(
                f"{where}: Split pre-tokenizer {pattern} {pre.get('behavior')} is not supported "
                f"(only Isolated regex splits)"
            )
        return [regex]
    raise UnsupportedError(f"{where}: pre-tokenizer type {kind} is not supported")


def pre_tokenizer_name(tokenizer: dict[str, Any], clean_up_spaces: bool | None, where: Path) -> str:
    """llama.cpp's tokenizer.ggml.pre for a byte-level BPE tokenizer.json."""
    normalizer = tokenizer.get("normalizer")
    if (normalizer or {}).get("type") not in IGNORED_NORMALIZERS:
        raise UnsupportedError(f"{where}: normalizer {normalizer.get('type')} is not supported for byte-level BPE")
    splits = tuple(_splits(tokenizer.get("pre_tokenizer"), where))
    candidates = [k for k in KNOWN_PRES if k.splits == splits]
    if not candidates:
        raise UnsupportedError(
            f"{where}: unknown pre-tokenizer (splits {list(splits)}); known: {', '.join(k.name for k in KNOWN_PRES)}"
        )
    exact = [k for k in candidates if k.clean_spaces == clean_up_spaces]
    return (exact or candidates)[0].name
