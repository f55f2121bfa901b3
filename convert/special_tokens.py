"""Special token ids, add_bos/add_eos and the chat template, from the tokenizer's JSON files.

Follows what llama.cpp's converter (gguf-py SpecialVocab) derives, in the same order:
tokenizer.json's post-processor says which tokens encoding adds, tokenizer_config.json's
add_*_token flags override it; ids come from the token text named in tokenizer_config.json,
else from config.json's *_token_id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ott_gguf.errors import ModelFileError

from .hparams import read_json

log = logging.getLogger(__name__)

# the special tokens and add_*_token flags GGUF has keys for
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "mask")
ADDED_TYPES = ("bos", "eos", "sep")


@dataclass
class SpecialTokens:
    ids: dict[str, int] = field(default_factory=dict)  # "bos" -> token id
    add: dict[str, bool] = field(default_factory=dict)  # "bos" -> encoding adds it
    chat_template: str | list[dict[str, str]] | None = None


def _content(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _add_flags_from_post_processor(post: dict[str, Any] | None, bos: str | None, eos: str | None) -> dict[str, bool]:
    add: dict[str, bool] = {}
    if not post:
        return add
    for proc in post.get("processors", [post]):
        kind = proc.get("type")
        if kind == "ByteLevel":
            add.setdefault("bos", False)
            add.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            add.update(bos=True, eos=True, sep=True)
        elif kind == "TemplateProcessing":
            single = proc.get("single", [])
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                last = single[-1].get("SpecialToken", {}).get("id")
                if first is not None:
                    add["bos"] = first == bos
                if last is not None:
                    add["eos"] = last == eos
    return add


def _chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | list[dict[str, str]] | None:
    if "chat_template" in tokenizer_config:
        return _checked_template(tokenizer_config["chat_template"], directory / "tokenizer_config.json")
    if (directory / "chat_template.jinja").is_file():
        try:
            return (directory / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ModelFileError(
                f"{directory / 'chat_template.jinja'}: not UTF-8 ({e.reason} at byte {e.start})"
            ) from None
    if (directory / "chat_template.json").is_file():
        doc = read_json(directory / "chat_template.json")
        return _checked_template(
            doc.get("chat_template") if isinstance(doc, dict) else doc, directory / "chat_template.json"
        )
    return None


def _checked_template(template: Any, where: Path) -> str | list[dict[str, str]] | None:
    """A template is a string, or a list of {"name": ..., "template": ...} (named templates)."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template
    ):
        return template
    raise ModelFileError(f"{where}: chat_template must be a string or a list of named templates")


def load_special_tokens(
    directory: Path, tokenizer_json: dict[str, Any] | None, tokens: list[str], config: dict[str, Any]
) -> SpecialTokens:
    """tokens: the final token list (length n_vocab), used to find a special token's id by text."""
    path = directory / "tokenizer_config.json"
    tok_config = read_json(path) if path.is_file() else {}
    special = SpecialTokens(chat_template=_chat_template(directory, tok_config))

    contents = {typ: _content(tok_config.get(f"{typ}_token")) for typ in SPECIAL_TYPES}
    # encoder-style tokenizers name their first token cls rather than bos
    contents["bos"] = contents["bos"] or _content(tok_config.get("cls_token"))
    post = (tokenizer_json or {}).get("post_processor")
    special.add = _add_flags_from_post_processor(post, contents["bos"], contents["eos"])
    for typ in ADDED_TYPES:
        if isinstance(tok_config.get(f"add_{typ}_token"), bool):
            special.add[typ] = tok_config[f"add_{typ}_token"]

    added = {a["content"]: a["id"] for a in reversed((tokenizer_json or {}).get("added_tokens", []))}
    first_index = {t: i for i, t in reversed(list(enumerate(tokens)))}
    for typ in SPECIAL_TYPES:
        text = contents[typ]
        tid = added.get(text, first_index.get(text)) if text is not None else None
        if tid is None:
            tid = config.get(f"{typ}_token_id")
        if not isinstance(tid, int) or isinstance(tid, bool):
            continue
        if not 0 <= tid < len(tokens):
            log.warning("%s token id %d is outside the vocabulary of %d tokens; not written", typ, tid, len(tokens))
            continue
        special.ids[typ] = tid
    return special
