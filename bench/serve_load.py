"""Load test of the server (issue "Serving"): concurrent streaming clients for a fixed time,
ours side by side with llama-server on the same model and prompts.

For each server in turn (ours with each --kv mode, then `llama-server --parallel N -cb` when
its binary is given), and for each client count:
1. start it on a free loopback port with one slot per client;
2. send each prompt once alone (greedy): the reference answers;
3. run N clients for --duration seconds, each streaming chat completions of the prompts in
   turn (greedy, stream_options.include_usage), and let the last requests finish;
4. report failed requests, responses that differ from the reference, generated tokens/s
   summed over all clients, time to first token (median, p95) and the server's RSS after
   the reference answers, a fifth of the way into the load (all slots in use) and at the end.
The table of the runs so far is printed after every run, so a long series reports as it goes.

    python bench/serve_load.py MODEL --clients 64 --duration 300 --kv f16,ott2 -t 2 \
        --llama-server ../peers/llamacpp/build/bin/llama-server
    # CUDA build, H200: --device cuda --clients 64,256 --llama-args="-ngl 99"
    # our server's prompt cache: --ours-args=--prompt-cache

Our server is `python -m ott_gguf serve` run from the current folder: run this script from
outside the checkout to use the installed package, or from the checkout with OTT_NATIVE_DIR
pointing at a build. Traffic stays on 127.0.0.1; every loop is bounded by --duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TOPICS = [
    "the ocean",
    "volcanoes",
    "bread",
    "the moon",
    "bicycles",
    "honeybees",
    "chess",
    "rain",
    "libraries",
    "glaciers",
    "coffee",
    "owls",
    "bridges",
    "deserts",
    "music",
    "trains",
    "forests",
    "clocks",
    "salt",
    "lighthouses",
    "mountains",
    "paper",
    "whales",
    "gardens",
    "electricity",
    "castles",
    "rivers",
    "maps",
    "snow",
    "tea",
    "ants",
    "the wind",
]
PROMPTS = [f"Write two sentences about {t}." for t in TOPICS]


@dataclass
class Result:
    prompt: int
    ok: bool
    text: str = ""
    completion_tokens: int = 0
    ttft: float | None = None  # seconds to the first piece of text
    error: str = ""


@dataclass
class Run:
    server: str
    clients: int
    command: str
    results: list[Result] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rss_start_mib: float = 0.0  # after the answers alone
    rss_warm_mib: float = 0.0  # a fifth of the way into the load
    rss_end_mib: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def server_command(args, kind: str, clients: int, port: int) -> list[str]:
    if kind == "llama-server":
        return [
            args.llama_server,
            "-m",
            str(args.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--parallel",
            str(clients),
            "-cb",
            "-c",
            str(clients * args.ctx),
            "-t",
            str(args.threads),
            *args.llama_args.split(),
        ]
    cmd = [
        sys.executable,
        "-m",
        "ott_gguf",
        "serve",
        str(args.model),
        "--port",
        str(port),
        "--parallel",
        str(clients),
        "-c",
        str(args.ctx),
        "--kv",
        kind,
        "-t",
        str(args.threads),
        "--max-queue",
        str(clients),
        *args.ours_args.split(),
    ]
    return cmd + (["--device", args.device] if args.device else [])


def start(cmd: list[str], url: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not come up in 600 s")


async def chat(http: httpx.AsyncClient, prompt: int, max_tokens: int) -> Result:
    body = {
        "messages": [{"role": "user", "content": PROMPTS[prompt]}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    result = Result(prompt, ok=False)
    pieces, n_chunks, finished, done = [], 0, False, False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if result.ttft is None:
                            result.ttft = time.perf_counter() - t0
                        pieces.append(text)
                        n_chunks += 1
                    finished |= choice.get("finish_reason") is not None
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.text = "".join(pieces)
    result.completion_tokens = result.completion_tokens or n_chunks
    result.ok = finished and done
    if not result.ok:
        result.error = "stream ended without a finish reason and [DONE]"
    return result


async def load(url: str, clients: int, duration: float, max_tokens: int, pid: int) -> tuple[list[Result], float, float]:
    """`clients` clients, each sending the prompts in turn until `duration` has passed;
    results, seconds until the last one ended, and the server's RSS a fifth of the way in."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as http:
        t0 = time.perf_counter()
        deadline = t0 + duration

        async def client(i: int) -> list[Result]:
            out, k = [], i
            while time.perf_counter() < deadline:
                out.append(await chat(http, k % len(PROMPTS), max_tokens))
                k += clients
            return out

        async def warm_rss() -> float:
            await asyncio.sleep(duration / 5)
            return rss_mib(pid)

        rss, *per_client = await asyncio.gather(warm_rss(), *(client(i) for i in range(clients)))
        return [r for rs in per_client for r in rs], time.perf_counter() - t0, rss


async def references(url: str, max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as http:
        out = []
        for i in range(len(PROMPTS)):
            r = await chat(http, i, max_tokens)
            if not r.ok:
                raise RuntimeError(f"reference answer {i} failed: {r.error}")
            out.append(r.text)
        return out


def run_one(args, kind: str, clients: int, log_dir: Path) -> Run:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(args, kind, clients, port)
    name = "llama-server f16" if kind == "llama-server" else f"ott-gguf {kind}"
    print(f"== {name}, {clients} clients: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = start(cmd, url, log_dir / f"{kind}-{clients}.log")
    run = Run(name, clients, " ".join(cmd))
    try:
        run.reference = asyncio.run(references(url, args.max_tokens))
        run.rss_start_mib = rss_mib(proc.pid)
        run.results, run.seconds, run.rss_warm_mib = asyncio.run(
            load(url, clients, args.duration, args.max_tokens, proc.pid)
        )
        run.rss_end_mib = rss_mib(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return run


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def tokens_per_s(run: Run) -> float:
    """Generated tokens of the successful requests per second of the run, all clients together."""
    return sum(r.completion_tokens for r in run.results if r.ok) / run.seconds


def report(runs: list[Run], args) -> None:
    print(
        f"\nmodel {args.model.name}, {args.duration:.0f} s per run, chat prompts of {len(PROMPTS)} topics, "
        f"greedy, max_tokens {args.max_tokens}, {args.ctx} tokens per slot, {args.threads} threads\n"
    )
    print(
        "| server | clients | requests | failed | differ from alone | generated tok/s | TTFT median s "
        "| TTFT p95 s | RSS start MiB | RSS at 1/5 MiB | RSS end MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        ok = [r for r in run.results if r.ok]
        differ = sum(r.text != run.reference[r.prompt] for r in ok)
        ttft = [r.ttft for r in ok if r.ttft is not None]  # none when no answer had visible text
        median, p95 = (f"{statistics.median(ttft):.3f}", f"{percentile(ttft, 0.95):.3f}") if ttft else ("-", "-")
        print(
            f"| {run.server} | {run.clients} | {len(run.results)} | {len(run.results) - len(ok)} | {differ} "
            f"| {tokens_per_s(run):.1f} | {median} | {p95} "
            f"| {run.rss_start_mib:.0f} | {run.rss_warm_mib:.0f} | {run.rss_end_mib:.0f} |"
        )
    base = {r.clients: r for r in runs if r.server.startswith("llama-server")}
    for run in runs:
        ref = base.get(run.clients)
        if ref is not None and run is not ref:
            print(
                f"\n{run.server} / llama-server at {run.clients} clients: generated tok/s "
                f"{tokens_per_s(run) / tokens_per_s(ref):.2f}x"
            )
    for run in runs:
        errors = sorted({r.error for r in run.results if not r.ok})
        if errors:
            print(f"\n{run.server} errors: {errors[:5]}")
        print(f"\n{run.server}: {run.command}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="GGUF file")
    ap.add_argument("--clients", default="64", help="comma-separated client counts (default 64)")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load per run (default 300)")
    ap.add_argument("--kv", default="f16,ott2", help="our KV modes, comma-separated; '' for none")
    ap.add_argument("-c", "--ctx", type=int, default=512, help="tokens per slot (default 512)")
    ap.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens per answer at most (default 64)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count(), help="server threads (both servers)")
    ap.add_argument("--device", help="our device: cpu, cuda, cuda:N")
    ap.add_argument("--llama-server", help="llama-server binary; omitted: ours only")
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments, with '=': --llama-args='-ngl 99'")
    ap.add_argument(
        "--ours-args", default="", help="extra arguments of our server, with '=': --ours-args=--prompt-cache"
    )
    ap.add_argument(
        "--logs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "serve_load_logs",
        help="folder for the servers' logs (default: serve_load_logs in the temp folder)",
    )
    args = ap.parse_args()

    args.logs.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in args.kv.split(",") if k] + (["llama-server"] if args.llama_server else [])
    runs = []
    for n in args.clients.split(","):
        for kind in kinds:
            runs.append(run_one(args, kind, int(n), args.logs))
            report(runs, args)  # after every run: a long series reports as it goes
            sys.stdout.flush()


if __name__ == "__main__":
    main()
