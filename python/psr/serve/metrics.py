"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own.

Counters grow by each request's own figures (differences of the model's cumulative
stats, taken by the worker around the request): routed experts, hits, misses, prefetches
and prefetches used are counted over decode steps; copied bytes and stall seconds by
phase (prefill, decode).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "OUTCOMES", "Metrics"]

# How a request ended: stop / length (finish_reason), cancelled (client gone), error (500),
# rejected (429, queue full), invalid (4xx before decoding), unavailable (503, loading).
OUTCOMES = ("stop", "length", "cancelled", "error", "rejected", "invalid", "unavailable")
PHASES = ("prefill", "decode")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("psr_requests", "Requests, by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.prompt_tokens = Counter("psr_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter(
            "psr_generated_tokens", "Completion tokens generated", registry=r
        )
        self.routed = Counter(
            "psr_routed_experts", "Experts routed in decode steps (layers x top-k)", registry=r
        )
        self.hits = Counter("psr_expert_hits", "Routed experts found on the device", registry=r)
        self.misses = Counter("psr_expert_misses", "Routed experts copied in on demand", registry=r)
        self.prefetches = Counter("psr_prefetches", "Predicted experts copied ahead", registry=r)
        self.prefetches_used = Counter(
            "psr_prefetches_used", "Prefetched experts that were routed", registry=r
        )
        self.copied_bytes = Counter(
            "psr_copied_bytes", "Expert bytes copied to the device", ["phase"], registry=r
        )
        self.stall = Counter(
            "psr_stall_seconds", "Time spent waiting for expert copies", ["phase"], registry=r
        )
        for p in PHASES:
            self.copied_bytes.labels(p)
            self.stall.labels(p)
        self.queue_depth = Gauge("psr_queue_depth", "Requests waiting to decode", registry=r)
        self.running = Gauge("psr_running_requests", "Requests decoding (0 or 1)", registry=r)
        self.ttft = Histogram(
            "psr_time_to_first_token_seconds",
            "From a request's arrival to its first token (queueing included)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "psr_time_per_output_token_seconds",
            "Between consecutive tokens of a request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def add_request(
        self,
        stats: dict[str, float],
        prompt_tokens: int,
        completion_tokens: int,
        token_times: list[float],
        arrived: float,
    ) -> None:
        """One decoded request: `stats` its stats differences, `token_times` when each of
        its tokens was made (perf_counter), `arrived` when it was accepted."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(completion_tokens)
        self.routed.inc(stats["routed"])
        self.hits.inc(stats["hits"])
        self.misses.inc(stats["misses"])
        self.prefetches.inc(stats["prefetches"])
        self.prefetches_used.inc(stats["prefetch_used"])
        self.copied_bytes.labels("prefill").inc(stats["prefill_bytes"])
        self.copied_bytes.labels("decode").inc(stats["bytes_copied"])
        self.stall.labels("prefill").inc(stats["prefill_stall_s"])
        self.stall.labels("decode").inc(stats["stall_s"])
        if token_times:
            self.ttft.observe(token_times[0] - arrived)
        for a, b in pairwise(token_times):
            self.tpot.observe(b - a)

    def render(self) -> bytes:
        out: Any = generate_latest(self.registry)
        return bytes(out)
