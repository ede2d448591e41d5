"""Latency model: replay a routing trace through a two-stream schedule, and optionally a
host thread that issues it.

Host-free (the default, what every published psr figure used): one copy stream runs
host->device expert copies in issue order; one compute stream runs each decoder layer's
dense work, then its routed experts. Dependencies are the runtime's: a layer's experts
wait for the copies into the slots they read; a copy into a slot waits for the last
compute that read the slot (write-after-read); copies are issued when their layer has
routed (batch 1: routing is on the critical path). The host costs nothing.

Host-aware (`simulate(..., host=True)` on a trace whose `host` schedule was measured from
a real decode, psr.eval.host_probe.measure_schedule): one host thread replays the
schedule's ops in order, each at its profile cost, and GPU work cannot start before the
host issued it:
  launch   host launch_us (eager) or triton_launch_us; enqueues its GPU work on the
           compute stream: a decoder layer's dense_ms_per_layer is spread over its
           dense launches; a MoE layer's expert time over its FFN launches (those after
           the layer's last sync/h2d/copy/wait/gather/join); any other launch (routing,
           prediction, sampling) runs small_kernel_us;
  sync     the host waits until the compute stream is idle, then sync_us;
  h2d      a launch, then a sync (a tensor built from host data copies synchronously);
  copy     a store call (store_call_us) issuing the step's host-chosen copies of that
           kind (`what`: "miss" | "prefetch"; else all) on the copy stream at the host's
           time, each after the last read of its slot;
  wait     a store call; the compute stream waits for this layer's copies (acquire);
  release  a store call (host cost only);
  gather   a store call launching a device-indexed copy: on the compute stream, the
           layer's miss copies inline (copy time each); on the side stream (forked from
           the compute stream: after everything issued to it so far), the next layer's
           prefetch copies;
  join     a store call; the compute stream waits for the side stream.
Each MoE layer adds its Python (python_us_per_layer for the host-driven step,
device_python_us_per_layer for the device step) spread over its ops, each decoder layer
the model's own Python (dense_python_us_per_layer) over its dense launches; each token adds
token_us, then the schedule's per-token ops (the loop's sampling and read of the token).
A token ends when both the host and the compute stream are done with it. `graph=True`
replays the device step as one captured graph per token (HostSchedule.as_graph: the host
pays token_us and graph_launch_us per token, the GPU runs the same work); both report
`first_token_ms`, a sequence's first decode token: the cache hand-over (begin_us) and the
eager token (with graphs, the first token runs eagerly), not in ms_per_token. The device
step's, the model's and the loop's Python and begin_us are measured with the launches
stubbed (MEASURED_HOST); launch, sync and store-call costs are published figures.

The CPU (both models): a layer step with `cpu_experts` > 0 computes that many routed
experts from their host rows on CPU worker threads (no copy, no slot): the work starts
when the layer has routed (host-free: after its dense part; host-aware: when the compute
stream reaches the layer's first sync/copy/wait/gather/join or FFN launch), after the
CPU's previous work, takes cpu_layer_us (hand-off of the hidden state and ids, wake-up,
merge) + per expert cpu_expert_us + expert_bytes / cpu_gbps, runs beside the GPU's slab
experts, and the layer's output waits for both (the wait counted as stall; `cpu_ms` the
CPU's busy time per token).

Verify blocks (speculative traces, `Trace.emitted`; issue 41): a step is one block of T
tokens. Both models price its dense work once (batch-1 weight reads dominate), its slab
experts (the union of its tokens' experts, copies issued up to the verify rule's budget)
each once, and its CPU experts each once for the rows routed to it: cpu_s(experts, rows)
= hand-off + per expert call + max(weights read at cpu_gbps, rows x expert_flops at
cpu_gflops), bandwidth bound at a block's few rows per expert. The drafter's `draft_s`
per block runs on the compute stream; ms per token divides by the tokens emitted.
Host-aware needs a schedule measured from verify blocks (HostSchedule mode "verify",
measure_schedule on a model decoding speculatively): the host-driven step's ops
(python_us_per_layer) up to each layer's slab read (its "release"); the CPU experts as
that step runs them, synchronously: the host reads the layer's input once the compute
stream drained, waits for the CPU, copies the result back and launches the sum; the ops
between blocks (the target's choices read, the drafter's passes) as a token's, `draft_s`
spread over their launches. Verify blocks run eagerly (graphs refuse them).

The pageable tier (issue 28): a copy whose trace `Copy` has `tier == "pageable"` (traces
without the field are pinned) first reads its expert at `pageable_gbps`, on the same
stream, then copies it (a copy, a gather).

Hardware profiles set the costs of a *modeled* expert (by default OLMoE-1B-7B's,
3 x 2048 x 1024 bf16 = 12.6 MB), so traces of psr's small embedded model are priced
like the offloaded model it stands in for, as the spec's latency model does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from psr.models.memory_plan import Rates
from psr.runtime.trace import HOST_OP_KINDS, Copy, HostOp, HostSchedule, LayerStep, Trace

OLMOE_EXPERT_BYTES = 3 * 2048 * 1024 * 2
HOST_FREE = "host-free"
VERIFY = "verify"  # a HostSchedule measured from speculative verify blocks

# The host's own Python, measured on this machine with the launches stubbed
# (bench/results/host_path/host_costs.json, psr's fastest of 3 rounds: `python
# bench/host_path.py --costs`, psr.eval.host_probe.measure_host_costs): the device step's
# hooks per MoE layer, the model's own Python per decoder layer (transformers' modules and
# psr's forward wrapper, beyond their launches), the loop per token, and the cache
# hand-over at a sequence's first decode token. A shared 2-core VM whose small aten op
# costs ~2 µs; a GPU host's CPU may be faster, so these are upper bounds (the same host
# for every built-in profile).
MEASURED_HOST = {
    "device_python_us_per_layer": 95.2,
    "dense_python_us_per_layer": 353.7,
    "token_us": 65.5,
    "begin_us": 3377.8,
}
MEASURED_ON = "measured on this project's shared 2-core Xeon VM, launches stubbed"
_HOST_NOTE = (
    "host: 6 us per eager launch, 9 per Triton launch, 13 per sync (issue 19's published "
    "figures), 4 per store call; Python per MoE layer 95 us (device step; "
    f"{MEASURED_ON}) / 40 us (host step: assumed, not measured), 354 us per decoder layer "
    "(the model's own), 66 us per token, 3.4 ms hand-over per sequence (measured likewise)"
)
# The CPU as a resource (issue 27): the CPU expert kernels' bandwidth over host rows,
# assumed at 70% (issue 27's goal for the kernels) of a STREAM triad at 78% of the DRAM's
# peak (the efficiency TI's STREAM note SPRAD45A and llama.cpp PR #1642's M1 CPU figure
# show); the per-layer hand-off (psr's: four small device-to-pinned copies of the hidden
# state, ids, weights and CPU list, a CUDA host-function wake-up, one copy back and the
# merge; ExpertStore.cpu_experts) and the per-expert call are our assumptions, to be
# measured by the GPU script's experts_on stage (FreeToken #151: unpriced, such costs
# turned a measured-bandwidth choice 8.3x slower).
_CPU_DESKTOP = (
    "CPU: dual-channel DDR5-5600 (89.6 GB/s peak, ~70 GB/s triad), expert kernels 50 GB/s "
    "and 500 GFLOP/s over many rows; 15 us per layer hand-off, 1 us per expert (assumed)"
)
_CPU_SERVER = (
    "CPU: one server socket, 8-channel DDR5-4800 (Sapphire Rapids class: 307 GB/s peak, "
    "~240 GB/s triad), expert kernels 170 GB/s and 2 TFLOP/s over many rows; 15 us per "
    "layer hand-off, 1 us per expert (assumed)"
)


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
    # The host (host-aware model only; module docstring).
    launch_us: float = 6.0  # an eager (aten) op: Python, dispatch, launch
    triton_launch_us: float = 9.0  # a Triton kernel launch
    sync_us: float = 13.0  # a host read of device data once the device is idle
    store_call_us: float = 4.0  # a C++ store call: copies, acquire, release, gather, join
    python_us_per_layer: float = 40.0  # psr's Python per MoE layer, host-driven step
    device_python_us_per_layer: float = MEASURED_HOST["device_python_us_per_layer"]
    token_us: float = MEASURED_HOST["token_us"]  # the generation loop's Python per token
    small_kernel_us: float = 2.0  # GPU time of a routing/prediction/sampling kernel
    gather_gbps: float | None = None  # device-indexed gathers; None: as h2d copies
    graph_launch_us: float = 10.0  # replaying one captured decode token (graph mode)
    # the model's own Python per decoder layer, beyond its launches
    dense_python_us_per_layer: float = MEASURED_HOST["dense_python_us_per_layer"]
    begin_us: float = MEASURED_HOST["begin_us"]  # the cache hand-over, a sequence's 1st token
    # The CPU as a resource: routed experts computed from their host rows (LayerStep.
    # cpu_experts), on worker threads apart from the host's Python thread.
    cpu_gbps: float = 50.0  # the CPU expert kernels' achieved bandwidth over host rows
    cpu_layer_us: float = 15.0  # per layer with CPU work: hand-off, wake-up, merge
    cpu_expert_us: float = 1.0  # per CPU expert: its kernel call
    # The CPU expert kernels' achieved FLOP rate over many token rows: a verify block's
    # CPU expert reads its weights once for the block's rows routed to it (roofline,
    # `cpu_s`); `expert_flops` per token row (2 per weight of the modeled expert).
    cpu_gflops: float = 500.0
    expert_flops: int = OLMOE_EXPERT_BYTES  # bf16: 2 bytes, 2 FLOP per weight
    # A copy from the pageable tier (Copy.tier == "pageable", issue 28) first reads its
    # expert at this rate (NVMe 3-7 GB/s; the page cache at memcpy speed), then copies it.
    pageable_gbps: float = 5.0

    def read_s(self, c: Copy) -> float:
        """The extra read before copy `c` (0 for the pinned tier; traces without tiers)."""
        tier = getattr(c, "tier", "pinned")
        if tier == "pinned":
            return 0.0
        if tier == "pageable":
            return self.expert_bytes / (self.pageable_gbps * 1e9)
        raise ValueError(f"copy of expert {c.expert}: tier {tier!r} is not 'pinned' or 'pageable'")

    def cpu_s(self, experts: int, rows: int = 0) -> float:
        """A layer's CPU work for `experts` routed experts computing `rows` token rows in
        all (0: one row each, a decode token) (experts 0: none, no hand-off): the hand-off,
        a call per expert, and each expert's weights read once for all its rows or its
        rows' FLOPs, whichever takes longer (a verify block's few rows per expert stay
        bandwidth bound)."""
        if experts <= 0:
            return 0.0
        if rows and rows < experts:
            raise ValueError(f"{rows} CPU token rows for {experts} CPU experts (>= 1 each)")
        read = experts * self.expert_bytes / (self.cpu_gbps * 1e9)
        flops = max(rows, experts) * self.expert_flops / (self.cpu_gflops * 1e9)
        return (self.cpu_layer_us + experts * self.cpu_expert_us) * 1e-6 + max(read, flops)

    def copy_s(self) -> float:
        return self.expert_bytes / (self.h2d_gbps * 1e9) + self.copy_overhead_us * 1e-6

    def gather_s(self) -> float:
        """One expert copied by a gather kernel."""
        if self.gather_gbps is None:
            return self.copy_s()
        return self.expert_bytes / (self.gather_gbps * 1e9)

    def expert_s(self) -> float:
        return self.expert_bytes / (self.hbm_gbps * 1e9) + self.expert_overhead_us * 1e-6

    def dense_s(self) -> float:
        return self.dense_ms_per_layer * 1e-3

    def host_label(self, mode: str) -> str:
        """How a host-aware result names its host model, e.g.
        'host-aware(h200 device: 6/9/13 µs)' (eager launch / Triton launch / sync), or for
        graphs 'host-aware(h200 graph: 10/13 µs)' (graph launch / sync)."""
        if mode == "graph":
            return f"host-aware({self.name} graph: {self.graph_launch_us:g}/{self.sync_us:g} µs)"
        return (
            f"host-aware({self.name} {mode}: {self.launch_us:g}/{self.triton_launch_us:g}/"
            f"{self.sync_us:g} µs)"
        )

    def rates(self) -> Rates:
        """The figures a memory plan's modeled decode time reads (psr.models.memory_plan)."""
        return Rates(
            self.name, self.hbm_gbps, self.h2d_gbps, self.copy_overhead_us, self.cpu_gbps,
            self.cpu_layer_us, self.cpu_expert_us,
        )  # fmt: skip

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
        notes="RTX 4090, PCIe 4.0 x16: 0.5 ms per OLMoE expert copy, 0.3 ms dense per layer; "
        + _CPU_DESKTOP
        + "; "
        + _HOST_NOTE,
    ),
    "h200": Profile(
        "h200",
        h2d_gbps=55.0,
        copy_overhead_us=5.0,
        hbm_gbps=4000.0,
        expert_overhead_us=4.0,
        dense_ms_per_layer=0.08,
        cpu_gbps=170.0,
        cpu_gflops=2000.0,
        notes="H200 (PCIe 5.0 x16 host link, HBM3e): 0.23 ms per OLMoE expert copy; "
        + _CPU_SERVER
        + "; "
        + _HOST_NOTE,
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
    lower_bound_ms: float  # max(compute, bytes copied / bandwidth[, host busy]) per token
    compute_ms: float  # per token, no stalls
    copy_ms: float  # per token, copy link busy (copy stream and gathers)
    stall_ms: float  # per token, compute waiting on (or, gathers, running) copies
    per_token_ms: list[float]
    host_ms: float = 0.0  # per token, host busy (host-aware model)
    host_model: str = HOST_FREE  # "host-free" or Profile.host_label
    cpu_ms: float = 0.0  # per token, CPU expert work (LayerStep.cpu_experts)
    # Host-aware: a sequence's first decode token, which also hands the caches over to the
    # device step (begin_us) and, with graphs, runs eagerly (not in ms_per_token).
    first_token_ms: float = 0.0

    def as_dict(self, with_tokens: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_tokens:
            d.pop("per_token_ms")
        return d


def simulate(
    trace: Trace,
    profile: str | Profile,
    expert_bytes: int | None = None,
    draft_s: float = 0.0,
    *,
    host: bool = False,
    graph: bool = False,
) -> LatencyResult:
    """Modeled decode latency of `trace` under `profile` (see module docstring).

    `host`: replay the trace's measured host schedule (`trace.host`) on a host thread;
    without one (or with host=False) the model is host-free. `graph` (with `host`): the
    device-step schedule replayed as one captured graph per token (`HostSchedule.
    as_graph`, what CUDA runs by default); its `first_token_ms` is the eager token's.

    Speculative traces (`trace.emitted`): each step is a verify block whose dense work is
    priced as one token's (batch-1 weight reads dominate), whose experts are its set (each
    read once; its CPU experts each once for the block's rows routed to it, `cpu_s`), and
    which the drafter's `draft_s` precedes on the compute stream; ms per token divides by
    the tokens the steps emitted. Host-aware, a speculative trace needs a schedule measured
    from verify blocks (mode "verify"; `_HostAware`: the verify block's host-driven step,
    the drafter's and the loop's ops between blocks carrying `draft_s`)."""
    p = get_profile(profile)
    if trace.bytes_ratio != 1.0:  # a quantized format moves and reads fewer bytes
        p = replace(p, expert_bytes=round(p.expert_bytes * trace.bytes_ratio))
    if trace.emitted and len(trace.emitted) != len(trace.tokens):
        raise ValueError(
            f"trace has {len(trace.tokens)} steps but {len(trace.emitted)} emitted counts"
        )
    if expert_bytes is not None:
        p = replace(p, expert_bytes=expert_bytes)
    if host and trace.host is not None:
        verify = trace.host.mode == VERIFY
        if bool(trace.emitted) != verify:
            what = "speculative verify blocks" if trace.emitted else "decode tokens"
            raise ValueError(
                f"trace of {what} with a {trace.host.mode!r} host schedule: verify blocks "
                f"need a schedule measured from verify blocks ({VERIFY!r}), decode tokens one "
                "measured from decode tokens"
            )
        eager = _HostAware(trace, p, trace.host, draft_s).run()
        if verify:  # no cache hand-over: the verify block is the host-driven step
            return eager
        eager.first_token_ms = p.begin_us * 1e-3 + eager.ms_per_token
        if not graph:
            return eager
        res = _HostAware(trace, p, trace.host.as_graph()).run()
        res.first_token_ms = eager.first_token_ms
        return res
    if graph:
        raise ValueError("graph=True prices a measured device-step schedule: pass host=True")
    return _host_free(trace, p, draft_s)


def cpu_experts(step: LayerStep) -> int:
    """The step's routed experts computed on the CPU, checked against its routed count."""
    n = step.cpu_experts
    if not 0 <= n <= len(step.experts):
        raise ValueError(
            f"MoE layer {step.layer}: cpu_experts {n} is not in [0, {len(step.experts)}] "
            "(the routed experts)"
        )
    return n


def _decoder_layers(
    moe_at: dict[int, int], trace: Trace, steps: list[LayerStep], token: int
) -> Iterator[LayerStep | None]:
    """One token's decoder layers in order (both models walk them): each MoE layer's step
    (`moe_at`: decoder layer -> MoE layer), None for a dense layer."""
    by_layer = {s.layer: s for s in steps}
    for d in range(trace.num_decoder_layers):
        m = moe_at.get(d)
        if m is None:
            yield None
            continue
        step = by_layer.get(m)
        if step is None:
            raise ValueError(f"trace token {token} has no step for MoE layer {m}")
        yield step


def _host_free(trace: Trace, p: Profile, draft_s: float) -> LatencyResult:
    t_copy, t_exp, t_dense = p.copy_s(), p.expert_s(), p.dense_s()
    moe_at = {d: i for i, d in enumerate(trace.moe_layers)}
    ready: dict[tuple[int, int], float] = {}  # (layer, slot) -> copy done
    last_read: dict[tuple[int, int], float] = {}  # (layer, slot) -> last reader done
    now = copy_free = cpu_free = 0.0
    per_token: list[float] = []
    compute = copy_busy = stall = cpu_busy = 0.0
    for steps in trace.tokens:
        start = now
        if trace.emitted:
            now += draft_s
            compute += draft_s
        for step in _decoder_layers(moe_at, trace, steps, len(per_token)):
            now += t_dense
            compute += t_dense
            if step is None:
                continue
            m = step.layer
            n_cpu = cpu_experts(step)
            if n_cpu:  # the CPU starts once the layer has routed, beside the GPU's experts
                t_cpu = p.cpu_s(n_cpu, step.cpu_rows)
                cpu_free = max(cpu_free, now) + t_cpu
                cpu_busy += t_cpu
            for c in step.copies:  # issued once the layer has routed
                key = (c.layer, c.slot)
                begin = max(copy_free, now, last_read.get(key, 0.0))
                copy_free = begin + t_copy + p.read_s(c)
                copy_busy += t_copy + p.read_s(c)
                ready[key] = copy_free
            need = max((ready.get((m, s), 0.0) for s in step.slots), default=0.0)
            if need > now:
                stall += need - now
                now = need
            gpu = (len(step.experts) - n_cpu) * t_exp
            now += gpu
            compute += gpu
            for s in step.slots:
                last_read[(m, s)] = now
            if n_cpu and cpu_free > now:  # the layer's output merges the CPU's
                stall += cpu_free - now
                now = cpu_free
        per_token.append((now - start) * 1e3)
    n = max(sum(trace.emitted) if trace.emitted else len(trace.tokens), 1)
    comp_ms, copy_ms, cpu_ms = compute / n * 1e3, copy_busy / n * 1e3, cpu_busy / n * 1e3
    return LatencyResult(
        profile=p.name,
        tokens=n if trace.emitted else len(trace.tokens),
        ms_per_token=sum(per_token) / n,
        lower_bound_ms=max(comp_ms, copy_ms, cpu_ms),
        compute_ms=comp_ms,
        copy_ms=copy_ms,
        stall_ms=stall / n * 1e3,
        per_token_ms=per_token,
        cpu_ms=cpu_ms,
    )


# Ops after which a MoE layer's launches are its FFN (the expert kernels): the last of
# these in a layer is the last thing before the experts run.
_BEFORE_FFN = frozenset({"sync", "h2d", "copy", "wait", "gather", "join", "cpu"})
_TOKEN_KINDS = frozenset({"launch", "sync", "h2d"})
# "copy": priced when it copies. "cpu" / "cpu_join": the store calls; the CPU's experts
# are priced from the routing on, merged at the layer's end (`cpu_experts(step)`).
_STORE_CALLS = frozenset({"wait", "release", "gather", "join", "cpu", "cpu_join"})


def is_triton(op: HostOp) -> bool:
    """A Triton launch (named 'triton:<fn>' or, as psr_kernels names them, '<fn>_kernel')
    rather than an eager aten op."""
    return op.what.startswith("triton") or op.what.endswith("_kernel")


@dataclass(frozen=True)
class _Op:
    """A schedule op priced by a profile (seconds)."""

    kind: str
    host_s: float  # the host's own cost: its share of the layer's Python, launch, store call
    gpu_s: float = 0.0  # a launch's or gather kernel's own GPU time (not an FFN's)
    ffn: bool = False  # an FFN launch: carries a share of the layer's expert time
    what: str = ""
    side: bool = False  # a gather on the side stream


@dataclass(frozen=True)
class _Plan:
    ops: tuple[_Op, ...]
    ffn_launches: int


def _plan(ops: list[HostOp], p: Profile, python_s: float, where: str) -> _Plan:
    """Price a schedule's ops; `python_s` is spread evenly over them."""
    kinds = _TOKEN_KINDS if where == "token" else frozenset(HOST_OP_KINDS)
    for o in ops:
        if o.kind not in kinds:
            raise ValueError(
                f"host schedule {where}: op kind {o.kind!r} is not one of "
                f"{', '.join(sorted(kinds))}"
            )
        if o.kind == "gather" and o.stream not in ("compute", "side"):
            raise ValueError(
                f"host schedule {where}: a gather's stream is 'compute' or 'side', got {o.stream!r}"
            )
    first_ffn = 1 + max((i for i, o in enumerate(ops) if o.kind in _BEFORE_FFN), default=-1)
    share = python_s / len(ops) if ops else 0.0
    small = p.small_kernel_us * 1e-6
    out = []
    for i, o in enumerate(ops):
        if o.kind == "launch":
            ffn = where != "token" and i >= first_ffn
            cost = p.triton_launch_us if is_triton(o) else p.launch_us
            out.append(_Op("launch", share + cost * 1e-6, 0.0 if ffn else small, ffn))
        elif o.kind == "h2d":  # an eager op whose copy the host waits for
            out.append(_Op("h2d", share + p.launch_us * 1e-6))
        elif o.kind in _STORE_CALLS:
            gpu = small if o.kind == "gather" else 0.0
            out.append(_Op(o.kind, share + p.store_call_us * 1e-6, gpu, side=o.stream == "side"))
        else:  # sync; copy (its store call is priced when it copies)
            out.append(_Op(o.kind, share, what=o.what))
    return _Plan(tuple(out), sum(op.ffn for op in out))


def _slab_part(ops: list[HostOp], where: str) -> list[HostOp]:
    """A verify schedule's MoE layer up to its slab read's end (its last "release"); what
    follows is the CPU experts' hand-off, which the model prices itself (`_verify_cpu`:
    recorded on a CPU machine, its ops are the CPU kernels' host-side ops, not launches)."""
    ends = [i for i, o in enumerate(ops) if o.kind == "release"]
    if not ends:
        raise ValueError(
            f"verify host schedule {where}: no slab read (wait ... release); measure it from "
            "verify blocks that read the slab"
        )
    return ops[: ends[-1] + 1]


class _HostAware:
    """One host thread issuing a measured schedule to a compute stream, a copy stream
    (host-issued copies) and a side stream (forked gathers): module docstring."""

    def __init__(self, trace: Trace, p: Profile, sched: HostSchedule, draft_s: float = 0.0) -> None:
        self.trace, self.p, self.mode = trace, p, sched.mode
        self.label = p.host_label(sched.mode)
        self.verify = sched.mode == VERIFY
        self.draft_s = draft_s if self.verify else 0.0
        self.lead_s = 0.0  # host time before a token's GPU work can start
        if sched.mode == "graph":
            # The GPU replays the captured ops in their order; the host pays the loop's
            # Python and one graph launch before the token's work, and its read after.
            self.lead_s = (p.token_us + p.graph_launch_us) * 1e-6
            p = replace(
                p,
                launch_us=0.0,
                triton_launch_us=0.0,
                store_call_us=0.0,
                device_python_us_per_layer=0.0,
                dense_python_us_per_layer=0.0,
                token_us=0.0,
            )
            self.p = p
        host_step = sched.mode in ("host", VERIFY)
        py = p.python_us_per_layer if host_step else p.device_python_us_per_layer
        layer, last = sched.moe_layer, sched.last_moe_layer or sched.moe_layer
        if self.verify:
            layer, last = _slab_part(layer, "moe_layer"), _slab_part(last, "last_moe_layer")
        self.layer_plan = _plan(layer, p, py * 1e-6, "moe_layer")
        self.last_plan = _plan(last, p, py * 1e-6, "last_moe_layer")
        self.token_plan = _plan(sched.token, p, 0.0, "token")
        # A decoder layer's dense part: k launches of equal host cost and GPU time.
        dl = sched.dense_launches
        if dl < 0:
            raise ValueError(f"host schedule: dense_launches must be >= 0, got {dl}")
        self.dense_k = max(1, round(dl))
        self.dense_c = (dl * p.launch_us + p.dense_python_us_per_layer) * 1e-6 / self.dense_k
        self.dense_g = p.dense_s() / self.dense_k
        self.t_copy, self.t_gather, self.t_exp = p.copy_s(), p.gather_s(), p.expert_s()
        # Clocks: the host, the compute stream, the copy stream, the side stream.
        self.h = self.cf = self.copy_free = self.sf = self.cpu_free = 0.0
        self.ready: dict[tuple[int, int], float] = {}  # (layer, slot) -> copy done
        self.last_read: dict[tuple[int, int], float] = {}  # (layer, slot) -> reader done
        self.host_busy = self.compute = self.copy_busy = self.stall = self.cpu_busy = 0.0

    def _host(self, s: float) -> None:
        self.h += s
        self.host_busy += s

    def _sync(self) -> None:
        """The host waits for the compute stream to drain, then reads."""
        self.h = max(self.h, self.cf)
        self._host(self.p.sync_us * 1e-6)

    def _compute_waits(self, done: float) -> None:
        """The compute stream waits for an event that completes at `done`."""
        idle_from = max(self.cf, self.h)  # nothing it could run before the host issues it
        if done > idle_from:
            self.stall += done - idle_from
        self.cf = max(self.cf, done)

    def _dense(self) -> None:
        k, c, g = self.dense_k, self.dense_c, self.dense_g
        # k equal launches (host c, GPU g each) in closed form: the last one ends after the
        # stream's queue, the first launch's issue or the last launch's issue, plus its work.
        self.cf = max(self.cf + k * g, self.h + c + k * g, self.h + k * c + g)
        self._host(k * c)
        self.compute += k * g

    def _host_copies(self, step: LayerStep, kinds: tuple[str, ...], done: set[str]) -> None:
        """One store call issuing the step's copies of `kinds` on the copy stream now."""
        todo = [c for c in step.copies if c.kind in kinds and c.kind not in done]
        done.update(kinds)
        if not todo:
            return
        self._host(self.p.store_call_us * 1e-6)
        for c in todo:
            key = (c.layer, c.slot)
            begin = max(self.copy_free, self.h, self.last_read.get(key, 0.0))
            t = self.t_copy + self.p.read_s(c)
            self.copy_free = begin + t
            self.copy_busy += t
            self.ready[key] = self.copy_free

    def _gather(self, op: _Op, step: LayerStep, done: set[str]) -> None:
        kind = "prefetch" if op.side else "miss"
        copies = [c for c in step.copies if c.kind == kind]
        done.add(kind)
        busy = sum(self.t_gather + self.p.read_s(c) for c in copies)
        self.copy_busy += busy
        if op.side:  # forked from the compute stream: after everything issued to it
            self.sf = max(self.sf, self.h, self.cf) + op.gpu_s + busy
            end = self.sf
        else:  # inline on the compute stream: the copies are its stall
            self.cf = max(self.cf, self.h) + op.gpu_s + busy
            self.compute += op.gpu_s
            self.stall += busy
            end = self.cf
        for c in copies:
            self.ready[(c.layer, c.slot)] = end

    def _layer(self, m: int, step: LayerStep, plan: _Plan) -> None:
        n_cpu = cpu_experts(step)
        ffn_total = (len(step.experts) - n_cpu) * self.t_exp
        ffn_g = ffn_total / plan.ffn_launches if plan.ffn_launches else 0.0
        done: set[str] = set()
        routed_at: float | None = None  # when the compute stream has routed the layer
        for op in plan.ops:
            self._host(op.host_s)
            kind = op.kind
            if routed_at is None and (kind in _BEFORE_FFN or op.ffn):
                routed_at = max(self.cf, self.h)
            if kind == "launch":
                self.cf = max(self.cf, self.h) + (ffn_g if op.ffn else op.gpu_s)
                self.compute += 0.0 if op.ffn else op.gpu_s
            elif kind in ("sync", "h2d"):
                self._sync()
            elif kind == "copy":
                kinds = (op.what,) if op.what in ("miss", "prefetch") else ("miss", "prefetch")
                self._host_copies(step, kinds, done)
            elif kind == "wait":
                # Copies the schedule did not issue (its measured token had none there) are
                # issued by the acquire at the latest.
                self._host_copies(step, ("miss", "prefetch"), done)
                need = max((self.ready.get((m, s), 0.0) for s in step.slots), default=0.0)
                self._compute_waits(need)
            elif kind == "gather":
                self._gather(op, step, done)
            elif kind == "join":
                self._compute_waits(self.sf)
            # release: the store call only
        if not plan.ffn_launches:  # no FFN launch in the schedule: the experts run here
            self.cf = max(self.cf, self.h) + ffn_total
        self.compute += ffn_total
        for s in step.slots:
            self.last_read[(m, s)] = self.cf
        if n_cpu and self.verify:
            self._verify_cpu(self.p.cpu_s(n_cpu, step.cpu_rows))
        elif n_cpu:  # the CPU's experts, from the routing on; the output merges them
            begin = max(self.cpu_free, self.cf if routed_at is None else routed_at)
            self.cpu_free = begin + self.p.cpu_s(n_cpu, step.cpu_rows)
            self.cpu_busy += self.p.cpu_s(n_cpu, step.cpu_rows)
            self._compute_waits(self.cpu_free)
        missing = [c for c in step.copies if c.kind not in done]
        if missing:
            raise ValueError(
                f"host schedule ({self.mode} step) issues no {missing[0].kind} copies at MoE "
                f"layer {m}, but the trace has {len(missing)} there"
            )

    def _verify_cpu(self, t: float) -> None:
        """A verify block's CPU experts (HostDecode's synchronous hand-off): the host reads
        the layer's input once the compute stream is done (with the slab's experts), the
        CPU computes the experts while the host waits, the host copies the result back and
        launches the sum; the compute stream idles meanwhile (stall)."""
        self._sync()
        begin = max(self.h, self.cpu_free)
        self.cpu_free = begin + t
        self.cpu_busy += t
        self.stall += self.cpu_free - max(self.cf, begin)
        self.h = self.cpu_free
        self._host(2 * self.p.launch_us * 1e-6)  # the result's copy, the sum
        self.cf = max(self.cf, self.h) + self.p.small_kernel_us * 1e-6
        self.compute += self.p.small_kernel_us * 1e-6

    def _token_ops(self) -> None:
        """The loop's ops after a token (a verify block: the target's choices read, then
        the drafter's passes, whose GPU time `draft_s` is spread over their launches)."""
        self._host(self.p.token_us * 1e-6)
        launches = sum(op.kind == "launch" for op in self.token_plan.ops)
        draft = self.draft_s / launches if launches else 0.0
        if self.draft_s and not launches:  # the drafter's work with no launch recorded
            self.cf = max(self.cf, self.h) + self.draft_s
        self.compute += self.draft_s
        for op in self.token_plan.ops:
            self._host(op.host_s)
            if op.kind == "launch":
                self.cf = max(self.cf, self.h) + op.gpu_s + draft
                self.compute += op.gpu_s
            else:  # sync, h2d
                self._sync()

    def run(self) -> LatencyResult:
        trace, p = self.trace, self.p
        moe_at = {d: i for i, d in enumerate(trace.moe_layers)}
        last_m = len(trace.moe_layers) - 1
        per_token: list[float] = []
        end = 0.0
        for steps in trace.tokens:
            self._host(self.lead_s)
            for step in _decoder_layers(moe_at, trace, steps, len(per_token)):
                self._dense()
                if step is None:
                    continue
                m = step.layer
                self._layer(m, step, self.last_plan if m == last_m else self.layer_plan)
            self._token_ops()
            new_end = max(self.h, self.cf)  # the token is done on the host and the device
            per_token.append((new_end - end) * 1e3)
            end = new_end
        n = max(sum(trace.emitted) if trace.emitted else len(trace.tokens), 1)
        comp, copy, busy, cpu = (
            x / n * 1e3 for x in (self.compute, self.copy_busy, self.host_busy, self.cpu_busy)
        )
        return LatencyResult(
            profile=p.name,
            tokens=n if trace.emitted else len(trace.tokens),
            ms_per_token=sum(per_token) / n,
            lower_bound_ms=max(comp, copy, busy, cpu),
            compute_ms=comp,
            copy_ms=copy,
            stall_ms=self.stall / n * 1e3,
            per_token_ms=per_token,
            host_ms=busy,
            host_model=self.label,
            cpu_ms=cpu,
        )


# Host figures a GPU run can measure (the Profile fields of the same names).
HOST_KEYS = (
    "graph_launch_us",
    "launch_us",
    "triton_launch_us",
    "sync_us",
    "store_call_us",
    "python_us_per_layer",
    "device_python_us_per_layer",
    "token_us",
    "small_kernel_us",
    "gather_gbps",
    "dense_python_us_per_layer",
    "begin_us",
    "cpu_gbps",
    "cpu_layer_us",
    "cpu_expert_us",
    "cpu_gflops",
    "pageable_gbps",
)
_DEVICE_KEYS = ("h2d_gbps", "expert_ms", "dense_ms_per_layer", "expert_bytes")


def calibrate(name: str, measured: dict[str, float], base: str | Profile = "h200") -> Profile:
    """A profile from measured GPU figures: keys h2d_gbps, expert_ms, dense_ms_per_layer,
    expert_bytes, and the host's HOST_KEYS (launch_us, sync_us, ...), any subset; the rest
    from `base`."""
    unknown = sorted(set(measured) - set(_DEVICE_KEYS) - set(HOST_KEYS))
    if unknown:
        raise ValueError(
            f"calibrate: unknown measured figure(s) {', '.join(unknown)}; "
            f"known: {', '.join(_DEVICE_KEYS + HOST_KEYS)}"
        )
    p = get_profile(base)
    kw: dict[str, Any] = {"name": name, "notes": f"calibrated from a measured run (base {p.name})"}
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
    host = {k: float(measured[k]) for k in HOST_KEYS if k in measured}
    for k, v in host.items():
        if not v >= 0 or (k in ("gather_gbps", "cpu_gbps", "pageable_gbps") and v == 0):
            raise ValueError(f"calibrate: {k} must be a number >= 0 (a bandwidth > 0), got {v}")
    if host:
        kw["notes"] += f"; host measured: {', '.join(sorted(host))}"
    kw.update(host)
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
