"""Tokenizer built from GGUF metadata, giving the same token ids as llama.cpp.

Two vocabulary kinds, named by `tokenizer.ggml.model`:

- "llama" (SentencePiece BPE): spaces become '▁', a space is put before the text
  (`add_space_prefix`), adjacent symbols are merged highest token score first, and a
  character that is no token is written as its UTF-8 bytes with the <0xXX> tokens.
- "gpt2" (byte-level BPE): the pre-tokenizer named by `tokenizer.ggml.pre` cuts the text
  into words (ott_gguf.pretokenize), each word is written in GPT-2's byte alphabet and
  merged lowest merge rank first.

Before either runs, the text is cut at the texts of special tokens, longest first:
user-defined tokens always, control and unknown tokens only with parse_special=True. For
Phi-3 models (general.name naming phi-3) whitespace after a special token is dropped, as
llama.cpp's vocabulary loader sets for them (Phi-3's tokenizer.json rstrips those tokens).
Token types, default special ids, add_bos/add_eos and the end-of-generation set follow
llama.cpp's vocabulary loader, including its detection of control tokens by their text.
"""

from __future__ import annotations

import codecs
import heapq
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from enum import IntFlag
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, ModelFileError, UnsupportedError
from .pretokenize import PreTokenizer, byte_decode, byte_encode, pre_tokenizer


class Attr(IntFlag):
    """What a token is; several flags when llama.cpp promotes a token to control."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 4
    USER_DEFINED = 8
    UNUSED = 16
    BYTE = 32


# GGUF `tokenizer.ggml.token_type` value -> Attr (0 and values past the table: undefined).
_TYPE_TO_ATTR = np.array(
    [0, Attr.NORMAL, Attr.UNKNOWN, Attr.CONTROL, Attr.USER_DEFINED, Attr.UNUSED, Attr.BYTE], dtype=np.uint8
)

# Token texts llama.cpp recognises when the GGUF does not name the token. The first text
# present (in this order) is taken; llama.cpp takes whichever its hash map yields first.
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
# Tokens that end generation whatever the GGUF says (llama.cpp's list for the formats
# this runtime meets); eos, eot, eom and the fim pad/rep/sep tokens are added to them.
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<｜end▁of▁sentence｜>",
    )
)

_SPM_SPACE = "\u2581"  # '▁', SentencePiece's visible space
_ASCII_SPACE = " \t\n\v\f\r"  # C's isspace, which llama.cpp strips with
# Models whose special tokens eat the whitespace after them, by general.name (llama.cpp's
# list), except the tokens named here
_RSTRIP_NAMES = ("phi-3", "phi3")
_RSTRIP_EXCEPT = ("<unk>", "<s>", "<|endoftext|>")
_WORD_CACHE_LIMIT = 200_000  # BPE results kept per pre-token word before the cache is emptied

_KEY = "tokenizer.ggml."
_BYTE_TEXT = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_array(v: Any, kinds: str) -> bool:
    """A list/tuple or 1-D numpy array of numbers whose dtype kind is in `kinds` ('iuf', 'iu')."""
    if isinstance(v, np.ndarray):
        return v.ndim == 1 and v.dtype.kind in kinds
    return isinstance(v, (list, tuple)) and all(_is_int(x) or ("f" in kinds and isinstance(x, float)) for x in v)


# what each tokenizer key must hold, as GGUF types arrive in Python (ott_gguf.gguf_meta)
_CHECKS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "bool": (lambda v: isinstance(v, (bool, np.bool_)), "a boolean"),
    "strings": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v), "an array of strings"),
    "numbers": (lambda v: _is_array(v, "iuf"), "an array of numbers"),
    "ints": (lambda v: _is_array(v, "iu"), "an array of integers"),
}


def metadata_value(fields: Mapping[str, Any], key: str, kind: str) -> Any:
    """fields[key] if it holds `kind` (see _CHECKS), None when absent; a GGUF value of another
    type is a ModelFileError naming the key, never a traceback further on."""
    value = fields.get(key)
    if value is None:
        return None
    ok, what = _CHECKS[kind]
    if not ok(value):
        raise ModelFileError(f"GGUF metadata {key} must be {what}, not {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype}"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(x).__name__ for x in value[:1000]})
        return f"an array of {'/'.join(kinds) or 'nothing'}"
    return f"a {type(value).__name__}"


def _read_tokens(fields: Mapping[str, Any]) -> list[str]:
    tokens = metadata_value(fields, _KEY + "tokens", "strings")
    if tokens is None:
        raise ModelFileError("tokenizer.ggml.tokens is missing from the GGUF metadata")
    if not tokens:
        raise ModelFileError("tokenizer.ggml.tokens is empty")
    tokens = list(tokens)
    for i, text in enumerate(tokens):
        if not text:
            tokens[i] = f"[EMPTY_{i}]"  # llama.cpp's name for an empty token
    return tokens


def _read_attrs(fields: Mapping[str, Any], n: int) -> np.ndarray:
    """uint8 [n] of Attr from `tokenizer.ggml.token_type` (all normal when absent)."""
    types = metadata_value(fields, _KEY + "token_type", "ints")
    if types is None:
        return np.full(n, Attr.NORMAL, dtype=np.uint8)
    types = np.asarray(types, dtype=np.int64)
    if types.shape != (n,):
        raise ModelFileError(f"tokenizer.ggml.token_type has {types.size} entries for {n} tokens")
    in_table = (types >= 0) & (types < len(_TYPE_TO_ATTR))
    return np.where(in_table, _TYPE_TO_ATTR[np.where(in_table, types, 0)], 0).astype(np.uint8)


class _Plain(str):
    """Text in which control tokens are not parsed (encode_parts)."""


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build with from_gguf / from_reader /
    from_fields; all special ids are `int | None` (None: the vocabulary has none)."""

    def __init__(self, fields: Mapping[str, Any]):
        """`fields`: GGUF key -> Python value, see from_fields."""
        model = metadata_value(fields, _KEY + "model", "str")
        if model not in ("llama", "gpt2"):
            raise UnsupportedError(f"tokenizer.ggml.model = {model!r} is not supported (supported: 'llama', 'gpt2')")
        self.model: str = model
        self._spm = model == "llama"
        # SPM has no pre-tokenizer; a byte-level vocabulary without one gets "default", as in llama.cpp.
        self.pre: str | None = None if self._spm else (metadata_value(fields, _KEY + "pre", "str") or "default")
        self._pre: PreTokenizer | None = None if self._spm else pre_tokenizer(self.pre)

        self._tokens: list[str] = _read_tokens(fields)
        n = len(self._tokens)
        self._token_to_id: dict[str, int] = dict(zip(self._tokens, range(n)))  # a repeated text keeps its last id
        attrs = _read_attrs(fields, n)  # uint8 [n_vocab] of Attr

        if self._spm:
            scores = metadata_value(fields, _KEY + "scores", "numbers")
            self._scores: list[float] = [0.0] * n if scores is None else np.asarray(scores, dtype=np.float32).tolist()
            if len(self._scores) != n:
                raise ModelFileError(f"tokenizer.ggml.scores has {len(self._scores)} entries for {n} tokens")
        else:
            merges = metadata_value(fields, _KEY + "merges", "strings")
            if merges is None:
                raise ModelFileError("tokenizer.ggml.merges is missing from the GGUF metadata of a gpt2 vocabulary")
            # "left right" -> rank, the first of repeated merges winning. Byte-level symbols
            # never contain ' ', so the merge text itself is the key of the pair (left, right).
            merges = list(merges)
            self._ranks: dict[str, int] = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
            self._word_cache: dict[str, tuple[int, ...]] = {}

        self._read_special_ids(fields, attrs)
        self._attrs: list[int] = attrs.tolist()

        def flag(key: str, default: bool) -> bool:
            value = metadata_value(fields, _KEY + key, "bool")
            return default if value is None else bool(value)

        self.add_bos: bool = flag("add_bos_token", True if self._spm else self._pre.add_bos)
        self.add_eos: bool = flag("add_eos_token", False)
        self._add_space_prefix = self._spm and flag("add_space_prefix", True)
        if self.add_bos and self.bos_id is None:
            raise ModelFileError("tokenizer.ggml.add_bos_token is true but the vocabulary has no BOS token")
        if self.add_eos and self.eos_id is None:
            raise ModelFileError("tokenizer.ggml.add_eos_token is true but the vocabulary has no EOS token")

        # Texts cut out before tokenizing, longest first: (text, id, only with parse_special).
        ids = np.flatnonzero(attrs & (Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)).tolist()
        name = (metadata_value(fields, "general.name", "str") or "").lower()
        self._rstrip: frozenset[int] = (
            frozenset(
                [i for i in ids if self._tokens[i] not in _RSTRIP_EXCEPT]
                + [self._token_to_id[t] for t in ("</s>",) if t in self._token_to_id]
            )
            if any(n in name for n in _RSTRIP_NAMES)
            else frozenset()
        )
        ids.sort(key=lambda i: -len(self._tokens[i]))
        self._specials: list[tuple[str, int, bool]] = [
            (self._tokens[i], i, bool(self._attrs[i] & (Attr.CONTROL | Attr.UNKNOWN))) for i in ids
        ]
        self._pieces: list[bytes | None] = [None] * n  # token_to_piece(id, special=True), filled on use
        for i in np.flatnonzero(attrs & Attr.BYTE).tolist():
            if self._spm and not _BYTE_TEXT.fullmatch(self._tokens[i]):
                raise ModelFileError(f"tokenizer.ggml.tokens[{i}] = {self._tokens[i]!r} is a BYTE token but not <0xNN>")

    def _read_special_ids(self, fields: Mapping[str, Any], attrs: np.ndarray) -> None:
        """Special ids from the metadata, else llama.cpp's defaults or its detection by token
        text; tokens detected by text become control tokens in `attrs` (uint8 [n_vocab])."""
        n = len(self._tokens)
        to_id = self._token_to_id

        def from_key(key: str, default: int | None = None) -> int | None:
            value = metadata_value(fields, _KEY + key, "int")
            if value is not None and 0 <= int(value) < n:
                return int(value)
            return default if default is not None and 0 <= default < n else None

        found_by_text: set[int] = set()

        def from_key_or_text(key: str, texts: tuple[str, ...]) -> int | None:
            tid = from_key(key)
            if tid is None:
                tid = next((to_id[t] for t in texts if t in to_id), None)
                if tid is not None:
                    found_by_text.add(tid)
            return tid

        # llama.cpp's defaults when a key is absent: SPM 1/2/0, byte-level BPE 11/11/none.
        self.bos_id: int | None = from_key("bos_token_id", 1 if self._spm else 11)
        self.eos_id: int | None = from_key("eos_token_id", 2 if self._spm else 11)
        self.unk_id: int | None = from_key("unknown_token_id", 0 if self._spm else None)
        self.pad_id: int | None = from_key("padding_token_id")
        self.eot_id: int | None = from_key_or_text("eot_token_id", _EOT_TEXTS)
        self.eom_id: int | None = from_key_or_text("eom_token_id", _EOM_TEXTS)
        # Fill-in-the-middle tokens: pre/suf/mid only matter as control tokens (found_by_text);
        # pad/rep/sep also end generation.
        for kind, texts in (("pre", _FIM_PRE_TEXTS), ("suf", _FIM_SUF_TEXTS), ("mid", _FIM_MID_TEXTS)):
            from_key_or_text(f"fim_{kind}_token_id", texts)
        fim_eog = [
            from_key_or_text(f"fim_{kind}_token_id", texts)
            for kind, texts in (("pad", _FIM_PAD_TEXTS), ("rep", _FIM_REP_TEXTS), ("sep", _FIM_SEP_TEXTS))
        ]

        eog_by_text = {to_id[t] for t in _EOG_TEXTS if t in to_id}
        found_by_text |= eog_by_text
        self._eog: frozenset[int] = frozenset(
            eog_by_text | {i for i in (self.eos_id, self.eot_id, self.eom_id, *fim_eog) if i is not None}
        )
        for i in found_by_text:
            attrs[i] |= Attr.CONTROL

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """From GGUF metadata already read: full key name -> Python value (str, int, bool,
        list or numpy array). Keys other than tokenizer.ggml.* and general.name are ignored."""
        return cls(fields)

    @classmethod
    def from_reader(cls, reader) -> Tokenizer:
        """From an open gguf.GGUFReader."""
        return cls(
            {
                name: field.contents()
                for name, field in reader.fields.items()
                if name.startswith(_KEY) or name == "general.name"
            }
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """From the metadata of a GGUF file."""
        from gguf import GGUFReader

        if not os.path.isfile(path):
            raise ModelFileError(f"{path}: no such file")
        try:
            reader = GGUFReader(path)
        except (OSError, ValueError, IndexError, KeyError) as e:
            raise ModelFileError(f"{path}: not a readable GGUF file ({e})") from e
        return cls.from_reader(reader)

    # ---- vocabulary ---------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (byte alphabet / '▁' included)."""
        return self._tokens[self._check_id(token_id)]

    def token_attr(self, token_id: int) -> Attr:
        return Attr(self._attrs[self._check_id(token_id)])

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation: eos, eot, eom, and the tokens llama.cpp
        recognises by text (<|im_end|>, <|endoftext|>, <|eot_id|>, ...)."""
        return token_id in self._eog

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise InvalidArgumentError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")
        return token_id

    # ---- text -> ids --------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special: BOS/EOS where the vocabulary adds them;
        parse_special: texts of control tokens (e.g. <|im_start|>) become those tokens."""
        return self.encode_parts([(text, parse_special)], add_special)

    def encode_parts(self, parts: Sequence[tuple[str, bool]], add_special: bool = True) -> list[int]:
        """Token ids of the concatenated texts of `parts`, each (text, parse_special): control
        tokens are parsed only in the parts that allow it (a chat template's own markers, not
        the messages' text); the text between special tokens is tokenized as one piece, as
        if the parts had been one string."""
        for text, _ in parts:
            if not isinstance(text, str):
                raise InvalidArgumentError(f"encode takes a str, got {type(text).__name__}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidArgumentError(f"text is not encodable as UTF-8 at character {e.start}") from e

        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        prev_special = True  # SPM: a text fragment at the start or after a special token gets a space
        for fragment in self._cut_special(parts):
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
            elif self._spm:
                if self._add_space_prefix and prev_special:
                    fragment = " " + fragment
                self._encode_spm(fragment.replace(" ", _SPM_SPACE), out)
                prev_special = False
            else:
                self._encode_bpe(fragment, out)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _cut_special(self, parts: Sequence[tuple[str, bool]]) -> list[str | int]:
        """The texts of `parts` as a list of text fragments and special token ids, in order;
        adjacent text fragments joined."""
        fragments: list[str | int] = [t if parse else _Plain(t) for t, parse in parts if t]
        for tok_text, tok_id, needs_parse in self._specials:
            cut: list[str | int] = []
            for fragment in fragments:
                if (
                    isinstance(fragment, int)
                    or tok_text not in fragment
                    or (needs_parse and isinstance(fragment, _Plain))
                ):
                    cut.append(fragment)
                    continue
                kind = type(fragment)
                for j, part in enumerate(fragment.split(tok_text)):
                    if j:
                        cut.append(tok_id)
                    if part:
                        cut.append(kind(part))
            fragments = cut
        joined: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, str) and joined and isinstance(joined[-1], str):
                joined[-1] = str(joined[-1]) + fragment
            else:
                joined.append(fragment if isinstance(fragment, int) else str(fragment))
        fragments = joined
        if self._rstrip:
            stripped: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, str) and stripped and stripped[-1] in self._rstrip:
                    fragment = fragment.lstrip(_ASCII_SPACE)
                if fragment != "":
                    stripped.append(fragment)
            fragments = stripped
        return fragments

    def _encode_bpe(self, text: str, out: list[int]) -> None:
        cache = self._word_cache
        for word in self._pre.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(byte_encode(word))
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """Merge the characters of one byte-alphabet word, lowest rank first (ties: leftmost)."""
        to_id = self._token_to_id
        if self._pre.ignore_merges and word in to_id:
            return (to_id[word],)
        ranks = self._ranks
        sym = list(word)  # symbol texts; "" once merged into the left neighbour
        nxt = list(range(1, len(sym))) + [-1]  # linked list of live symbols
        prv = list(range(-1, len(sym) - 1))
        heap = []  # (rank, left, right, merged text)
        for i in range(len(sym) - 1):
            rank = ranks.get(sym[i] + " " + sym[i + 1])
            if rank is not None:
                heap.append((rank, i, i + 1, sym[i] + sym[i + 1]))
        heapq.heapify(heap)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
                continue  # a symbol of this pair has changed since it was queued
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[left] != -1:
                prv[nxt[left]] = left
            for a, b in ((prv[left], left), (left, nxt[left])):
                if a != -1 and b != -1:
                    rank = ranks.get(sym[a] + " " + sym[b])
                    if rank is not None:
                        heapq.heappush(heap, (rank, a, b, sym[a] + sym[b]))
        ids: list[int] = []
        for s in sym:
            if not s:
                continue
            if s in to_id:
                ids.append(to_id[s])
            else:  # not a token (a merge list inconsistent with the vocabulary): its bytes, as llama.cpp
                ids.extend(to_id[c] for c in s if c in to_id)
        return tuple(ids)

    def _encode_spm(self, text: str, out: list[int]) -> None:
        """SentencePiece BPE over one fragment ('▁' for spaces): merge the adjacent pair whose
        result is the token of highest score (ties: leftmost) until no pair is a token."""
        to_id, scores = self._token_to_id, self._scores
        sym = list(text)
        nxt = list(range(1, len(sym))) + [-1]
        prv = list(range(-1, len(sym) - 1))

        def pair(a: int, b: int) -> tuple[float, int, int, int] | None:
            """Heap entry (-score, left, right, merged length) when sym[a] + sym[b] is a token."""
            tid = to_id.get(sym[a] + sym[b])
            return None if tid is None else (-scores[tid], a, b, len(sym[a]) + len(sym[b]))

        heap = [e for e in (pair(i, i + 1) for i in range(len(sym) - 1)) if e is not None]
        heapq.heapify(heap)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue  # a symbol of this pair has changed since it was queued
            sym[left], sym[right] = sym[left] + sym[right], ""
            nxt[left] = nxt[right]
            if nxt[left] != -1:
                prv[nxt[left]] = left
            for a, b in ((prv[left], left), (left, nxt[left])):
                if a != -1 and b != -1:
                    entry = pair(a, b)
                    if entry is not None:
                        heapq.heappush(heap, entry)
        for s in sym:
            if not s:
                continue
            tid = to_id.get(s)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_token(b) for b in s.encode("utf-8"))

    def _byte_token(self, byte: int) -> int:
        """SPM byte fallback: <0xXX>, else the one-character token, else <unk>."""
        tid = self._token_to_id.get(f"<0x{byte:02X}>")
        if tid is None and byte < 0x80:
            tid = self._token_to_id.get(chr(byte))
        if tid is None:
            tid = self.unk_id
        if tid is None:
            raise UnsupportedError(f"SPM vocabulary has no byte token <0x{byte:02X}> and no unknown token")
        return tid

    # ---- ids -> text --------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = False) -> bytes:
        """The bytes a token stands for. Control and unknown tokens give b"" unless
        special=True (then their text); unused tokens give b""."""
        piece = self._pieces[self._check_id(token_id)]
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id)
        if not special and self._attrs[token_id] & (Attr.CONTROL | Attr.UNKNOWN):
            return b""
        return piece

    def _piece(self, token_id: int) -> bytes:
        attr, text = self._attrs[token_id], self._tokens[token_id]
        if attr & (Attr.CONTROL | Attr.UNKNOWN | Attr.USER_DEFINED):
            return text.encode("utf-8")
        if attr & Attr.NORMAL:
            return text.replace(_SPM_SPACE, " ").encode("utf-8") if self._spm else byte_decode(text)
        if attr & Attr.BYTE:
            if _BYTE_TEXT.fullmatch(text):
                return bytes([int(text[3:5], 16)])
            return byte_decode(text)
        return b""

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of token ids: their pieces joined, then UTF-8 decoded (bad bytes -> U+FFFD).
        skip_special drops control tokens. With SentencePiece's space prefix, the space
        encode() put before the text is removed from the first text token."""
        pieces = []
        strip_space = self._add_space_prefix
        for tid in ids:
            piece = self.token_to_piece(tid, special=not skip_special)
            if strip_space and self._attrs[tid] & (Attr.NORMAL | Attr.BYTE):
                strip_space = False
                if piece.startswith(b" "):
                    piece = piece[1:]
            pieces.append(piece)
        return b"".join(pieces).decode("utf-8", errors="replace")


class StreamDecoder:
    """Incremental decode for streaming: feed() one token id, get the text it completes.
    Bytes of an unfinished UTF-8 character are held back until a later token completes it
    (flush() writes what remains, invalid bytes as U+FFFD). No space is stripped."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_to_piece(token_id, special=self._special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
