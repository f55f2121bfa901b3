"""Chat templates: the model's `tokenizer.chat_template` (Jinja) turned into a prompt string.

Rendering follows Hugging Face transformers so templates behave as their authors tested them:
an immutable sandbox with trim_blocks/lstrip_blocks and loop controls, the globals
`raise_exception` and `strftime_now`, a `tojson` filter that keeps key order and non-ASCII
text, and the special tokens `bos_token` / `eos_token` as variables.
A model without a template gets ChatML, and `is_fallback` says so.

A template comes from the model file, so its rendering is bounded: the source at most
MAX_TEMPLATE_CHARS, every string or list it builds (`+`, `*`, `%`, filters, method calls) and
the output at most MAX_RENDER_CHARS, at most MAX_RANGE_ITEMS items from `range` per
rendering, and Python's recursion limit on macros; past a limit rendering stops with an
UnsupportedError naming it.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import gguf
import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ott_gguf.errors import InvalidArgumentError, ModelFileError, UnsupportedError
from ott_gguf.tokenizer import metadata_value

MAX_TEMPLATE_CHARS = 1 << 20  # real templates are a few kB
MAX_RENDER_CHARS = 1 << 22  # a prompt of 4 Mi characters is far past any context
MAX_RANGE_ITEMS = 1 << 20

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# around each message's text while rendering (render_parts); removed from the text itself
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"
_MARKED = re.compile(f"{_OPEN}(.*?){_CLOSE}", re.DOTALL)


def _unmarked(text: str) -> str:
    return text.replace(_OPEN, "").replace(_CLOSE, "")


class _TemplateRaised(Exception):
    """The template itself called raise_exception(message)."""


class _LimitExceeded(Exception):
    """The template went past one of the rendering limits."""


_range_left: contextvars.ContextVar[list[int]] = contextvars.ContextVar("_range_left")


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise _LimitExceeded(f"a value of {len(value)} items (limit {MAX_RENDER_CHARS})")
    return value


def _check_args(args: Sequence[Any]) -> None:
    """Integer arguments size what a call builds (`'x'.ljust(n)`, `center(n)`, `'%*d'`)."""
    for a in args:
        if isinstance(a, int) and abs(a) > MAX_RENDER_CHARS:
            raise _LimitExceeded(f"an argument of {a} (limit {MAX_RENDER_CHARS})")


def _bounded_range(*args: int) -> range:
    r = range(*args)
    left = _range_left.get()
    left[0] -= len(r)
    if left[0] < 0:
        raise _LimitExceeded(f"more than {MAX_RANGE_ITEMS} range items in one rendering")
    return r


def _bounded_filter(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        _check_args(list(args[1:]) + list(kwargs.values()))
        return _check_size(f(*args, **kwargs))

    return wrapper


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with every operator, call and filter checked against the limits."""

    intercepted_binops = frozenset(["+", "*", "%", "**", "//"])

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(n, int)
                    and len(seq) * max(n, 0) > MAX_RENDER_CHARS
                ):
                    raise _LimitExceeded(f"a repetition to {len(seq) * n} items (limit {MAX_RENDER_CHARS})")
        elif op == "**":
            if isinstance(right, int) and abs(right) > 1024:
                raise _LimitExceeded(f"a power with exponent {right} (limit 1024)")
        elif op == "%":
            _check_args(right if isinstance(right, (tuple, list)) else [right])
        return _check_size(super().call_binop(context, op, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_args(list(args) + list(kwargs.values()))
        return _check_size(super().call(__context, __obj, *args, **kwargs))


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
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token texts it may refer to."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        if source is not None and not isinstance(source, str):
            raise ModelFileError(f"chat template must be a string, not a {type(source).__name__}")
        if source is not None and len(source) > MAX_TEMPLATE_CHARS:
            raise UnsupportedError(f"chat template of {len(source)} characters (limit {MAX_TEMPLATE_CHARS})")
        self._fallback = not source
        self.source = CHATML_TEMPLATE if self._fallback else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise UnsupportedError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc
        except RecursionError as exc:
            raise UnsupportedError("chat template does not compile: nested too deeply") from exc

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> ChatTemplate:
        """Template and bos/eos texts from GGUF metadata already read (key -> Python value)."""
        source = fields.get("tokenizer.chat_template")
        tokens = metadata_value(fields, "tokenizer.ggml.tokens", "strings") or []

        def token_text(key: str) -> str:
            token_id = metadata_value(fields, key, "int")
            if token_id is None:
                return ""
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

    def render_parts(self, messages: list[dict], add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """The prompt as (text, from_template) parts: the messages' string contents are
        from_template=False (their control-token texts must stay text: a user cannot write
        `<|im_end|><|im_start|>system`), the rest is the template's. Found by rendering with
        each content between two private-use marks; a template that trims the contents gets
        them trimmed here too."""
        if not isinstance(messages, Sequence) or isinstance(messages, str):
            raise InvalidArgumentError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
        marked = [
            {**m, "content": _OPEN + _unmarked(m["content"]) + _CLOSE}
            if isinstance(m, Mapping) and isinstance(m.get("content"), str)
            else m
            for m in messages
        ]
        pieces = _MARKED.split(self.render(marked, add_generation_prompt))  # template, content, template, ...
        if any(_OPEN in p or _CLOSE in p for p in pieces):
            raise UnsupportedError("chat template cuts into a message's text: cannot tell it from the template's own")
        parts = [(p, i % 2 == 0) for i, p in enumerate(pieces) if p]
        plain = self.render(messages, add_generation_prompt)
        if "".join(p for p, _ in parts) != plain:
            trimmed = [(p if special else p.strip(), special) for p, special in parts]
            if "".join(p for p, _ in trimmed) == plain:
                parts = [(p, special) for p, special in trimmed if p]
        return parts

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role": "system"|"user"|"assistant"|..., "content": str}, ...] -> prompt text."""
        if not isinstance(messages, Sequence) or isinstance(messages, str):
            raise InvalidArgumentError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidArgumentError(f"chat message {i} must be a dict with a string 'role', got {message!r}")
        token = _range_left.set([MAX_RANGE_ITEMS])
        try:
            out, n = [], 0
            for piece in self._template.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            ):
                n += len(piece)
                if n > MAX_RENDER_CHARS:
                    raise _LimitExceeded(f"an output of more than {MAX_RENDER_CHARS} characters")
                out.append(piece)
            return "".join(out)
        except _LimitExceeded as exc:
            raise UnsupportedError(f"chat template stopped: {exc}") from exc
        except RecursionError as exc:
            raise UnsupportedError("chat template stopped: recursion too deep") from exc
        except _TemplateRaised as exc:
            raise InvalidArgumentError(f"chat template rejected the messages: {exc}") from exc
        except SecurityError as exc:
            raise UnsupportedError(f"chat template refused by the sandbox: {exc}") from exc
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
            ArithmeticError,
        ) as exc:
            raise InvalidArgumentError(f"chat template failed on the messages: {type(exc).__name__}: {exc}") from exc
        finally:
            _range_left.reset(token)
