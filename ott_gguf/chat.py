"""Chat templates: the model's `tokenizer.chat_template` (Jinja) turned into a prompt string.

Rendering follows Hugging Face transformers so templates behave as their authors tested them:
an immutable sandbox with trim_blocks/lstrip_blocks and loop controls, the globals
`raise_exception` and `strftime_now`, a `tojson` filter that keeps key order and non-ASCII
text, and the special tokens `bos_token` / `eos_token` as variables.
A model without a template gets ChatML, and `is_fallback` says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import gguf
import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ott_gguf.errors import InvalidArgumentError, UnsupportedError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """The template itself called raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson sorts keys and HTML-escapes <, >, &, ' — not what a prompt wants.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token texts it may refer to."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self._fallback = not source
        self.source = CHATML_TEMPLATE if self._fallback else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise UnsupportedError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> ChatTemplate:
        """Template and bos/eos texts from GGUF metadata already read (key -> Python value)."""
        source = fields.get("tokenizer.chat_template")
        tokens = fields.get("tokenizer.ggml.tokens", [])

        def token_text(key: str) -> str:
            if key not in fields:
                return ""
            token_id = int(fields[key])
            if not 0 <= token_id < len(tokens):
                raise UnsupportedError(f"GGUF {key} = {token_id} is outside the vocabulary of {len(tokens)} tokens")
            return tokens[token_id]

        return cls(source, token_text("tokenizer.ggml.bos_token_id"), token_text("tokenizer.ggml.eos_token_id"))

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> ChatTemplate:
        """Template and bos/eos texts from an open GGUF file."""
        return cls.from_fields({k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")})

    @property
    def is_fallback(self) -> bool:
        """True when the model has no template and ChatML is used instead."""
        return self._fallback

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role": "system"|"user"|"assistant"|..., "content": str}, ...] -> prompt text."""
        if not isinstance(messages, Sequence) or isinstance(messages, str):
            raise InvalidArgumentError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidArgumentError(f"chat message {i} must be a dict with a string 'role', got {message!r}")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except _TemplateRaised as exc:
            raise InvalidArgumentError(f"chat template rejected the messages: {exc}") from exc
        except SecurityError as exc:
            raise UnsupportedError(f"chat template refused by the sandbox: {exc}") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise InvalidArgumentError(f"chat template failed on the messages: {type(exc).__name__}: {exc}") from exc
