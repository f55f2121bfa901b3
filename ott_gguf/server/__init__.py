"""An OpenAI-compatible HTTP server with continuous batching (`python -m ott_gguf serve`).

    capacity.py  how many slots: asked for, or as many as fit a KV memory budget
    engine.py    the worker thread that owns the context: queue, slots, one batch per step
    schemas.py   the OpenAI wire format: request validation, response objects
    stops.py     stop strings in streamed text
    metrics.py   counters and the Prometheus text of /metrics
    app.py       the routes (FastAPI, served by uvicorn)

Needs the `serve` extra: `pip install ott-gguf[serve]`.
"""

from __future__ import annotations

import socket
import sys

from ..errors import InvalidArgumentError
from ..model import Context, Weights
from .capacity import SlotPlan, plan_slots

# prompt tokens a slot feeds in one step at most, and tokens per step (decode tokens first)
DEFAULT_BATCH = 512


def open_slots(
    weights: Weights,
    *,
    kv_config,
    n_ctx: int,
    parallel: int | None,
    kv_memory: int | None,
    batch: int = DEFAULT_BATCH,
    n_threads: int | None = None,
    prefill_fp16: bool = False,
    kv_calib=None,
) -> tuple[Context, SlotPlan]:
    """The slot plan and a context with one sequence per slot, big enough for one step in one graph."""
    plan = plan_slots(weights, kv_config, n_ctx, parallel, kv_memory, batch, prefill_fp16)
    ctx = Context(
        weights,
        n_ctx=n_ctx,
        n_seq_max=plan.n_slots,
        n_ubatch=batch + plan.n_slots,
        n_threads=n_threads,
        kv=kv_config,
        prefill_fp16=prefill_fp16,
        kv_calib=kv_calib,
    )
    return ctx, plan


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: one the system picks); one error line when
    the address does not resolve, is not this machine's or the port is taken."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise InvalidArgumentError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own sockets
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise InvalidArgumentError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(
    ctx: Context,
    plan: SlotPlan,
    *,
    sock: socket.socket,
    model_id: str,
    api_key: str | None,
    max_queue: int,
    batch: int = DEFAULT_BATCH,
    prompt_cache: bool = False,
) -> None:
    """Run the server until interrupted."""
    import uvicorn

    from .app import create_app
    from .engine import Engine
    from .metrics import ServerStats, StatsCollector

    stats = ServerStats()
    engine = Engine(ctx, batch=batch, chunk=batch, max_queue=max_queue, stats=stats, prompt_cache=prompt_cache)
    app = create_app(engine, model_id, StatsCollector(stats, plan, max_queue), api_key)
    print(f"serve: {ctx.path.name} as '{model_id}' on {ctx.info.device}; {plan.reason}", file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if sock.family == socket.AF_INET6 else host
    print(f"serve: listening on http://{url_host}:{port} (OpenAI routes under /v1)", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
