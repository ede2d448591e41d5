"""Where misses are computed: `gpu`, `cpu` and `hybrid` side by side (issue 27 part 5).

`gpu` copies every miss into a slab slot (psr today). `cpu` computes every miss on the
CPU from its host row (no copy; the slab holds the cached experts), `hybrid` copies up to
`m` misses per layer step and computes the rest on the CPU. The latency model prices the
CPU's work from `LayerStep.cpu_experts` (psr.eval.latency: the profile's cpu_gbps,
cpu_layer_us, cpu_expert_us). `modes_table` renders one row per profile and mode from
traces recorded in each mode.

Until the runtime records cpu / hybrid traces itself (`experts_on=`), `replay_modes` derives
them, for exact routing only, from a `gpu` trace and the logical caches at each window's
start: with routing independent of the cache, a cpu / hybrid run routes the same experts,
and only the cache's insertions differ. The replay runs each layer's logical cache with a
capped `use`, the runtime's own (`LogicalCache.use(max_inserts=m)`: the m lowest missing
ids inserted, the others computed on the CPU and kept out of the cache). `m` is 0 for
`cpu`, and for `hybrid` the cap the runtime's `experts_on="hybrid"` takes from a machine
profile with this latency profile's costs (`hybrid_cap`: psr.machine.choose_inserts at
the expected misses k (1 - C / E)), one cap for every layer: a function of the logical
state only, so tokens stay independent of timing. THIS IS A REPLAY FOR EXACT ROUTING
ONLY: a policy that biases toward the cache routes differently once the cache differs,
and its cpu / hybrid traces must be recorded.

Recorded traces: `psr eval --record-modes` (harness.run_config(modes_recorded=True)) scores a
biased policy's windows again with `experts_on` cpu and hybrid:m (each m `hybrid_caps`
gives the profiles), traces recorded, into the result's `mode_traces` ({"traces": {"cpu":
trace, "hybrid:2": trace, ...}, "capacity", "num_experts", "nll_items": per mode}).
`MODE_TRACES` (the hook the demo and eval call, `mode_traces`) takes those where a result
has them, else the exact-routing replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from psr.cache import LogicalCache
from psr.eval.latency import Profile, get_profile, simulate
from psr.machine import choose_inserts, expected_misses
from psr.runtime.slots import SlotMap
from psr.runtime.trace import Copy, LayerStep, Trace

MODES = ("gpu", "cpu", "hybrid")


@dataclass(frozen=True)
class CacheStart:
    """One MoE layer's logical cache and slot map when a window's decode tokens begin."""

    order: tuple[int, ...]  # least recent first
    slot_expert: tuple[int, ...]
    slot_of: tuple[tuple[int, int], ...]  # (expert, slot) of each logical member


def hybrid_cap(p: Profile, top_k: int, capacity: int, num_experts: int) -> int:
    """`hybrid`'s miss-copy cap per layer step under profile `p`: what the runtime chooses
    from a machine profile with p's copy and CPU costs (psr.machine.choose_inserts)."""
    per = p.expert_bytes / (p.cpu_gbps * 1e9) + p.cpu_expert_us * 1e-6
    misses = expected_misses(top_k, capacity, num_experts)
    return choose_inserts(misses, top_k, p.copy_s(), p.cpu_layer_us * 1e-6, per)


def _scaled(profile: str | Profile, bytes_ratio: float) -> Profile:
    """The profile with a trace's expert bytes (a quantized format copies fewer)."""
    p = get_profile(profile)
    if bytes_ratio != 1.0:
        p = replace(p, expert_bytes=round(p.expert_bytes * bytes_ratio))
    return p


def hybrid_caps(
    profiles: Sequence[str | Profile],
    top_k: int,
    capacity: int,
    num_experts: int,
    bytes_ratio: float = 1.0,
) -> dict[str, int]:
    """`hybrid_cap` per profile name, at a trace's `bytes_ratio`: the hybrid runs to record."""
    return {
        get_profile(p).name: hybrid_cap(_scaled(p, bytes_ratio), top_k, capacity, num_experts)
        for p in profiles
    }


def _replay_layer(
    steps: Sequence[LayerStep],
    start: CacheStart,
    capacity: int,
    num_experts: int,
    cap: int | None,
) -> list[LayerStep]:
    cache = LogicalCache(capacity, num_experts)
    cache.reset(start.order)
    slots = SlotMap(start.slot_expert)
    slots.slot_of = dict(start.slot_of)
    out = []
    for s in steps:
        r = cache.use(list(s.experts), max_inserts=cap)
        on_cpu = set(r.cpu)
        gpu = [e for e in s.experts if e not in on_cpu]
        placed, experts = slots.place(r.misses)
        copies = [Copy(s.layer, sl, e, "miss") for sl, e in zip(placed, experts, strict=True)]
        out.append(
            LayerStep(
                s.layer,
                list(s.experts),
                slots.slots(gpu),
                r.hits,
                copies,
                s.substituted,
                len(s.experts) - len(gpu),
            )
        )
    return out


def replay(
    trace: Trace,
    starts: Sequence[Sequence[CacheStart]],
    window: int,
    capacity: int,
    num_experts: int,
    cap: int | None,
) -> Trace:
    """`trace` (exact routing, no prefetch) replayed with at most `cap` misses inserted per
    layer step (None: all, which reproduces the trace); `starts[w][layer]`:
    window w's caches, every `window` decode tokens."""
    if any(c.kind != "miss" for tok in trace.tokens for s in tok for c in s.copies):
        raise ValueError("replay takes a trace without prefetches (exact routing, n = 0)")
    if window <= 0 or len(starts) * window < len(trace.tokens):
        raise ValueError(
            f"{len(starts)} window starts of {window} tokens do not cover the trace's "
            f"{len(trace.tokens)} tokens"
        )
    tokens: list[list[LayerStep]] = [[] for _ in trace.tokens]
    layers = len(trace.moe_layers)
    for w, start in enumerate(starts):
        span = range(w * window, min((w + 1) * window, len(trace.tokens)))
        for m in range(layers):
            steps = [next(s for s in trace.tokens[t] if s.layer == m) for t in span]
            for t, s in zip(
                span, _replay_layer(steps, start[m], capacity, num_experts, cap), strict=True
            ):
                tokens[t].append(s)
    return replace(trace, tokens=tokens)


def replay_modes(
    trace: Trace,
    starts: Sequence[Sequence[CacheStart]],
    window: int,
    capacity: int,
    num_experts: int,
    profile: str | Profile,
) -> dict[str, Trace]:
    """The gpu trace and its cpu and hybrid replays under `profile` (module docstring)."""
    p = _scaled(profile, trace.bytes_ratio)
    args = (starts, window, capacity, num_experts)
    top_k = len(trace.tokens[0][0].experts) if trace.tokens and trace.tokens[0] else 1
    return {
        "gpu": trace,
        "cpu": replay(trace, *args, 0),
        "hybrid": replay(trace, *args, hybrid_cap(p, top_k, capacity, num_experts)),
    }


def replay_hook(result: dict[str, Any], profile: str) -> dict[str, Trace] | None:
    """`MODE_TRACES` until recorded runs exist: a run_config result of exact routing that
    kept its window starts (`mode_starts`) replayed; None for any other result."""
    ms = result.get("mode_starts")
    if ms is None:
        return None
    return replay_modes(
        result["trace"], ms["starts"], ms["window"], ms["capacity"], ms["num_experts"], profile
    )


def recorded_hook(result: dict[str, Any], profile: str) -> dict[str, Trace] | None:
    """A run_config result's recorded traces (`mode_traces`, run_config(modes_recorded=True)): gpu
    (its own trace), cpu, and the hybrid run with `profile`'s cap; each recorded trace
    takes the gpu trace's measured host schedule (as the replays do: the policy's
    device-step schedule). None without recorded traces, or none for this profile's cap."""
    rec = result.get("mode_traces")
    if not rec:
        return None
    gpu: Trace = result["trace"]
    m = hybrid_caps([profile], gpu.top_k, rec["capacity"], rec["num_experts"], gpu.bytes_ratio)
    hybrid = rec["traces"].get(f"hybrid:{m[get_profile(profile).name]}")
    if hybrid is None:
        return None
    return {
        "gpu": gpu,
        "cpu": replace(rec["traces"]["cpu"], host=gpu.host),
        "hybrid": replace(hybrid, host=gpu.host),
    }


def mode_traces(result: dict[str, Any], profile: str) -> dict[str, Trace] | None:
    """`MODE_TRACES`: recorded traces where the result has them, else exact's replay."""
    return recorded_hook(result, profile) or replay_hook(result, profile)


# The hook psr demo / psr eval call per result and profile: mode -> trace, or None.
MODE_TRACES: Callable[[dict[str, Any], str], dict[str, Trace] | None] = mode_traces


def assumptions(profiles: Sequence[str | Profile]) -> str:
    """The CPU figures each profile prices, for a table's header."""
    parts = []
    for name in profiles:
        p = get_profile(name)
        parts.append(
            f"{p.name}: CPU {p.cpu_gbps:g} GB/s over host rows, {p.cpu_layer_us:g} µs per "
            f"layer hand-off, {p.cpu_expert_us:g} µs per expert; PCIe {p.h2d_gbps:g} GB/s"
        )
    return "; ".join(parts)


def modes_rows(
    by_profile: dict[str, dict[str, Trace]], *, host: bool = True
) -> list[dict[str, Any]]:
    """Per profile and mode: copies and CPU experts per token, modeled ms/token host-free
    and (traces with a host schedule) host-aware eager and graph, speedup over gpu."""
    rows = []
    for prof, traces in by_profile.items():
        base = None
        for mode in MODES:
            t = traces.get(mode)
            if t is None:
                continue
            n = max(len(t.tokens), 1)
            row: dict[str, Any] = {
                "profile": prof,
                "mode": mode,
                "copies": sum(len(s.copies) for tok in t.tokens for s in tok) / n,
                "cpu_experts": sum(s.cpu_experts for tok in t.tokens for s in tok) / n,
                "host_free": simulate(t, prof).ms_per_token,
            }
            if host and t.host is not None:
                row["eager"] = simulate(t, prof, host=True).ms_per_token
                if t.host.mode == "device":
                    row["graph"] = simulate(t, prof, host=True, graph=True).ms_per_token
            base = base or row
            row["speedup"] = base["host_free"] / row["host_free"]
            rows.append(row)
    return rows


def modes_table(by_profile: dict[str, dict[str, Trace]], *, host: bool = True) -> str:
    """Markdown: one row per profile and mode (modes_rows), the CPU assumptions below."""
    rows = modes_rows(by_profile, host=host)
    aware = any("eager" in r for r in rows)
    cols = ["profile", "experts on", "copies/tok", "CPU experts/tok", "ms/tok (host-free)"]
    if aware:
        cols += ["ms/tok (host-aware, eager)", "ms/tok (host-aware, graph)"]
    cols.append("speedup vs gpu (host-free)")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["profile"], r["mode"], f"{r['copies']:.2f}", f"{r['cpu_experts']:.2f}"]
        cells.append(f"{r['host_free']:.2f}")
        if aware:
            cells += [f"{r[k]:.2f}" if k in r else "-" for k in ("eager", "graph")]
        cells.append(f"{r['speedup']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nassumptions: " + assumptions(list(by_profile))


class StartWatch:
    """Records each MoE layer's logical cache and slot map before every `use` of its cache
    while a model scores windows (the layers' caches wrapped on the instances), so that
    `starts` can hand `replay` each window's caches. Reads the runtime, changes nothing."""

    def __init__(self, model: Any) -> None:
        self.layers = list(model.runtime.layers)
        self.seen: list[list[CacheStart]] = [[] for _ in self.layers]
        for L, seen in zip(self.layers, self.seen, strict=True):
            inner = L.cache.use

            def use(
                routed: Sequence[int],
                *args: Any,
                L: Any = L,
                seen: Any = seen,
                inner: Any = inner,
                **kw: Any,
            ) -> Any:
                seen.append(
                    CacheStart(
                        tuple(L.cache.order()),
                        tuple(L.slots.slot_expert),
                        tuple(sorted(L.slots.slot_of.items())),
                    )
                )
                return inner(routed, *args, **kw)

            L.cache.use = use

    def close(self) -> None:
        for L in self.layers:
            L.cache.__dict__.pop("use", None)

    def starts(self, tokens: int, windows: int) -> dict[str, Any]:
        """`replay`'s window starts for a trace of `tokens` decode tokens over `windows`
        equal windows (one `use` per layer and token)."""
        if windows <= 0 or tokens % windows:
            raise ValueError(f"{tokens} decode tokens do not split into {windows} windows")
        w = tokens // windows
        for i, seen in enumerate(self.seen):
            if len(seen) != tokens:
                raise ValueError(f"MoE layer {i}: {len(seen)} cache uses for {tokens} tokens")
        return {
            "window": w,
            "starts": [[seen[k * w] for seen in self.seen] for k in range(windows)],
        }


def replayable(policy: Any) -> bool:
    """Exact routing without prefetch: the policies `replay` derives cpu / hybrid from."""
    return policy.name == "exact" and not policy.lam and not policy.n


def modes_appendix(results: Sequence[dict[str, Any]], profiles: Sequence[str]) -> str:
    """psr demo / psr eval's gpu / cpu / hybrid tables: per result that `MODE_TRACES`
    gives traces for (recorded ones, else exact routing replayed), one table over
    `profiles`; '' when none."""
    parts = []
    for r in results:
        by_profile: dict[str, dict[str, Trace]] = {}
        for p in profiles:
            traces = MODE_TRACES(r, p)
            if traces:
                by_profile[p] = traces
        if not by_profile:
            continue
        rho = r["config"]["residency"]
        how = (
            "each mode recorded: the windows scored again with experts_on cpu / hybrid; "
            "host-aware figures with the gpu run's measured schedule"
            if r.get("mode_traces")
            else "cpu / hybrid replayed from the gpu trace with a capped `use` (exact "
            "routing only; eval/modes.py)"
        )
        how += (
            "; hybrid copies at most m misses per layer step, the lowest ids, m as "
            "experts_on='hybrid' chooses it from the profile's costs"
        )
        parts.append(
            f"Experts on gpu / cpu / hybrid: {r['label']} at {rho:.1%} residency ({how}):"
            "\n\n" + modes_table(by_profile)
        )
    return "\n\n".join(parts)
