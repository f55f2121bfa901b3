"""The tokenizer of a checkpoint as GGUF tokenizer.* keys.

tokenizer.model (SentencePiece) is preferred when present, like llama.cpp's converter does
for llama and qwen2; otherwise tokenizer.json must hold a byte-level BPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFWriter

from ott_gguf.errors import ModelFileError

from .bpe_vocab import bpe_tokens
from .hparams import read_json
from .pretokenizer import pre_tokenizer_name
from .special_tokens import SpecialTokens, load_special_tokens
from .spm_vocab import spm_tokens


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]  # [n_vocab]
    types: list[int]  # [n_vocab] gguf TokenType
    scores: list[float] | None  # [n_vocab], SentencePiece only
    merges: list[str]  # "a b" pairs, BPE only
    special: SpecialTokens
    add_space_prefix: bool | None  # tokenizer_config's add_prefix_space, when stated


def check_tokenizer_json(tokenizer: Any, path: Path) -> None:
    """The parts of tokenizer.json the converter reads have the shapes it expects."""

    def bad(what: str) -> ModelFileError:
        return ModelFileError(f"{path}: {what}")

    if not isinstance(tokenizer, dict):
        raise bad("expected a JSON object")
    for key in ("model", "decoder", "pre_tokenizer", "normalizer", "post_processor"):
        if tokenizer.get(key) is not None and not isinstance(tokenizer[key], dict):
            raise bad(f"'{key}' must be an object")
    model = tokenizer.get("model") or {}
    vocab = model.get("vocab", {})
    if isinstance(vocab, dict):
        if not all(isinstance(t, str) and isinstance(i, int) and not isinstance(i, bool) for t, i in vocab.items()):
            raise bad("'model.vocab' must map token texts to integer ids")
    elif model.get("type") == "BPE":
        raise bad("'model.vocab' of a BPE model must be an object")
    if not isinstance(model.get("merges", []), list):
        raise bad("'model.merges' must be a list")
    added = tokenizer.get("added_tokens", [])
    if not isinstance(added, list):
        raise bad("'added_tokens' must be a list")
    for i, a in enumerate(added):
        if not (
            isinstance(a, dict)
            and isinstance(a.get("content"), str)
            and isinstance(a.get("id"), int)
            and not isinstance(a.get("id"), bool)
        ):
            raise bad(f"added_tokens[{i}] must have a string 'content' and an integer 'id'")


def load_vocab(directory: Path, n_vocab: int, config: dict[str, Any]) -> Vocab:
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = read_json(tok_config_path) if tok_config_path.is_file() else {}
    if not isinstance(tok_config, dict):
        raise ModelFileError(f"{tok_config_path}: expected a JSON object")
    add_prefix_space = tok_config.get("add_prefix_space")
    add_space_prefix = add_prefix_space if isinstance(add_prefix_space, bool) else None
    json_path = directory / "tokenizer.json"
    tokenizer = read_json(json_path) if json_path.is_file() else None
    if tokenizer is not None:
        check_tokenizer_json(tokenizer, json_path)

    if (directory / "tokenizer.model").is_file():
        tokens, scores, types = spm_tokens(directory, n_vocab)
        special = load_special_tokens(directory, tokenizer, tokens, config)
        return Vocab("llama", "default", tokens, types, scores, [], special, add_space_prefix)
    if tokenizer is None:
        raise ModelFileError(f"{directory}: no tokenizer.json or tokenizer.model")
    tokens, types, merges = bpe_tokens(tokenizer, n_vocab, json_path)
    clean_up = tok_config.get("clean_up_tokenization_spaces")
    pre = pre_tokenizer_name(tokenizer, clean_up if isinstance(clean_up, bool) else None, json_path)
    special = load_special_tokens(directory, tokenizer, tokens, config)
    return Vocab("gpt2", pre, tokens, types, None, merges, special, add_space_prefix)


def add_vocab(w: GGUFWriter, vocab: Vocab, add_space_prefix: bool | None) -> None:
    """add_space_prefix: the tokenizer.ggml.add_space_prefix to write (None: none)."""
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    for typ, tid in vocab.special.ids.items():
        getattr(w, f"add_{typ}_token_id")(tid)
    for typ, add in vocab.special.add.items():
        getattr(w, f"add_add_{typ}_token")(add)
    if vocab.special.chat_template:
        w.add_chat_template(vocab.special.chat_template)
