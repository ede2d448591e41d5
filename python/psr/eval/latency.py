"""Latency model: replay a routing trace through a two-stream schedule.

One copy stream runs host->device expert copies in issue order; one compute stream
runs each decoder layer's dense work, then its routed experts. Dependencies are the
runtime's: a layer's experts wait for the copies into the slots they read; a copy into
a slot waits for the last compute that read the slot (write-after-read); copies are
issued when their layer has routed (batch 1: routing is on the critical path).

Hardware profiles set the costs of a *modeled* expert (by default OLMoE-1B-7B's,
3 x 2048 x 1024 bf16 = 12.6 MB), so traces of psr's small embedded model are priced
like the offloaded model it stands in for, as the spec's latency model does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from psr.runtime.trace import Trace

OLMOE_EXPERT_BYTES = 3 * 2048 * 1024 * 2


@dataclass(frozen=True)
class Profile:
    name: str
    h2d_gbps: float  # host->device copy bandwidth (pinned)
    copy_overhead_us: float  # per copy (launch, DMA setup)
    hbm_gbps: float  # device memory bandwidth: batch-1 expert GEMV is bandwidth bound
    expert_overhead_us: float  # per expert (kernel launches)
    dense_ms_per_layer: float  # attention, norms, router: per decoder layer
    expert_bytes: int = OLMOE_EXPERT_BYTES
    notes: str = ""

    def copy_s(self) -> float:
        return self.expert_bytes / (self.h2d_gbps * 1e9) + self.copy_overhead_us * 1e-6

    def expert_s(self) -> float:
        return self.expert_bytes / (self.hbm_gbps * 1e9) + self.expert_overhead_us * 1e-6

    def dense_s(self) -> float:
        return self.dense_ms_per_layer * 1e-3

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls(**json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))


PROFILES = {
    "rtx4090": Profile(
        "rtx4090",
        h2d_gbps=25.0,
        copy_overhead_us=5.0,
        hbm_gbps=900.0,
        expert_overhead_us=5.0,
        dense_ms_per_layer=0.3,
        notes="RTX 4090, PCIe 4.0 x16: 0.5 ms per OLMoE expert copy, 0.3 ms dense per layer",
    ),
    "h200": Profile(
        "h200",
        h2d_gbps=55.0,
        copy_overhead_us=5.0,
        hbm_gbps=4000.0,
        expert_overhead_us=4.0,
        dense_ms_per_layer=0.08,
        notes="H200 (PCIe 5.0 x16 host link, HBM3e): 0.23 ms per OLMoE expert copy",
    ),
}


def get_profile(name_or_path: str | Profile) -> Profile:
    if isinstance(name_or_path, Profile):
        return name_or_path
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if Path(name_or_path).is_file():
        return Profile.load(name_or_path)
    raise ValueError(
        f"unknown profile {name_or_path!r}; built in: {', '.join(PROFILES)}, "
        "or a JSON file written by Profile.save"
    )


@dataclass
class LatencyResult:
    profile: str
    tokens: int
    ms_per_token: float
    lower_bound_ms: float  # max(compute, bytes copied / bandwidth) per token
    compute_ms: float  # per token, no stalls
    copy_ms: float  # per token, copy stream busy
    stall_ms: float  # per token, compute waiting on copies
    per_token_ms: list[float]

    def as_dict(self, with_tokens: bool = False) -> dict:
        d = asdict(self)
        if not with_tokens:
            d.pop("per_token_ms")
        return d


def simulate(
    trace: Trace,
    profile: str | Profile,
    expert_bytes: int | None = None,
    draft_s: float = 0.0,
) -> LatencyResult:
    """Modeled decode latency of `trace` under `profile` (see module docstring).

    Speculative traces (`trace.emitted`): each step is a verify block whose dense work is
    priced as one token's (batch-1 weight reads dominate), whose experts are its set, and
    which the drafter's `draft_s` precedes on the compute stream; ms per token divides by
    the tokens the steps emitted."""
    p = get_profile(profile)
    if trace.bytes_ratio != 1.0:  # a quantized format moves and reads fewer bytes
        p = replace(p, expert_bytes=round(p.expert_bytes * trace.bytes_ratio))
    if trace.emitted and len(trace.emitted) != len(trace.tokens):
        raise ValueError(
            f"trace has {len(trace.tokens)} steps but {len(trace.emitted)} emitted counts"
        )
    if expert_bytes is not None:
        p = replace(p, expert_bytes=expert_bytes)
    t_copy, t_exp, t_dense = p.copy_s(), p.expert_s(), p.dense_s()
    moe_at = {d: i for i, d in enumerate(trace.moe_layers)}
    ready: dict[tuple[int, int], float] = {}  # (layer, slot) -> copy done
    last_read: dict[tuple[int, int], float] = {}  # (layer, slot) -> last reader done
    now = copy_free = 0.0
    per_token, compute, copy_busy, stall = [], 0.0, 0.0, 0.0
    for steps in trace.tokens:
        start = now
        if trace.emitted:
            now += draft_s
            compute += draft_s
        by_layer = {s.layer: s for s in steps}
        for d in range(trace.num_decoder_layers):
            now += t_dense
            compute += t_dense
            m = moe_at.get(d)
            if m is None:
                continue
            step = by_layer.get(m)
            if step is None:
                raise ValueError(f"trace token {len(per_token)} has no step for MoE layer {m}")
            for c in step.copies:  # issued once the layer has routed
                key = (c.layer, c.slot)
                begin = max(copy_free, now, last_read.get(key, 0.0))
                copy_free = begin + t_copy
                copy_busy += t_copy
                ready[key] = copy_free
            need = max((ready.get((m, s), 0.0) for s in step.slots), default=0.0)
            if need > now:
                stall += need - now
                now = need
            now += len(step.experts) * t_exp
            compute += len(step.experts) * t_exp
            for s in step.slots:
                last_read[(m, s)] = now
        per_token.append((now - start) * 1e3)
    n = max(sum(trace.emitted) if trace.emitted else len(trace.tokens), 1)
    comp_ms, copy_ms = compute / n * 1e3, copy_busy / n * 1e3
    return LatencyResult(
        profile=p.name,
        tokens=n if trace.emitted else len(trace.tokens),
        ms_per_token=sum(per_token) / n,
        lower_bound_ms=max(comp_ms, copy_ms),
        compute_ms=comp_ms,
        copy_ms=copy_ms,
        stall_ms=stall / n * 1e3,
        per_token_ms=per_token,
    )


def calibrate(name: str, measured: dict[str, float], base: str | Profile = "h200") -> Profile:
    """A profile from measured GPU figures: keys h2d_gbps, expert_ms, dense_ms_per_layer,
    expert_bytes (any subset; the rest from `base`)."""
    p = get_profile(base)
    kw: dict = {"name": name, "notes": f"calibrated from a measured run (base {p.name})"}
    eb = int(measured.get("expert_bytes", p.expert_bytes))
    kw["expert_bytes"] = eb
    if "h2d_gbps" in measured:
        kw["h2d_gbps"] = measured["h2d_gbps"]
        kw["copy_overhead_us"] = 0.0
    if "expert_ms" in measured:
        kw["hbm_gbps"] = eb / (measured["expert_ms"] * 1e-3) / 1e9
        kw["expert_overhead_us"] = 0.0
    if "dense_ms_per_layer" in measured:
        kw["dense_ms_per_layer"] = measured["dense_ms_per_layer"]
    return replace(p, **kw)


def drafter_seconds(
    profile: str | Profile,
    num_decoder_layers: int,
    target_dense_params: int,
    drafter_params: int,
    passes: int,
) -> float:
    """Modeled drafter time per verify block: `passes` sequential passes (an AR drafter:
    one per drafted token; block heads: one) over `drafter_params` weights, priced as the
    profile prices the target's dense work per parameter (a batch-1 pass reads every
    weight once): dense_ms_per_layer x layers covers `target_dense_params`."""
    p = get_profile(profile)
    per_param = p.dense_s() * num_decoder_layers / max(target_dense_params, 1)
    return passes * drafter_params * per_param
