"""The OpenAI-compatible server: real server processes on free loopback ports, talked to
with the official `openai` client and, for the error cases, raw HTTP (httpx). Servers run
one thread: on a loaded 2-core machine ggml's spinning thread barriers cost a scheduler
time slice each when the threads outnumber the free cores.

The main server runs SmolLM2 with the 2-bit ott2 cache in 3 slots of 384 tokens (two
quantization events per slot, at 160 and 288 tokens) and a queue of 2. Tests leave it idle.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import APIStatusError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

import ott_gguf
from ott_gguf.model import Context, Weights
from ott_gguf.reference.config import preset
from ott_gguf.sampling import SamplingParams
from ott_gguf.server.capacity import plan_slots
from ott_gguf.server.engine import Delta, Done, Engine, Failed, Job, Request
from ott_gguf.server.stops import StopScanner
from ott_gguf.tokenizer import Tokenizer

# The server process imports the same ott_gguf as this test process (as in test_cli.py).
PACKAGE_ROOT = Path(ott_gguf.__file__).resolve().parent.parent
N_SLOTS, N_CTX, MAX_QUEUE = 3, 384, 2
SYSTEM = (
    "You are a helpful assistant. Answer in full sentences, explain your reasoning step by step, "
    "and mention one related fact the user may find interesting. "
) * 4
GREEDY = {"temperature": 0.0}
COUNTING = "1, 2, 3, 4, 5,"  # greedy SmolLM2 goes on counting: no early end


# ---- server processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, tmp: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "ott_gguf", "serve", str(model), "--port", str(self.port), "-t", "1", *args]
        with open(self.log, "w") as log:
            env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            self.proc = subprocess.Popen(cmd, cwd=PACKAGE_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up: {self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metrics(self, headers=None) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        return {
            f"{s.name}{_labels(s.labels)}": s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["ott_slots_active"] == 0 and m["ott_queue_depth"] == 0:
                return m
            time.sleep(0.2)
        raise AssertionError(f"server still busy after {timeout} s: {m}")


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "reason") + "}" if labels else ""


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    srv = Server(
        smollm2_path,
        tmp_path_factory.mktemp("serve"),
        "--kv",
        "ott2",
        "-c",
        str(N_CTX),
        "--parallel",
        str(N_SLOTS),
        "--max-queue",
        str(MAX_QUEUE),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, text: str, **kw):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        **kw,
    )


# ---- the OpenAI routes --------------------------------------------------------------------------


def test_chat_completion(client):
    r = chat(client, "What is the capital of France?", max_tokens=24, **GREEDY)
    assert r.object == "chat.completion" and r.model == "SmolLM2-135M-Instruct.Q4_1"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 100 and 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_equals_whole_and_counts_usage(client):
    whole = chat(client, "Name three colours.", max_tokens=20, **GREEDY)
    chunks = list(
        chat(
            client, "Name three colours.", max_tokens=20, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_length_and_stop(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=COUNTING, max_tokens=12, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.choices[0].text.startswith(" 6, 7")
    stopped = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=COUNTING, max_tokens=12, stop=[" 8", "never"], **GREEDY
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == r.choices[0].text[: r.choices[0].text.index(" 8")]
    streamed = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=COUNTING, max_tokens=12, stop=" 8", stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text


def test_completion_logprobs_are_the_models(client, smollm2_path):
    """Each generated token's log probability and its likeliest alternatives, streamed or not,
    are the log-softmax of the logits a local context of the same cache computes."""
    r = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=COUNTING, max_tokens=6, logprobs=3, **GREEDY
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == r.usage.completion_tokens == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert list(top)[0] == tok and top[tok] == p <= 0.0  # greedy: the likeliest token
        assert len(top) == 3 and list(top.values()) == sorted(top.values(), reverse=True)

    local = Context(Weights(smollm2_path), n_ctx=N_CTX, kv="ott2", n_threads=1)
    ids = local.tokenize(COUNTING)
    for i in range(len(lp.tokens)):
        x = local.eval(ids).astype(np.float64)
        want = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        top = np.argsort(-want)[:3]
        assert [local.detokenize([t]) for t in top] == list(lp.top_logprobs[i]), i
        assert np.allclose(want[top], list(lp.top_logprobs[i].values()), atol=1e-3), i
        ids = [int(top[0])]

    streamed = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=COUNTING, max_tokens=6, logprobs=3, stream=True, **GREEDY
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
    assert np.allclose(sum((p.token_logprobs for p in parts), []), lp.token_logprobs)


def test_echo_scores_the_prompt(client, smollm2_path):
    """echo with logprobs and no tokens to generate: each prompt token's log probability given
    the ones before it (the first has none), as lm-eval-harness asks for loglikelihoods."""
    text = "The capital of France is Paris. The capital of Italy is Rome."
    r = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=text, max_tokens=0, echo=True, logprobs=1, **GREEDY
    )
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == text and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    local = Context(Weights(smollm2_path), n_ctx=N_CTX, kv="ott2", n_threads=1)
    ids = local.tokenize(text)
    assert len(lp.tokens) == len(ids) == r.usage.prompt_tokens and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    x = local.eval(ids, all_logits=True).astype(np.float64)  # [n, n_vocab]
    want = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    assert np.allclose(lp.token_logprobs[1:], want[np.arange(len(ids) - 1), ids[1:]], atol=1e-3)
    assert lp.token_logprobs[-1] > -1.0  # "Rome" after "The capital of Italy is": likely

    streamed = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=text, max_tokens=3, echo=True, logprobs=0, stream=True, **GREEDY
    )
    chunks = [c.choices[0] for c in streamed]
    assert chunks[0].text == text and len(chunks[0].logprobs.tokens) == len(ids)
    whole = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=text, max_tokens=3, **GREEDY)
    assert "".join(c.text for c in chunks) == text + whole.choices[0].text
    assert sum(len(c.logprobs.tokens) for c in chunks if c.logprobs) == len(ids) + 3
    plain = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=text, max_tokens=3, echo=True, **GREEDY
    )
    assert plain.choices[0].text == text + whole.choices[0].text and plain.choices[0].logprobs is None


def test_chat_logprobs(client):
    r = chat(client, "Count from 1 to 20.", max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content and len(content) == 8
    for e in content:
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0.0
        assert [t.token for t in e.top_logprobs][0] == e.token and len(e.top_logprobs) == 2
    assert chat(client, "Count from 1 to 20.", max_tokens=2, **GREEDY).choices[0].logprobs is None


def test_seeded_sampling_repeats(client):
    kw = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": 7, "extra_body": {"top_k": 0, "min_p": 0.0}}
    a, b = (chat(client, "Tell me a story.", **kw).choices[0].message.content for _ in range(2))
    assert a == b
    others = {chat(client, "Tell me a story.", **{**kw, "seed": s}).choices[0].message.content for s in (8, 9, 10)}
    assert len(others | {a}) > 1


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


# ---- continuous batching ------------------------------------------------------------------------


def test_greedy_output_does_not_depend_on_the_batch(server, client):
    """A request served alone and the same request while others run (generating, reading
    their prompts in chunks, sampling) give the same greedy text. Its prompt (~190 tokens)
    and reply cross the cache's quantization event at 288 tokens."""
    question = "Explain how a refrigerator keeps food cold."
    alone = chat(client, question, max_tokens=110, **GREEDY).choices[0].message.content
    server.wait_idle()

    started = threading.Barrier(3)
    results = {}

    def other(name, text, **kw):
        stream = chat(client, text, stream=True, **kw)
        first = True
        parts = []
        for c in stream:
            if first:
                started.wait(timeout=60)
                first = False
            parts.append(c.choices[0].delta.content or "")
        results[name] = "".join(parts)

    threads = [
        threading.Thread(
            target=other,
            args=("a", "Write a poem about the sea."),
            kwargs={"max_tokens": 150, "temperature": 0.9, "seed": 1},
        ),
        threading.Thread(
            target=other, args=("b", "List ten animals and describe each one."), kwargs={"max_tokens": 150, **GREEDY}
        ),
    ]
    for t in threads:
        t.start()
    started.wait(timeout=60)  # both others are generating
    busy = chat(client, question, max_tokens=110, **GREEDY).choices[0].message.content
    for t in threads:
        t.join(timeout=300)
    assert busy == alone
    assert len(results) == 2
    server.wait_idle()


def test_disconnect_cancels_and_frees_the_slot(server):
    before = server.wait_idle()['ott_requests_total{outcome="cancelled"}']
    body = {"prompt": COUNTING, "max_tokens": 300, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the response
        assert next(line for line in lines if line.startswith("data:"))
        assert server.metrics()["ott_slots_active"] == 1
    # a request that is not streamed: the client gives up before the reply
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.5)
    m = server.wait_idle(timeout=20)
    assert m['ott_requests_total{outcome="cancelled"}'] == before + 2
    assert m["ott_kv_bytes_used"] == 0


def test_full_queue_answers_503_with_retry_after(server):
    server.wait_idle()

    async def flood():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            body = {"prompt": COUNTING, "max_tokens": 300, **GREEDY}
            running = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(N_SLOTS + MAX_QUEUE)]
            deadline = time.monotonic() + 30
            while (m := server.metrics())["ott_slots_active"] < N_SLOTS or m["ott_queue_depth"] < MAX_QUEUE:
                assert time.monotonic() < deadline, m
                await asyncio.sleep(0.1)
            refused = await http.post("/v1/completions", json=body)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return refused

    refused = asyncio.run(flood())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "unavailable_error"
    m = server.wait_idle()
    assert m['ott_requests_total{outcome="rejected"}'] >= 1


# ---- bad requests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({"model": "SmolLM2-135M-Instruct.Q4_1"}, 400, "messages"),
        ({"messages": "hello"}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 200}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "word " * 500}]}, 400, "messages"),
    ],
)
def test_bad_chat_requests_get_openai_errors(server, body, status, param):
    kw = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == param


def test_bad_completion_requests_and_routes(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 10**7]}, timeout=30)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x " * 400}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b"]}, timeout=30)
    assert r.status_code == 400
    for extra, param in (({"max_tokens": 0}, None), ({"logprobs": 21}, "logprobs")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.get(server.url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def test_logit_bias_bans_and_forces_tokens(server, smollm2_path):
    tok = Tokenizer.from_gguf(smollm2_path)

    def first_token(**extra) -> int:
        body = {"prompt": COUNTING, "max_tokens": 1, **GREEDY, **extra}
        text = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        ids = tok.encode(text, add_special=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    greedy = first_token()
    banned = first_token(logit_bias={str(greedy): -100})
    assert banned != greedy
    forced = tok.encode(" seven", add_special=False)[0]
    assert first_token(logit_bias={str(forced): 100}) == forced


def test_server_survives_bad_requests(server, client):
    assert chat(client, "Say hello.", max_tokens=8, **GREEDY).choices[0].message.content


# ---- metrics ------------------------------------------------------------------------------------


def test_metrics_while_a_request_runs(server, client, smollm2_path):
    before = server.wait_idle()
    body = {"prompt": COUNTING, "max_tokens": 300, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the response
        assert next(line for line in lines if line.startswith("data:"))
        live = server.metrics()
    assert live["ott_slots_active"] == 1 and live["ott_kv_bytes_used"] > 0
    assert live["ott_kv_bytes_allocated"] >= live["ott_kv_bytes_used"]
    assert 0 < live["ott_kv_bits_per_element"] <= 16
    mid = server.wait_idle()
    assert mid['ott_requests_total{outcome="cancelled"}'] == before['ott_requests_total{outcome="cancelled"}'] + 1

    r = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=COUNTING, max_tokens=12, **GREEDY)
    after = server.wait_idle()
    assert after['ott_requests_total{outcome="length"}'] == mid['ott_requests_total{outcome="length"}'] + 1
    assert after["ott_prompt_tokens_total"] - mid["ott_prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["ott_generated_tokens_total"] - mid["ott_generated_tokens_total"] == r.usage.completion_tokens
    assert after["ott_generated_tokens_per_second"] > 0
    assert after["ott_slots"] == N_SLOTS and after["ott_slot_context_tokens"] == N_CTX
    assert after["ott_queue_capacity"] == MAX_QUEUE
    weights = Weights(smollm2_path)
    full = weights.kv_footprint("ott2", N_CTX)
    assert after["ott_kv_slot_bytes"] == weights.kv_seq_bytes("ott2", N_CTX, 512) > full.total_bytes
    assert after["ott_kv_slot_bits_per_element"] == pytest.approx(full.bits_per_element)
    assert 'ott_slots_info{kv="ott2",reason="3 slots as asked' in httpx.get(server.url + "/metrics").text


# ---- a second server: slots from a memory budget, an API key ----------------------------------


def test_auto_slots_and_api_key(smollm2_path, tmp_path):
    budget, n_ctx = 48 * 2**20, 2048
    weights = Weights(smollm2_path)
    want = plan_slots(weights, preset("ott2"), n_ctx, None, budget)
    srv = Server(
        smollm2_path,
        tmp_path,
        "--kv",
        "ott2",
        "-c",
        str(n_ctx),
        "--parallel",
        "auto",
        "--kv-memory",
        "48MiB",
        "--api-key",
        "s3cret",
        "-b",
        "64",
    )
    try:
        startup = srv.log.read_text()
        assert f"{want.n_slots} slots fit the KV budget of 48.0 MiB" in startup
        assert f"an f16 cache would fit {want.f16_slots})" in startup
        assert want.n_slots > 2 * want.f16_slots
        assert httpx.get(srv.url + "/health").status_code == 200
        denied = httpx.get(srv.url + "/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        m = srv.metrics(headers={"Authorization": "Bearer s3cret"})
        assert m["ott_slots"] == want.n_slots and m["ott_kv_memory_budget_bytes"] == budget
        assert m["ott_kv_f16_slots"] == want.f16_slots
        keyed = OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0, timeout=120)
        # a prompt longer than a step's 64 tokens is read in several chunks
        r = chat(keyed, "What is the capital of France?", max_tokens=16, **GREEDY)
        assert "Paris" in r.choices[0].message.content
        with pytest.raises(APIStatusError) as err:
            chat(OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0), "hi", max_tokens=4)
        assert err.value.status_code == 401
    finally:
        srv.stop()


def test_slot_plan_errors(smollm2_path):
    weights = Weights(smollm2_path)
    per_slot = weights.kv_seq_bytes("f16", 1024)
    assert plan_slots(weights, preset("f16"), 1024, None, 3 * per_slot + 1).n_slots == 3
    with pytest.raises(ValueError, match="holds no slot"):
        plan_slots(weights, preset("f16"), 1024, None, per_slot - 1)
    with pytest.raises(ValueError, match="more than the budget"):
        plan_slots(weights, preset("f16"), 1024, 4, 3 * per_slot)


# ---- the engine in process ----------------------------------------------------------------------


def run_jobs(engine: Engine, requests: list[Request], emit_wrappers=None) -> list[list]:
    """Submit every request, wait for each to end; the events each got."""
    events = [[] for _ in requests]
    ended = [threading.Event() for _ in requests]

    def emitter(i):
        def emit(event):
            if emit_wrappers and emit_wrappers[i]:
                emit_wrappers[i](event)
            events[i].append(event)
            if isinstance(event, (Done, Failed)):
                ended[i].set()

        return emit

    for i, r in enumerate(requests):
        engine.submit(Job(r, emitter(i)))
    for e in ended:
        assert e.wait(timeout=120)
    return events


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def test_a_failing_request_fails_alone(smollm2_path):
    """An exception while serving one request (here: its consumer raises on the first piece
    of text) fails that request only; the others finish as they would alone."""
    ctx = Context(Weights(smollm2_path, device="cpu"), n_ctx=256, n_seq_max=3, n_ubatch=64 + 3, n_threads=1)
    engine = Engine(ctx, batch=64, chunk=64, max_queue=4)
    engine.start()
    try:
        greedy = SamplingParams(temperature=0)
        reqs = [Request(ctx.tokenize(p), 20, greedy) for p in ("The sky is", "Water boils at", "One plus one is")]
        alone = [text_of(run_jobs(engine, [r])[0]) for r in reqs]

        def explode(event):
            if isinstance(event, Delta):
                raise RuntimeError("consumer failed")

        together = run_jobs(engine, reqs, [None, explode, None])
        assert isinstance(together[1][-1], Failed) and "consumer failed" in str(together[1][-1].error)
        assert [text_of(together[0]), text_of(together[2])] == [alone[0], alone[2]]
        assert all(isinstance(ev[-1], Done) for ev in (together[0], together[2]))
        assert engine.stats.requests["error"] == 1
        assert ctx.kv_stats().n_tokens == 0  # every slot freed (without prompt_cache, emptied)
    finally:
        engine.stop()


def read_and_generate(ctx: Context, tokens: list[int], n_keep: int, n_gen: int) -> list[int]:
    """What the engine does for one request on sequence 0 alone: cut the cache back to n_keep
    tokens, read the rest of the prompt in chunks of at most 64 ending at the cache's events,
    then n_gen greedy tokens (each fed but the last); the generated ids."""
    ctx.truncate(0, n_keep)
    i = n_keep
    while i < len(tokens):
        n = min(len(tokens) - i, 64, ctx.tokens_until_event(0) or 64)
        logits = ctx.eval(tokens[i : i + n])
        i += n
    out = [int(np.argmax(logits))]
    while len(out) < n_gen and not ctx.tokenizer.is_eog(out[-1]):
        out.append(int(np.argmax(ctx.eval([out[-1]]))))
    return [t for t in out if not ctx.tokenizer.is_eog(t)]


@pytest.mark.parametrize("kv", ["f16", "ott2"])
def test_prompt_cache_reads_only_what_a_free_slot_lacks(smollm2_path, kv):
    """A chat's next turn resends the conversation: with prompt_cache the slot that served the
    first turn keeps its tokens and the next request reads only what is new, exactly as a
    context that keeps them and reads the rest. A prompt that leaves a long one inside ott2's
    quantized blocks reads everything again; without prompt_cache nothing is reused."""
    weights = Weights(smollm2_path, device="cpu")
    greedy = SamplingParams(temperature=0)

    def context() -> Context:
        return Context(weights, n_ctx=512, n_seq_max=2, n_ubatch=64 + 2, n_threads=1, kv=kv)

    def serve(requests: list[Request], prompt_cache: bool = True) -> tuple[list[str], int]:
        """One after another on a fresh engine: the answers, and the prompt tokens reused."""
        engine = Engine(context(), batch=64, chunk=64, max_queue=4, prompt_cache=prompt_cache)
        engine.start()
        try:
            texts = [text_of(run_jobs(engine, [r])[0]) for r in requests]
        finally:
            engine.stop()
        assert engine.stats.prompt_tokens + engine.stats.prompt_tokens_cached == sum(len(r.prompt) for r in requests)
        return texts, engine.stats.prompt_tokens_cached

    tok = weights.tokenize
    first = tok("The sky is")
    ctx = context()
    answer = read_and_generate(ctx, first, 0, 24)
    n_held = ctx.seq_len(0)  # the prompt and the reply but its last token, which was not fed
    second = first + answer[: n_held - len(first)] + tok(" And the sea is", add_special=False)
    want = [weights.detokenize(answer), weights.detokenize(read_and_generate(ctx, second, n_held, 24))]
    assert serve([Request(first, 24, greedy), Request(second, 24, greedy)]) == (want, n_held)
    assert serve([Request(first, 24, greedy), Request(second, 24, greedy)], prompt_cache=False)[1] == 0

    long = tok(" ".join(["The history of the river is long and full of turns."] * 30))[:300]
    other = long[:10] + tok(" Something else entirely.", add_special=False)
    n_keep = 10 if kv == "f16" else 0  # ott2 quantized the first 256 tokens of `long`
    read_and_generate(ctx, long, 0, 8)
    want = [weights.detokenize(read_and_generate(ctx, other, n_keep, 8))]
    texts, n_cached = serve([Request(long, 8, greedy), Request(other, 8, greedy)])
    assert (texts[1:], n_cached) == (want, n_keep)


@pytest.mark.parametrize(
    "pieces, stops, shown, stopped",
    [
        (["Hello", " wor", "ld"], [], "Hello world", False),
        (["Hello", " wor", "ld"], ["world"], "Hello ", True),
        (["a<", "|e", "nd|>b"], ["<|end|>"], "a", True),
        (["a<", "|x"], ["<|end|>"], "a<|x", False),  # a false start is released
        (["ab", "c"], ["bc", "abx"], "a", True),  # the earliest stop wins
    ],
)
def test_stop_scanner(pieces, stops, shown, stopped):
    scanner = StopScanner(stops)
    out = "".join(scanner.feed(p) for p in pieces)
    if not scanner.stopped:
        out += scanner.flush()
    assert (out, scanner.stopped) == (shown, stopped)
