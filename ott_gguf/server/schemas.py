"""The OpenAI wire format: request bodies (validated with pydantic) and response objects.

Requests are validated strictly (a string where a number belongs is an error, not coerced);
fields OpenAI defines that change nothing here (`user`, `metadata` ...) are ignored, and one
that asks for what this server does not return (JSON output) is an error rather than ignored.
Sampling fields a request leaves out take llama.cpp's defaults (`SamplingParams`), as
llama-server does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..sampling import SamplingParams

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat route allows


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class GenerationFields(BaseModel):
    """What /v1/chat/completions and /v1/completions share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    repeat_penalty: float | None = Field(None, gt=0.0)
    repeat_last_n: int | None = Field(None, ge=-1)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias):
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids, got '{key}'")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {value}")
        return bias

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt):
        if fmt is not None and fmt.get("type", "text") != "text":
            raise ValueError(f"only type 'text' is supported (no constrained decoding), got '{fmt.get('type')}'")
        return fmt

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n = 1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stop)}")
        return stop

    def sampling(self) -> SamplingParams:
        given = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "repeat_penalty",
                "repeat_last_n",
                "frequency_penalty",
                "presence_penalty",
            )
            if getattr(self, name) is not None
        }
        bias = {int(tok): value for tok, value in (self.logit_bias or {}).items()}
        return SamplingParams(**given, logit_bias=bias or None)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no log probabilities; N: each token's and its N likeliest alternatives'."""
        return None

    def echoes_prompt(self) -> bool:
        """Whether the reply repeats the prompt first (completions' `echo`)."""
        return False

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        """{"role", "content"} with text parts joined, as chat templates expect; OpenAI's
        `developer` (its newer name for instructions) as `system`, which templates know."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # 0: the sampled tokens' own only
    echo: bool = False  # the prompt's text (and with logprobs its tokens') before the completion
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing

    @model_validator(mode="after")
    def _nothing_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 asks for no tokens, which only echo (the prompt scored) makes useful")
        return self

    def logprob_count(self) -> int | None:
        return self.logprobs

    def echoes_prompt(self) -> bool:
        return self.echo

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError(f"only one prompt per request is supported, got {len(prompt)}")
        return prompt


# ---- responses --------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ResponseFormat:
    """The objects of one response: its id, creation time and model, in chat or text form.
    Log probabilities (engine.Logprob, a list per response or chunk; None: not asked for) name
    tokens by their text, from `piece` (token id -> bytes)."""

    object_name = ""  # the non-streamed object
    chunk_name = ""  # a streamed chunk
    id_prefix = ""

    def __init__(self, model: str, piece: Callable[[int], bytes], echo: str | None = None):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.piece = piece
        self.echo = echo  # the prompt's text, which the response repeats first (completions' echo)
        self.offset = 0  # characters of the response's text so far (the text form's text_offset)

    def _token(self, tok: int) -> tuple[str, bytes]:
        raw = self.piece(tok)
        return raw.decode("utf-8", errors="replace"), raw

    def _envelope(self, name: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def response(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int, logprobs: list | None = None
    ) -> dict:
        text = (self.echo or "") + text
        choice = {"index": 0, **self._whole(text), "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return self._envelope(self.object_name, [choice], usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, text: str | None, finish_reason: str | None = None, logprobs: list | None = None) -> dict:
        """A streamed piece of text (None: the closing chunk with the finish reason) and the log
        probabilities of the tokens generated since the last chunk."""
        choice = {"index": 0, **self._piece(text), "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return self._envelope(self.chunk_name, [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return self._envelope(self.chunk_name, [], usage=usage(prompt_tokens, completion_tokens))

    def opening(self) -> dict | None:
        """The chunk sent before any text, if the format has one."""
        return None

    def _whole(self, text: str) -> dict:
        raise NotImplementedError

    def _piece(self, text: str | None) -> dict:
        raise NotImplementedError

    def _logprobs(self, logprobs: list | None) -> dict | None:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    object_name, chunk_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def opening(self) -> dict:
        return self._envelope(
            self.chunk_name, [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )

    def _whole(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _piece(self, text: str | None) -> dict:
        return {"delta": {} if text is None else {"content": text}}

    def _logprobs(self, logprobs: list | None) -> dict | None:
        """OpenAI's chat form: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        if logprobs is None:
            return None

        def entry(tok: int, lp: float) -> dict:
            text, raw = self._token(tok)
            return {"token": text, "logprob": lp, "bytes": list(raw)}

        return {
            "content": [
                {**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]} for x in logprobs
            ]
        }


class TextFormat(ResponseFormat):
    object_name, chunk_name, id_prefix = "text_completion", "text_completion", "cmpl"

    def _whole(self, text: str) -> dict:
        return {"text": text}

    def _piece(self, text: str | None) -> dict:
        return {"text": text or ""}

    def _logprobs(self, logprobs: list | None) -> dict | None:
        """The completions' form: tokens, token_logprobs, top_logprobs ({text: logprob} per
        token) and text_offset (each token's first character in the response's text)."""
        if logprobs is None:
            return None
        tokens, offsets = [], []
        for x in logprobs:
            tokens.append(self._token(x.token)[0])
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [x.logprob for x in logprobs],  # None: an echoed prompt's first token
            "top_logprobs": [None if x.top is None else {self._token(t)[0]: lp for t, lp in x.top} for x in logprobs],
            "text_offset": offsets,
        }
