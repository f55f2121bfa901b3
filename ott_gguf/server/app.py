"""HTTP routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, and /health
and /metrics (Prometheus text), as a FastAPI app for uvicorn.

A route validates its body, tokenizes the prompt (in a worker thread of the event loop's
pool) and hands a `Job` to the engine; the engine's events come back through an asyncio
queue and go out as one JSON object or as server-sent events ending with `data: [DONE]`.
A client that disconnects cancels its job. Every error is an OpenAI-style JSON body
{"error": {"message", "type", "param", "code"}}; after a stream has started, a failure is
sent as one event with that body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from ..chat_session import chat_prompt_ids
from ..errors import InvalidArgumentError, OttError
from .engine import Delta, Done, Engine, Failed, Job, Logprob, UnavailableError
from .engine import Request as EngineRequest
from .metrics import StatsCollector
from .schemas import (
    ChatCompletionRequest,
    ChatFormat,
    CompletionRequest,
    GenerationFields,
    ResponseFormat,
    TextFormat,
    error_body,
)

RETRY_AFTER_S = 1
DISCONNECTED = object()  # put on a job's event queue when its client goes away


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.type, self.param, self.code), self.status, self.headers)


def create_app(engine: Engine, model_id: str, collector: StatsCollector, api_key: str | None = None) -> FastAPI:
    """The app serving `engine`'s context as model `model_id`; /health is open, the other
    routes need `Authorization: Bearer <api_key>` when api_key is set."""
    ctx = engine.ctx
    created = int(ctx.path.stat().st_mtime)

    def piece(tok: int) -> bytes:  # a token's text in log probabilities, special tokens' too
        return ctx.tokenizer.token_to_piece(tok, special=True)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await run_in_threadpool(engine.stop)

    app = FastAPI(title="ott-gguf", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    api = APIRouter(dependencies=[Depends(_bearer_check(api_key))] if api_key else [])

    @api.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "ott-gguf"}],
        }

    @api.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body, model_id)
        messages = [m.as_template_input() for m in body.messages]
        prompt = await run_in_threadpool(chat_prompt_ids, ctx, messages)
        return await _respond(engine, body, prompt, ChatFormat(model_id, piece), request)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body, model_id)
        prompt = await run_in_threadpool(_completion_prompt_ids, ctx, body.prompt)
        echo = _prompt_text(ctx, body.prompt, prompt) if body.echo else None
        return await _respond(engine, body, prompt, TextFormat(model_id, piece, echo), request)

    app.include_router(api)
    return app


def _check_model(body: GenerationFields, model_id: str) -> None:
    if body.model is not None and body.model != model_id:
        raise APIError(
            404,
            f"model '{body.model}' is not served here; this server serves '{model_id}'",
            param="model",
            code="model_not_found",
        )


def _completion_prompt_ids(ctx, prompt: str | list[int] | list[str]) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        bad = [t for t in prompt if not 0 <= t < ctx.n_vocab]
        if bad:
            raise APIError(
                400, f"prompt token id {bad[0]} is outside the vocabulary [0, {ctx.n_vocab})", param="prompt"
            )
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) and prompt else prompt or ""
    return ctx.tokenize(text, add_special=True, parse_special=True)


def _prompt_text(ctx, given: str | list[int] | list[str], ids: list[int]) -> str:
    """A completion prompt's text, to echo: as given, or token ids as their text."""
    if isinstance(given, str):
        return given
    return given[0] if given and isinstance(given[0], str) else ctx.detokenize(ids)


def _engine_request(body: GenerationFields, prompt: list[int], n_ctx: int, n_vocab: int) -> EngineRequest:
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(prompt) >= n_ctx:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens but a slot holds {n_ctx}, prompt and reply together",
            param="messages" if hasattr(body, "messages") else "prompt",
            code="context_length_exceeded",
        )
    outside = [tok for tok in body.logit_bias or {} if int(tok) >= n_vocab]
    if outside:
        raise APIError(
            400, f"logit_bias names token {outside[0]}, outside the vocabulary [0, {n_vocab})", param="logit_bias"
        )
    try:
        sampling = body.sampling()
    except InvalidArgumentError as e:
        raise APIError(400, str(e)) from None
    limit = body.token_limit()
    return EngineRequest(
        prompt,
        n_ctx - len(prompt) if limit is None else limit,
        sampling,
        body.stops(),
        body.logprob_count(),
        echo=body.echoes_prompt(),
    )


async def _respond(
    engine: Engine, body: GenerationFields, prompt: list[int], fmt: ResponseFormat, request: Request
) -> Response:
    """Submit the job; stream its events, or wait for them and answer with one object."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = Job(
        _engine_request(body, prompt, engine.ctx.n_ctx, engine.ctx.n_vocab),
        emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
    )
    try:
        engine.submit(job)
    except UnavailableError as e:
        raise APIError(503, str(e), "unavailable_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    watcher = asyncio.create_task(_watch_disconnect(request, events))
    asked = body.logprob_count() is not None
    if body.stream:
        return StreamingResponse(
            _stream(fmt, body.include_usage, asked, len(prompt), events, job, watcher),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        text, logprobs = [], []
        async for event in _until_end(events):
            if isinstance(event, Delta):
                text.append(event.text)
            elif isinstance(event, Logprob):
                logprobs.append(event)
            elif isinstance(event, Done):
                return JSONResponse(
                    fmt.response(
                        "".join(text),
                        event.finish_reason,
                        event.prompt_tokens,
                        event.completion_tokens,
                        logprobs if asked else None,
                    )
                )
            else:
                raise _failure(event)
        return Response(status_code=499)  # the client is gone: nobody reads this
    finally:
        watcher.cancel()
        job.cancel()


async def _stream(
    fmt: ResponseFormat,
    include_usage: bool,
    asked: bool,
    n_prompt: int,
    events: asyncio.Queue,
    job: Job,
    watcher: asyncio.Task,
) -> AsyncIterator[str]:
    """The job's events as server-sent chunks; with `asked`, each text chunk carries the log
    probabilities of the tokens since the last one (a stop scanner may hold text back), the
    closing chunk those left. An echoed prompt (fmt.echo) is the first text chunk, with its
    n_prompt tokens' log probabilities once they have come."""
    try:
        if fmt.opening() is not None:
            yield _sse(fmt.opening())
        echo_left = n_prompt if fmt.echo is not None and asked else 0  # prompt entries still to come
        if fmt.echo is not None and not echo_left:
            yield _sse(fmt.chunk(fmt.echo, logprobs=[] if asked else None))
        pending = []
        async for event in _until_end(events):
            if isinstance(event, Logprob):
                pending.append(event)
                if echo_left:
                    echo_left -= 1
                    if not echo_left:
                        yield _sse(fmt.chunk(fmt.echo, logprobs=pending))
                        pending = []
            elif isinstance(event, Delta):
                yield _sse(fmt.chunk(event.text, logprobs=pending if asked else None))
                pending = []
            elif isinstance(event, Done):
                yield _sse(fmt.chunk(None, event.finish_reason, logprobs=pending if asked and pending else None))
                if include_usage:
                    yield _sse(fmt.usage_chunk(event.prompt_tokens, event.completion_tokens))
                yield "data: [DONE]\n\n"
            else:
                err = _failure(event)
                yield _sse(error_body(str(err), err.type, err.param, err.code))
    finally:
        watcher.cancel()
        job.cancel()


async def _until_end(events: asyncio.Queue) -> AsyncIterator:
    """A job's events through its Done or Failed; ends early when the client disconnects."""
    while True:
        event = await events.get()
        if event is DISCONNECTED:
            return
        yield event
        if isinstance(event, (Done, Failed)):
            return


async def _watch_disconnect(request: Request, events: asyncio.Queue) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    events.put_nowait(DISCONNECTED)


def _failure(event: Failed) -> APIError:
    if isinstance(event.error, UnavailableError):
        return APIError(503, str(event.error), "unavailable_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, f"{type(event.error).__name__}: {event.error}", "server_error")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _bearer_check(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(authorization: str | None = Header(None)) -> None:
        if authorization is None or not hmac.compare_digest(authorization.encode(), expected):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return APIError(
                400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
            ).response()
        where = ".".join(str(p) for p in first["loc"][1:])  # after "body"
        return APIError(400, f"{where or 'body'}: {first['msg']}", param=where or None).response()

    @app.exception_handler(OttError)
    async def ott_error(request, exc: OttError):
        return APIError(400, str(exc)).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return APIError(
            exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error"
        ).response()

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        return APIError(500, f"{type(exc).__name__}: {exc}", "server_error").response()
