"""What the server counts, and its Prometheus text for GET /metrics.

The engine's worker records each step and each request's end in `ServerStats` (thread-safe);
`StatsCollector` turns a snapshot into metric families when Prometheus scrapes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from .capacity import SlotPlan

RATE_WINDOW_S = 10.0  # tokens/s gauges average over the last this many seconds
OUTCOMES = ("stop", "length", "cancelled", "error", "rejected")


@dataclass(frozen=True)
class KVUse:
    bytes_used: int
    bytes_allocated: int
    bits_per_element: float  # of the tokens held now (0 when empty)


class ServerStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = Counter()  # outcome -> requests
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0  # prompt tokens a slot's cache already held
        self.generated_tokens = 0
        self.queue_depth = 0
        self.active_slots = 0
        self.kv = KVUse(0, 0, 0.0)
        self._steps: deque = deque()  # (time, prompt tokens, generated tokens) per step

    def record_step(self, n_prompt: int, n_generated: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.prompt_tokens += n_prompt
            self.generated_tokens += n_generated
            self._steps.append((now, n_prompt, n_generated))
            while self._steps and self._steps[0][0] < now - RATE_WINDOW_S:
                self._steps.popleft()

    def record_cached(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens_cached += n

    def record_request(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def record_load(self, queue_depth: int, active_slots: int, kv: KVUse | None = None) -> None:
        with self._lock:
            self.queue_depth, self.active_slots = queue_depth, active_slots
            if kv is not None:
                self.kv = kv

    def rates(self) -> tuple[float, float]:
        """Prompt and generated tokens per second over the last RATE_WINDOW_S seconds."""
        with self._lock:
            recent = [s for s in self._steps if s[0] >= time.monotonic() - RATE_WINDOW_S]
        return (sum(s[1] for s in recent) / RATE_WINDOW_S, sum(s[2] for s in recent) / RATE_WINDOW_S)


class StatsCollector:
    """A prometheus_client collector over the server's stats and slot plan."""

    def __init__(self, stats: ServerStats, plan: SlotPlan, queue_capacity: int):
        self.stats, self.plan, self.queue_capacity = stats, plan, queue_capacity

    def collect(self):
        s, plan = self.stats, self.plan
        prompt_rate, gen_rate = s.rates()
        requests = CounterMetricFamily("ott_requests", "Finished requests by outcome", labels=["outcome"])
        for outcome in OUTCOMES:
            requests.add_metric([outcome], s.requests[outcome])
        yield requests
        yield CounterMetricFamily("ott_prompt_tokens", "Prompt tokens processed", value=s.prompt_tokens)
        yield CounterMetricFamily(
            "ott_prompt_tokens_cached", "Prompt tokens a slot's cache already held", value=s.prompt_tokens_cached
        )
        yield CounterMetricFamily("ott_generated_tokens", "Tokens generated", value=s.generated_tokens)
        yield _gauge("ott_prompt_tokens_per_second", f"Prompt tokens/s over the last {RATE_WINDOW_S:g} s", prompt_rate)
        yield _gauge(
            "ott_generated_tokens_per_second", f"Generated tokens/s over the last {RATE_WINDOW_S:g} s", gen_rate
        )
        yield _gauge("ott_queue_depth", "Requests waiting for a slot", s.queue_depth)
        yield _gauge("ott_queue_capacity", "Requests that may wait before new ones get 503", self.queue_capacity)
        yield _gauge("ott_slots_active", "Slots serving a request", s.active_slots)
        yield _gauge("ott_slots", "Slots (sequences decoded together)", plan.n_slots)
        yield _gauge("ott_slot_context_tokens", "Tokens one slot holds", plan.n_ctx)
        yield _gauge("ott_kv_bytes_used", "KV cache bytes holding live tokens", s.kv.bytes_used)
        yield _gauge("ott_kv_bytes_allocated", "KV cache bytes allocated", s.kv.bytes_allocated)
        yield _gauge(
            "ott_kv_bits_per_element",
            "Average bits per K/V element of the live tokens (0 when empty)",
            s.kv.bits_per_element,
        )
        yield _gauge("ott_kv_slot_bytes", "KV bytes allocated for one slot, at most", plan.bytes_per_slot)
        yield _gauge(
            "ott_kv_slot_bits_per_element", "Average bits per K/V element of one full slot", plan.bits_per_element
        )
        if plan.kv_memory is not None:
            yield _gauge("ott_kv_memory_budget_bytes", "KV memory budget the slots were chosen for", plan.kv_memory)
        if plan.f16_slots is not None:
            yield _gauge("ott_kv_f16_slots", "Slots an f16 cache would fit in the same budget", plan.f16_slots)
        info = InfoMetricFamily("ott_slots", "How the slot count was chosen")
        info.add_metric([], {"kv": plan.kv, "reason": plan.reason})
        yield info


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
