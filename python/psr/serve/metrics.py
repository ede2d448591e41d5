"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own.

Counters grow by each request's own figures (differences of the model's cumulative
stats, taken by the worker around the request): routed experts, hits, misses, prefetches
and prefetches used are counted over decode steps; copied bytes and stall seconds by
phase (prefill, decode). Every series carries a `model_name` label (the served name), and
the latency histograms are vLLM's: time to first token, time per output token, end to end
and queue time (`_created` series are turned off: prometheus_client's process-wide
switch, which a server process owns).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

__all__ = ["CONTENT_TYPE", "OUTCOMES", "Metrics"]

# How a request ended: stop / length (finish_reason), cancelled (client gone), error (500),
# rejected (429, queue full), invalid (4xx before decoding), unavailable (503, loading),
# unauthorized (401), too_large (413: the body limit).
OUTCOMES = (
    "stop",
    "length",
    "cancelled",
    "error",
    "rejected",
    "invalid",
    "unavailable",
    "unauthorized",
    "too_large",
)
PHASES = ("prefill", "decode")
TIERS = ("pinned", "page_cache", "disk")  # where decode's expert bytes were read from
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_MASK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)


class _Labelled:
    """A metric family with its `model_name` label bound."""

    def __init__(self, metric: Any, model_name: str) -> None:
        self.metric, self.model_name = metric, model_name

    def labels(self, *values: str) -> Any:
        return self.metric.labels(self.model_name, *values)


class _Make:
    """Makes one model's metrics in a registry, each labelled with its model name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.r, self.m = registry, model_name

    def counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, ["model_name"], registry=self.r).labels(self.m)

    def gauge(self, name: str, doc: str) -> Any:
        return Gauge(name, doc, ["model_name"], registry=self.r).labels(self.m)

    def by(self, kind: Any, name: str, doc: str, label: str, values: tuple[str, ...]) -> Any:
        """A family with one more label, every value of it present from the start."""
        fam = _Labelled(kind(name, doc, ["model_name", label], registry=self.r), self.m)
        for v in values:
            fam.labels(v)
        return fam

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.r).labels(self.m)


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        make = _Make(self.registry, model_name)  # registered in this order (/metrics lists so)
        self._add_token_metrics(make)
        self._add_expert_metrics(make)
        self._add_latency_metrics(make)
        self._add_tool_metrics(make)

    def _add_token_metrics(self, make: _Make) -> None:
        counter, by = make.counter, make.by
        self.requests = by(Counter, "psr_requests", "Requests, by outcome", "outcome", OUTCOMES)
        self.prompt_tokens = counter("psr_prompt_tokens", "Prompt tokens prefilled")
        self.prompt_cached = counter(
            "psr_prompt_tokens_cached", "Prompt tokens resumed from the prompt cache"
        )
        self.prompt_computed = counter(
            "psr_prompt_tokens_computed", "Prompt tokens computed (not from the prompt cache)"
        )
        self.generated_tokens = counter("psr_generated_tokens", "Completion tokens generated")
        self.idle_prefill = counter(
            "psr_idle_prefill_tokens",
            "Finished requests' tokens prefilled into the prompt cache while idle",
        )

    def _add_expert_metrics(self, make: _Make) -> None:
        counter, by = make.counter, make.by
        self.routed = counter(
            "psr_routed_experts", "Experts routed in decode steps (layers x top-k)"
        )
        self.hits = counter("psr_expert_hits", "Routed experts found on the device")
        self.misses = counter("psr_expert_misses", "Routed experts copied in on demand")
        self.prefetches = counter("psr_prefetches", "Predicted experts copied ahead")
        self.prefetches_used = counter("psr_prefetches_used", "Prefetched experts that were routed")
        self.substituted = counter(
            "psr_substituted_experts",
            "Routed experts not in the router's own exact top-k (the cache bias chose them)",
        )
        self.cpu_experts = counter(
            "psr_cpu_experts",
            "Routed experts computed on the CPU from their host rows (experts_on cpu / hybrid)",
        )
        self.copied_bytes = by(
            Counter, "psr_copied_bytes", "Expert bytes copied to the device", "phase", PHASES
        )
        self.stall = by(
            Counter, "psr_stall_seconds", "Time spent waiting for expert copies", "phase", PHASES
        )
        self.read_bytes = by(
            Counter,
            "psr_expert_read_bytes",
            "Expert bytes decode read, by memory tier (held rows; pageable rows from the "
            "page cache or the disk, by mincore before the read)",
            "tier",
            TIERS,
        )
        self.pageable_stall = counter(
            "psr_pageable_stall_seconds", "Of decode's stall, waiting for pageable expert rows"
        )

    def _add_latency_metrics(self, make: _Make) -> None:
        histogram = make.histogram
        self.queue_depth = make.gauge("psr_queue_depth", "Requests waiting to decode")
        self.running = make.gauge(
            "psr_running_requests", "Requests decoding (the active slots of --parallel)"
        )
        self.slots = make.gauge("psr_slots", "Requests that may decode at once (--parallel)")
        self.batch_size = histogram(
            "psr_batch_size", "Sequences in each batched decode step", _BATCH_BUCKETS
        )
        self.ttft = histogram(
            "psr_time_to_first_token_seconds",
            "From a request's arrival to its first token (queueing included)",
            _TTFT_BUCKETS,
        )
        self.tpot = histogram(
            "psr_time_per_output_token_seconds",
            "Between consecutive tokens of a request",
            _TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "psr_e2e_request_latency_seconds",
            "From a decoded request's arrival to its last token",
            _E2E_BUCKETS,
        )
        self.queue_time = histogram(
            "psr_request_queue_time_seconds",
            "From a decoded request's arrival to the worker taking it",
            _TTFT_BUCKETS,
        )

    def _add_tool_metrics(self, make: _Make) -> None:
        counter, histogram = make.counter, make.histogram
        self.tool_parse_failures = counter(
            "psr_tool_parse_failures",
            "Replies whose tool-call markup did not parse (returned as content)",
        )
        self.tool_calls = counter("psr_tool_calls", "Tool calls returned to clients")
        self.grammar = histogram(
            "psr_grammar_mask_seconds_per_token",
            "Structured output: the grammar mask's host time per token, per request",
            _MASK_BUCKETS,
        )

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def add_request(
        self,
        stats: dict[str, float] | None,
        prompt_tokens: int,
        completion_tokens: int,
        token_times: list[float],
        arrived: float,
        started: float | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """One decoded request: `stats` its stats differences, `token_times` when each of
        its tokens was made (perf_counter), `arrived` when it was accepted, `started` when
        the worker took it, `cached_tokens` of its prompt resumed from the prompt cache.
        `stats` None: a request decoded in a batch, whose expert counts `add_experts` adds
        per step for the whole batch."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_cached.inc(cached_tokens)
        self.prompt_computed.inc(prompt_tokens - cached_tokens)
        self.generated_tokens.inc(completion_tokens)
        if stats is not None:
            self.add_experts(stats)
        if started is not None:
            self.queue_time.observe(started - arrived)
        if token_times:
            self.ttft.observe(token_times[0] - arrived)
            self.e2e.observe(token_times[-1] - arrived)
        for a, b in pairwise(token_times):
            self.tpot.observe(b - a)

    def add_experts(self, stats: Mapping[str, float]) -> None:
        """Expert routing and copy counts (a request's, or a batch step's)."""
        self.routed.inc(stats["routed"])
        self.hits.inc(stats["hits"])
        self.misses.inc(stats["misses"])
        self.prefetches.inc(stats["prefetches"])
        self.prefetches_used.inc(stats["prefetch_used"])
        self.substituted.inc(stats["substituted"])
        self.cpu_experts.inc(stats.get("cpu_experts", 0))
        self.copied_bytes.labels("prefill").inc(stats["prefill_bytes"])
        self.copied_bytes.labels("decode").inc(stats["bytes_copied"])
        self.stall.labels("prefill").inc(stats["prefill_stall_s"])
        self.stall.labels("decode").inc(stats["stall_s"])
        for tier, key in zip(
            TIERS, ("bytes_pinned", "bytes_page_cache", "bytes_disk"), strict=True
        ):
            self.read_bytes.labels(tier).inc(stats.get(key, 0))
        self.pageable_stall.inc(stats.get("stall_pageable_s", 0.0))

    def render(self) -> bytes:
        out: Any = generate_latest(self.registry)
        return bytes(out)
