"""Pre-tokenizers of byte-level BPE vocabularies, keyed by GGUF `tokenizer.ggml.pre`.

A pre-tokenizer cuts a text fragment into words; BPE merges never cross a word boundary.
Each entry is a list of regexes applied in turn, the way llama.cpp does it: the first
splits the text into its matches and the text between them, the next splits each of
those pieces the same way, and so on. A piece boundary acts as the end of the text for
the next regex (this matters for `\\s+(?!\\S)`).

Unicode classes: \\p{L}, \\p{N} are the general categories and \\s is the White_Space
property, as in llama.cpp's code-point tables.

The words are then mapped byte by byte to GPT-2's printable stand-ins (`byte_encode`),
which is the alphabet that byte-level BPE vocabularies and merges are written in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import regex

from .errors import UnsupportedError

# GPT-2: contractions, letters, numbers, other symbols (each with one optional leading
# space), then whitespace runs (a run followed by a word leaves its last space to it).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Llama 3: case-insensitive contractions, a letter run with one optional leading
# non-letter/non-digit/non-newline, digits in groups of at most 3, symbols with trailing
# newlines, newline runs with the whitespace before them.
LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2: Llama 3's pattern with every digit on its own.
QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# OpenAI's o200k (GPT-4o, Phi-4-mini): a word is an optional leading non-letter/non-digit,
# a run of upper-case-ish letters then lower-case-ish ones (or the reverse), with an optional
# contraction; digits in groups of at most 3; symbols with trailing newlines or slashes.
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The fallback of llama.cpp for pre-tokenizer "default": punctuation runs, GPT-2,
# digit runs, then groups of three ASCII digits.
DEFAULT = (r"[\p{P}$+<=>^~|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    name: str  # the `tokenizer.ggml.pre` value it was chosen by
    patterns: tuple[str, ...]  # applied in turn, see the module docstring
    ignore_merges: bool = False  # a word that is itself a token is emitted whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token
    compiled: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "compiled", tuple(regex.compile(p) for p in self.patterns))

    def split(self, text: str) -> list[str]:
        """The words of `text`, in order; "".join(words) == text."""
        pieces = [text] if text else []
        for pattern in self.compiled:
            out: list[str] = []
            for piece in pieces:
                end = 0
                for m in pattern.finditer(piece):
                    start = m.start()
                    if start > end:
                        out.append(piece[end:start])
                    out.append(m.group())
                    end = m.end()
                if end < len(piece):
                    out.append(piece[end:])
            pieces = out
        return pieces


def _family(patterns: tuple[str, ...], names: tuple[str, ...], **options) -> dict[str, PreTokenizer]:
    return {name: PreTokenizer(name, patterns, **options) for name in names}


# `tokenizer.ggml.pre` name -> pre-tokenizer. Names share an entry where llama.cpp gives
# them the same regexes and the same merge/BOS options. "gpt2" is accepted besides
# llama.cpp's "gpt-2".
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_family(DEFAULT, ("default",)),
    **_family((GPT2,), ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling")),
    **_family(
        (r"\p{N}", GPT2), ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2")
    ),
    **_family(
        (LLAMA3,),
        ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        ignore_merges=True,
        add_bos=True,
    ),
    **_family((QWEN2,), ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open", "kormo")),
    **_family((GPT4O,), ("gpt-4o", "llama4", "kanana2")),
}


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The pre-tokenizer for a `tokenizer.ggml.pre` value (None or "" -> "default")."""
    spec = PRE_TOKENIZERS.get(name or "default")
    if spec is None:
        raise UnsupportedError(
            f"tokenizer.ggml.pre = {name!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return spec


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the
    other 68 bytes (controls, space, DEL, NBSP, soft hyphen) take U+0100 upwards in order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    alphabet, n_shifted = [], 0
    for b in range(256):
        if b in printable:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(256 + n_shifted))
            n_shifted += 1
    return alphabet


BYTE_TO_CHAR: list[str] = _byte_alphabet()  # [256] byte -> character
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
_ENCODE_TABLE = {b: c for b, c in enumerate(BYTE_TO_CHAR)}  # str.translate table on Latin-1 text


def byte_encode(word: str) -> str:
    """The UTF-8 bytes of `word` written in GPT-2's byte alphabet (one character per byte)."""
    return word.encode("utf-8").decode("latin-1").translate(_ENCODE_TABLE)


def byte_decode(text: str) -> bytes:
    """The bytes that a token written in GPT-2's byte alphabet stands for. A character
    outside the alphabet (none in a well-formed vocabulary) is kept as its UTF-8."""
    try:
        return bytes([CHAR_TO_BYTE[c] for c in text])
    except KeyError:
        return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in text)
