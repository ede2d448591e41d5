"""Configurations that route the same ids, measured with one forward (issue 40 item 6).

A policy whose routing never reads the cache (`Policy.routes_by_cache` False: exact and
exact + prefetch) routes the exact top-k at every residency and prefetch count, so its
configurations in one expert format score the same logits and generate the same tokens;
they differ only in what their logical caches do with the routed ids (hits, copies,
slots: the counts and the trace the latency model prices). `harness.run_class` measures
one of them as `run_config` does, with a `RoutingTap` recording per scored window and
MoE layer the prompt's routed ids and the predictions each other member's `n` makes, and
`replay` then runs every other member's caches over those ids: the runtime's own
`LogicalCache`, `SlotMap`, `plan_prefill` and `TraceRecorder`, in scoring's order
(psr.runtime.window: per layer, the prompt seeds the cache, then per decode token the
prefetches queued by the layer before it, then `use`). The logical caches never read
physical state, so the replay is what the member's own run would count;
tests/eval/test_eval.py checks every figure bit for bit against separate runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from psr.cache import Insertion, LogicalCache
from psr.eval.modes import CacheStart
from psr.runtime.prefill import plan_prefill, reads_host
from psr.runtime.slots import SlotMap
from psr.runtime.stats import Stats
from psr.runtime.steering import Prediction, Steering
from psr.runtime.trace import Trace, TraceRecorder

if TYPE_CHECKING:
    from psr.runtime.context import RoutingContext
    from psr.runtime.layer import MoELayer
    from psr.runtime.model import OffloadedModel


@dataclass
class Tapped:
    """One MoE layer of one scored window: the prompt's routed ids per token, the decode
    tokens' count, and per prefetch count n the next layer's first n predicted ids per
    decode token (None: no next layer)."""

    history: list[list[int]]
    decode_tokens: int
    predictions: dict[int, list[list[int]] | None]


class RoutingTap(Steering):
    """The spec's steering, recording what `replay` needs while windows are scored: scoring
    calls `predictions` once per MoE layer and window, after the layer routed its prompt
    (its `history`), with the decode tokens' MoE inputs."""

    def __init__(self, runtime: RoutingContext, ns: Sequence[int]) -> None:
        super().__init__(runtime)
        self.ns = sorted({n for n in ns if n > 0})
        self.windows: list[list[Tapped]] = []

    def predictions(self, layer: MoELayer, residual: torch.Tensor) -> list[Prediction]:
        if layer.index == 0:
            self.windows.append([])
        preds = {n: self.predict(layer, residual, 1, n) for n in self.ns}
        self.windows[-1].append(
            Tapped([list(ids) for ids in layer.history], residual.shape[0], preds)
        )
        return super().predictions(layer, residual)


@dataclass
class Replayed:
    """A member's replayed run: its trace, its stats' report, and (exact routing) each
    window's caches at its first decode token, per MoE layer (eval/modes.py's input)."""

    trace: Trace
    stats: dict[str, float]
    starts: list[list[CacheStart]]


class _Counter:
    """The replay's side of the runtime's accounting (runtime/bookkeeping.py): counts into
    the stats and the token's record, copies into the trace's slots."""

    def __init__(self, model: OffloadedModel, rec: TraceRecorder) -> None:
        self.rt, self.rec, self.stats = model.runtime, rec, Stats()

    def copy(
        self,
        m: int,
        slots: SlotMap,
        inserts: list[Insertion],
        kind: str,
        record: dict[str, float],
        at: tuple[int, int] | None = None,
    ) -> None:
        placed, experts = slots.place(inserts)
        tiers = self.rt.book.tiers(m)
        for s, e in zip(placed, experts, strict=True):
            self.rec.copy(m, s, e, kind, at, tiers[e])
        self.count(record, copies=len(placed))
        self.count(record, bytes_copied=len(placed) * self.rt.acct.expert_bytes[m])

    def count(self, record: dict[str, float], **counts: int) -> None:
        for key, value in counts.items():
            self.stats.add(record, key, value)


def replay(model: OffloadedModel, windows: Sequence[Sequence[Tapped]], routed: Trace) -> Replayed:
    """`model`'s run over the windows a class member scored (`windows`: its `RoutingTap`'s,
    `routed`: its trace, whose routed ids and substituted counts every member shares),
    replayed on `model`'s logical caches: `model`'s policy `n`, capacity, slots as its
    store holds them at a sequence's start, expert bytes and row tiers. Nothing runs on
    the model; it must route by the exact top-k as the member did (the caller's class)."""
    rt = model.runtime
    if rt.policy.routes_by_cache:
        raise ValueError(f"replay takes routing that reads no cache, not {rt.policy.describe()}")
    rec = model.record_trace()
    rt.recorder = None  # the recorder is filled here, not by the model
    count, n = _Counter(model, rec), rt.policy.n
    starts: list[list[CacheStart]] = []
    first = 0
    for taps in windows:
        decode = taps[0].decode_tokens
        tokens = [rec.new_token() for _ in range(decode)]
        records = [count.stats.new_token() for _ in range(decode)]
        queued: list[tuple[int, int, list[list[int]]]] = []
        starts.append([])
        for m, tap in enumerate(taps):
            L = rt.layers[m]
            slots = SlotMap(rt.store.slot_experts(m)[: rt.capacity])  # a sequence's start
            staged = [] if reads_host(rt, L) else [e for ids in tap.history for e in ids]
            cache = LogicalCache(rt.capacity, rt.spec.num_experts)
            cache.reset(plan_prefill(slots, tap.history, staged).init)
            cap = rt.max_inserts(L)
            for j, (t, r) in enumerate(zip(tokens, records, strict=True)):
                for issuer, k, preds in queued:
                    ins = cache.prefetch(preds[j], k)
                    count.copy(m, slots, ins, "prefetch", r, at=(t, issuer))
                    count.count(r, prefetches=len(ins))
                if j == 0:
                    starts[-1].append(
                        CacheStart(
                            tuple(cache.order()),
                            tuple(slots.slot_expert),
                            tuple(sorted(slots.slot_of.items())),
                        )
                    )
                step = routed.tokens[first + j][m]
                ids = list(step.experts)
                use = cache.use(ids) if cap is None else cache.use(ids, cap)
                rec.routed(m, ids, use.hits, t, step.substituted, len(use.cpu))
                count.copy(m, slots, use.misses, "miss", r)
                count.count(
                    r,
                    routed=len(ids),
                    hits=use.hits,
                    misses=len(use.misses) + len(use.cpu),
                    prefetch_used=use.prefetch_used,
                    substituted=step.substituted,
                    cpu_experts=len(use.cpu),
                )
                on_cpu = set(use.cpu)
                rec.read(m, slots.slots([e for e in ids if e not in on_cpu]))
            ahead = tap.predictions.get(n) if n else None  # into the next layer
            queued = [] if ahead is None else [(m, n, ahead)]
        first += decode
    if first != len(routed.tokens):
        raise ValueError(f"the windows hold {first} decode tokens, the trace {len(routed.tokens)}")
    return Replayed(rec.trace, count.stats.report(), starts)
