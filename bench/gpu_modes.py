"""Decode modes, eager vs graphs: what `python bench/gpu_decode.py --modes host,device,graphs`
measures (docs/gpu.md, "Decode modes").

The OLMoE-1B-7B-shaped random model (gpu_decode.build), exact / psr / cache-prior at the
embedded model's operating points, 50% and 25% residency, each decoded greedily in three
modes of one offloaded model:
  host    host-driven: psr.load(..., decode="host", graphs=False), the store-driven step
          (the host reads the routing, issues cudaMemcpyAsync copies, syncs per token);
  device  sync-free eager: decode="device", graphs=False (psr's MoE path never reads the
          device; every kernel is still launched from Python);
  graphs  decode="device", graphs=True: one replay of a captured decode forward per token
          (CUDA: a torch.cuda.CUDAGraph; on the CPU, --cpu-graphs: "uncompiled" runs the
          same static-cache path with torch.compile replaced by the identity, so the
          rehearsal stays quick; "inductor" compiles as psr does; "skip").
Per (residency, policy, mode): a warm-up generate (host mode: recording the routing trace
the model replays; graphs: capturing), then
  ms_per_token   a timed generate, time-stamped by a streamer as each new token reaches
                 the host: (last stamp - stamp of token FIRST) / tokens between, so
                 prefill, the eager hand-over token and the call's own set-up are out;
  counts         tokens, hits, misses, prefetches of that generate (psr's stats);
  profile        a second generate, torch.profiler running from token FIRST for WINDOW
                 tokens (started and stopped by the streamer): per token, CUDA runtime and
                 driver API calls (`api_calls_per_token`), kernels (`kernels_per_token`;
                 CPU: top-level aten ops, there is no CUDA) and memcpy/memset activities;
  host time      `host_ms`: the window's wall time per token minus the time the host spent
                 blocked in synchronising CUDA calls (cuda*/cu*Synchronize, cudaMemcpy):
                 the time the host thread was busy (Python, dispatch, launches), an upper
                 bound as the profiler adds its own cost per op; `host_share` = host_ms /
                 the window's ms per token. On the CPU nothing is a device wait: host_ms is
                 the window's wall time.
The latency model (psr.eval.latency, a profile calibrated here: the store's gather and DMA
GB/s for k rows of this model's experts, one expert's FFN, the dense time per layer of the
all-resident exact run in graphs mode, and the host's launch and sync costs measured
here):
  host-free   simulate(trace, profile): copies and compute alone (device modes: copies
              priced at the gather's GB/s, the host mode's at the DMA's);
  host-aware  simulate(trace + schedule, profile, host=True), the schedule measured by
              psr.eval.host_probe.measure_schedule in that mode (graphs: the device mode's
              schedule with the in-graph host costs set to 0: the host launches one replay
              and reads the token, `graph_profile`). Its `model_error` = modeled /
              measured - 1.
Checks (issue 20's goals, read by gpu_summary.py): graphs within 1.25x of the host-free
modeled ms/token; psr vs exact (graphs) at least 0.9 of the modeled host-free speedup; host
time under 10% of ms/token (graphs); tokens and hit/miss/prefetch counts equal across the
modes. DIR/modes.json is rewritten after every run (a timeout keeps what was done), then
DIR/modes.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from common import write_json
from gpu_gather import measure as measure_gather
from torch.autograd import DeviceType

from psr.eval import latency
from psr.eval.labels import pct
from psr.eval.latency import Profile, calibrate, simulate
from psr.models import DEFAULT_MODEL
from psr.points import operating_points
from psr.policy import Policy, make_policy, standard_policies

MODES = {"host": ("host", False), "device": ("device", False), "graphs": ("device", True)}
MODE_LABELS = {"host": "host-driven", "device": "sync-free eager", "graphs": "graphs"}
POLICIES = ("exact", "psr", "cache-prior")  # exact and psr first: the goals compare them
COUNTS = ("tokens", "hits", "misses", "prefetches")  # equal across modes
API_ACTIVITIES = frozenset({"cuda_runtime", "cuda_driver"})
COPY_ACTIVITIES = frozenset({"gpu_memcpy", "gpu_memset"})
BLOCKING_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
    }
)
GRAPH_STEP_LAUNCHES = 3  # DecodeGraph.step: the token and position copies, the replay
SCHEDULE_PROMPT, SCHEDULE_TOKENS = 8, 3  # as psr.eval.harness measures schedules
# Issue 20's goals (gpu_summary.py reads the same fields).
GOAL_GRAPHS_VS_HOST_FREE = 1.25
GOAL_SPEEDUP_FRACTION = 0.90
GOAL_HOST_SHARE = 0.10


def host_model_api() -> tuple[Callable[..., Any] | None, str]:
    """psr.eval.host_probe.measure_schedule and simulate(..., host=True), or why not."""
    try:
        from psr.eval.host_probe import measure_schedule
    except ImportError as e:
        return None, f"not available: {type(e).__name__}: {e}"
    if "host" not in inspect.signature(simulate).parameters:
        return None, "not available: psr.eval.latency.simulate has no host= argument"
    return measure_schedule, "available"


def parser(ap: argparse.ArgumentParser) -> None:
    """gpu_decode.py's options for --modes."""
    ap.add_argument(
        "--modes",
        default=None,
        help="measure these decode modes (host,device,graphs) into modes.json instead of "
        "the four-policy run",
    )
    ap.add_argument("--policies", default=",".join(POLICIES), help="with --modes")
    ap.add_argument("--residencies", default="0.5,0.25", help="with --modes")
    ap.add_argument("--window", type=int, default=None, help="profiled tokens (8; tiny 4)")
    ap.add_argument(
        "--cpu-graphs",
        choices=("uncompiled", "inductor", "skip"),
        default="uncompiled",
        help="graphs mode on the CPU (module docstring of bench/gpu_modes.py)",
    )


# --- measuring one generate ------------------------------------------------------------
class Clock:
    """A streamer (transformers' protocol) that time-stamps each new token as the host has
    read it and, given a profiler, runs it over tokens (start, stop]."""

    def __init__(self, prof: Any = None, start: int = 0, stop: int = -1) -> None:
        self.stamps: list[float] = []
        self.prof, self.start, self.stop = prof, start, stop
        self.profiling = False
        self._prompt = True

    def put(self, value: Any) -> None:
        if self._prompt:  # the prompt comes first
            self._prompt = False
            return
        i = len(self.stamps)
        if self.prof is not None and i == self.stop:
            self.stamps.append(time.perf_counter())
            self.profiling = False
            self.prof.stop()
            return
        if self.prof is not None and i == self.start:
            self.prof.start()
            self.profiling = True
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def seconds(self, first: int, last: int | None = None) -> tuple[float, int]:
        """Wall time from token `first`'s stamp to token `last`'s, and the tokens between."""
        last = len(self.stamps) - 1 if last is None else last
        if last <= first:
            raise ValueError(f"too few tokens: stamps {len(self.stamps)}, first {first}")
        return self.stamps[last] - self.stamps[first], last - first

    def median_ms(self, first: int) -> float:
        """The median time between consecutive tokens after `first` (robust to a stray
        stall of the machine; ms_per_token is the mean)."""
        st = self.stamps[first:]
        return statistics.median(b - a for a, b in pairwise(st)) * 1e3


def top_level(ops: list[tuple[int, int, int]]) -> int:
    """Ops (thread, start, end) not nested in another op of their thread."""
    n, ends = 0, {}
    for th, start, end in sorted(ops, key=lambda o: (o[0], o[1], -o[2])):
        if start >= ends.get(th, -1):
            n += 1
            ends[th] = end
    return n


def activity(e: Any) -> str:
    """A profiler event's kineto activity ("kernel", "cuda_runtime", "cpu_op", ...); from
    its device and name where torch's event does not say."""
    kind = getattr(e, "activity_type", None)
    if kind is not None:
        return str(kind())
    name = e.name()
    if e.device_type() == DeviceType.CUDA:
        return "gpu_memcpy" if name.startswith(("Memcpy", "Memset")) else "kernel"
    return "cuda_runtime" if re.match(r"cu(da)?[A-Z]", name) else "cpu_op"


def window_counts(prof: Any, wall_s: float, tokens: int, cuda: bool) -> dict[str, float]:
    """Per token of a profiled window (module docstring): API calls, kernels, memcpys,
    blocked and host time."""
    api = kernels = copies = 0
    blocked_ns = 0
    cpu_ops: list[tuple[int, int, int]] = []
    for e in prof.profiler.kineto_results.events():
        kind = activity(e)
        if kind in API_ACTIVITIES:
            api += 1
            if e.name() in BLOCKING_CALLS:
                blocked_ns += e.duration_ns()
        elif kind == "kernel":
            kernels += 1
        elif kind in COPY_ACTIVITIES:
            copies += 1
        elif kind == "cpu_op" and not cuda:
            cpu_ops.append((e.start_thread_id(), e.start_ns(), e.start_ns() + e.duration_ns()))
    if not cuda:
        kernels = top_level(cpu_ops)
    host_s = max(0.0, wall_s - blocked_ns * 1e-9)
    return {
        "api_calls_per_token": api / tokens,
        "kernels_per_token": kernels / tokens,
        "memcpys_per_token": copies / tokens,
        "profiled_ms_per_token": wall_s / tokens * 1e3,
        "blocked_ms": blocked_ns * 1e-6 / tokens,
        "host_ms": host_s / tokens * 1e3,
        "host_share": host_s / wall_s if wall_s > 0 else math.nan,
    }


@contextmanager
def uncompiled() -> Iterator[None]:
    """torch.compile as the identity: psr's CPU graph path captures the eager forward over
    its static cache (what the rehearsal runs; inductor is tests/runtime/test_graphs.py's)."""
    orig = torch.compile
    torch.compile = lambda fn=None, **kw: fn  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = orig


@dataclasses.dataclass
class Setup:
    om: Any
    prompt: torch.Tensor
    tokens: int  # new tokens per timed generate
    first: int  # the first stamped token timed (the ones before are set-up)
    window: int  # profiled tokens
    cpu_graphs: str
    cuda: bool

    def path(self, mode: str) -> Any:
        """The context a mode's generates run in."""
        if mode == "graphs" and not self.cuda and self.cpu_graphs == "uncompiled":
            return uncompiled()
        return nullcontext()


def set_mode(s: Setup, mode: str, policy: Policy, slots: int) -> None:
    decode, graphs = MODES[mode]
    s.om.runtime.set_decode(decode)
    s.om.graphs = graphs
    s.om.configure(policy, slots=slots)


def measure_mode(s: Setup, mode: str, policy: Policy, slots: int) -> tuple[dict, Any, Any]:
    """One mode's warm-up (host: the trace), timed and profiled generates: (row, ids, trace)."""
    om = s.om
    set_mode(s, mode, policy, slots)
    with s.path(mode):
        rec = om.record_trace() if mode == "host" else None
        om.reset_stats()
        om.generate(s.prompt, s.tokens)
        om.runtime.recorder = None
        captures = om.stats.summary().get("captures", 0)  # graphs: captured in the warm-up
        om.reset_stats()
        clock = Clock()
        ids = om.generate(s.prompt, s.tokens, streamer=clock)
        st = om.stats.summary()
        status = om.graph_status
        wall, n = clock.seconds(s.first)
        counts = profiled(s)
    row = {
        "mode": mode,
        "mode_label": MODE_LABELS[mode],
        "decode": MODES[mode][0],
        "graphs": MODES[mode][1],
        "graph_status": status,
        "graphs_used": status.startswith("on"),
        "captures": captures + st.get("captures", 0),
        "ms_per_token": wall / n * 1e3,
        "ms_per_token_median": clock.median_ms(s.first),
        "timed_tokens": n,
        **{k: st[k] for k in (*COUNTS, "prefetch_used", "copies", "hit_rate", "stall_s")},
        "misses_per_token": st["misses_per_token"],
        **counts,
    }
    return row, ids.cpu(), None if rec is None else rec.trace


PROFILE_KEYS = (
    "api_calls_per_token",
    "kernels_per_token",
    "memcpys_per_token",
    "profiled_ms_per_token",
    "blocked_ms",
    "host_ms",
    "host_share",
)


def profiled(s: Setup) -> dict[str, Any]:
    """A generate as long as the timed one (the same static cache: no capture while
    profiling) with the profiler over tokens (first, first + window]: window_counts. A
    profiler that fails or sees no kernel on CUDA leaves the row its time, and says why."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if s.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)
    clock = Clock(prof, s.first, s.first + s.window)
    try:
        s.om.generate(s.prompt, s.tokens, streamer=clock)
        wall, n = clock.seconds(s.first, s.first + s.window)
        counts: dict[str, Any] = window_counts(prof, wall, n, s.cuda)
    except Exception as e:
        if clock.profiling:  # the next profile must be able to start
            with contextlib.suppress(Exception):
                prof.stop()
        return {**dict.fromkeys(PROFILE_KEYS), "profile_error": f"{type(e).__name__}: {e}"[:300]}
    counts["profile_error"] = None
    if s.cuda and counts["kernels_per_token"] == 0:
        counts["kernels_per_token"] = None
        counts["profile_error"] = "the profiler saw no kernel (CUPTI activity tracing off?)"
    return counts


# --- the model ---------------------------------------------------------------------------
def host_costs(device: str, n: int = 400) -> dict[str, float]:
    """The host's cost of an eager op (launch_us: Python, dispatch, launch of a tiny add_)
    and of a read of device data once it is idle (sync_us: `.item()`), measured here."""
    x = torch.zeros(16, device=device)
    y = torch.zeros((), device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(20):
        x.add_(1)
        y.item()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    launch = (time.perf_counter() - t) / n
    sync()
    reads = []
    for _ in range(n // 4):
        t = time.perf_counter()
        y.item()
        reads.append(time.perf_counter() - t)
    return {"launch_us": launch * 1e6, "sync_us": statistics.median(reads) * 1e6}


def graph_profile(p: Profile, schedule: Any) -> Profile:
    """The host-aware model of a graph replay (psr.eval.latency's graph mode, fed
    `schedule.as_graph()`): the host's per-token work is the loop's launches plus
    DecodeGraph.step's input copies and the replay (each launch_us), then the token's read."""
    launches = sum(op.kind == "launch" for op in schedule.token) + GRAPH_STEP_LAUNCHES
    return dataclasses.replace(p, graph_launch_us=launches * p.launch_us)


def model_row(row: dict, trace: Any, profile: Profile, schedule: Any) -> None:
    """The row's host-free and host-aware modeled ms/token (module docstring)."""
    free = simulate(trace, profile)
    row["modeled_host_free_ms"] = free.ms_per_token
    row["host_free_lower_bound_ms"] = free.lower_bound_ms
    row["measured_vs_host_free"] = row["ms_per_token"] / free.ms_per_token
    row["host_model"] = schedule if isinstance(schedule, str) else None
    row["modeled_host_aware_ms"] = row["modeled_host_ms"] = row["model_error"] = None
    if isinstance(schedule, str):  # why there is no host-aware figure
        return
    graphs = row["mode"] == "graphs"
    p = graph_profile(profile, schedule) if graphs else profile
    sched = schedule.as_graph() if graphs else schedule
    aware = simulate(dataclasses.replace(trace, host=sched), p, host=True)
    row["modeled_host_aware_ms"] = aware.ms_per_token
    row["modeled_host_ms"] = aware.host_ms
    row["model_error"] = aware.ms_per_token / row["ms_per_token"] - 1
    row["host_model"] = aware.host_model


def schedule_for(
    s: Setup, mode: str, policy: Policy, slots: int, measure: Callable[..., Any] | None, why: str
) -> Any:
    """The mode's host schedule (graphs: the device step's), or a string saying why not."""
    if measure is None:
        return why
    set_mode(s, "device" if mode == "graphs" else mode, policy, slots)
    try:
        return measure(s.om, s.prompt[:, :SCHEDULE_PROMPT], SCHEDULE_TOKENS)
    except Exception as e:  # a measurement that fails costs this row its host-aware figure
        return f"schedule failed: {type(e).__name__}: {e}"[:300]


# --- calibration -------------------------------------------------------------------------
def calibrate_modes(s: Setup, cfg: Any, expert_ms: float, modes: list[str]) -> dict:
    """The figures the profile takes (module docstring); dense time from the all-resident
    exact run in the most host-free mode measured."""
    om = s.om
    rt = om.runtime
    k = cfg.num_experts_per_tok
    g = measure_gather(rt.expert_bytes, k, 5 if s.cuda else 3, rt.store.backend)
    full_mode = next(m for m in ("graphs", "device", "host") if m in modes)
    if full_mode == "graphs" and not s.cuda and s.cpu_graphs == "skip":
        full_mode = "device"
    set_mode(s, full_mode, make_policy("exact"), cfg.num_experts)
    with s.path(full_mode):
        om.generate(s.prompt, s.tokens)
        clock = Clock()
        om.generate(s.prompt, s.tokens, streamer=clock)
    wall, n = clock.seconds(s.first)
    full_ms = wall / n * 1e3
    dense = max(0.0, (full_ms - len(rt.layers) * k * expert_ms) / cfg.num_hidden_layers)
    return {
        "expert_bytes": rt.expert_bytes,
        "gather_gbps": g["gather_gbps"],
        "side_gbps": g["side_gbps"],
        "dma_gbps": g["dma_gbps"],
        "gather_verified": g["verified"],
        "expert_ms": expert_ms,
        "full_mode": full_mode,
        "full_ms_per_token": full_ms,
        "dense_ms_per_layer": dense,
        **host_costs("cuda" if s.cuda else "cpu"),
    }


def profiles(cal: dict) -> dict[str, Profile]:
    """Per step: the host step copies with the DMA engine, the device step gathers. The
    host's measured costs go in where the latency model has host fields (HOST_KEYS)."""
    host_keys = set(getattr(latency, "HOST_KEYS", ()))
    base = {k: cal[k] for k in ("expert_ms", "dense_ms_per_layer", "expert_bytes")}
    base |= {k: cal[k] for k in ("launch_us", "sync_us") if k in host_keys}
    device = {**base, "h2d_gbps": cal["gather_gbps"]}
    if "gather_gbps" in host_keys:
        device["gather_gbps"] = cal["gather_gbps"]
    return {
        "host": calibrate("modes-host", {**base, "h2d_gbps": cal["dma_gbps"]}),
        "device": calibrate("modes-device", device),
    }


# --- the run -----------------------------------------------------------------------------
def policies_at(rho: float, names: list[str]) -> list[Policy]:
    pts = {p.name: p for p in standard_policies(operating_points(DEFAULT_MODEL, rho))}
    unknown = [n for n in names if n not in pts]
    if unknown:
        raise ValueError(f"--policies: unknown {unknown}; known {sorted(pts)}")
    return [pts[n] for n in names]


def record_trace(s: Setup, policy: Policy, slots: int) -> Any:
    """The routing trace of one generate (host-driven: recording takes that step; the
    modes give the same routing), when the host mode was not measured."""
    set_mode(s, "host", policy, slots)
    rec = s.om.record_trace()
    try:
        s.om.generate(s.prompt, s.tokens)
    finally:
        s.om.runtime.recorder = None
    return rec.trace


def skipped_row(mode: str, why: str) -> dict:
    return {"mode": mode, "mode_label": MODE_LABELS[mode], "status": f"skipped: {why}"}


def run_config(
    s: Setup, modes: list[str], policy: Policy, slots: int, sched: dict, profs: dict
) -> tuple[list[dict], dict]:
    """Every mode of one (policy, residency): the rows and the equality check."""
    rows, ids, trace = [], {}, None
    for mode in modes:
        if mode == "graphs" and not s.cuda and s.cpu_graphs == "skip":
            rows.append(skipped_row(mode, "--cpu-graphs skip (tests/runtime/test_graphs.py)"))
            continue
        try:
            row, out, tr = measure_mode(s, mode, policy, slots)
        except Exception as e:  # one mode failing leaves the others measured
            rows.append({**skipped_row(mode, ""), "status": f"failed: {type(e).__name__}: {e}"})
            continue
        row["status"] = "ok"
        trace = tr if tr is not None else trace
        ids[mode] = (out, {k: row[k] for k in COUNTS})
        rows.append(row)
    if trace is None and any(r["status"] == "ok" for r in rows):
        trace = record_trace(s, policy, slots)
    for row in rows:
        if row["status"] == "ok" and trace is not None:
            prof = profs["host" if row["mode"] == "host" else "device"]
            model_row(row, trace, prof, sched.get(row["mode"], "no schedule"))
    return rows, equality(ids)


def equality(ids: dict[str, tuple[torch.Tensor, dict]]) -> dict:
    """Tokens and counts of every measured mode against the first one's."""
    modes = list(ids)
    if not modes:
        return {"modes": [], "tokens_equal": None, "counts_equal": None, "counts": {}}
    ref_ids, ref_counts = ids[modes[0]]
    return {
        "modes": modes,
        "tokens_equal": all(torch.equal(o, ref_ids) for o, _ in ids.values()),
        "counts_equal": all(c == ref_counts for _, c in ids.values()),
        "counts": {m: c for m, (_, c) in ids.items()},
    }


def add_speedups(rows: list[dict]) -> None:
    """Per mode and residency, vs exact in the same mode: measured, modeled host-free, and
    their ratio (the fraction of the modeled speedup realised)."""
    ok = [r for r in rows if r.get("status") == "ok" and "modeled_host_free_ms" in r]
    for r in ok:
        base = next(
            (
                b
                for b in ok
                if b["policy_name"] == "exact"
                and b["mode"] == r["mode"]
                and b["residency"] == r["residency"]
            ),
            None,
        )
        if base is None:
            continue
        r["speedup_vs_exact"] = base["ms_per_token"] / r["ms_per_token"]
        r["modeled_host_free_speedup_vs_exact"] = (
            base["modeled_host_free_ms"] / r["modeled_host_free_ms"]
        )
        r["speedup_fraction"] = r["speedup_vs_exact"] / r["modeled_host_free_speedup_vs_exact"]


def _agg(values: list[Any], fn: Callable[[list[float]], float]) -> float | None:
    xs = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return fn(xs) if xs else None


def mismatches(equal: list[dict]) -> int | None:
    """Configurations whose modes disagree on tokens or counts (None: none compared)."""
    compared = [e for e in equal if len(e["modes"]) > 1]
    if not compared:
        return None
    return sum(not (e["tokens_equal"] and e["counts_equal"]) for e in compared)


def checks(rows: list[dict], equal: list[dict]) -> dict:
    """Issue 20's goals over the graphs rows (where graphs ran), and the modes' agreement."""
    g = [r for r in rows if r.get("status") == "ok" and r["mode"] == "graphs" and r["graphs_used"]]
    psr = [r for r in g if r["policy_name"] == "psr"]
    out = {
        "graphs_vs_host_free_max": _agg([r.get("measured_vs_host_free") for r in g], max),
        "psr_speedup_fraction_min": _agg([r.get("speedup_fraction") for r in psr], min),
        "graphs_host_share_max": _agg([r.get("host_share") for r in g], max),
        "mode_mismatches": mismatches(equal),
        "max_abs_model_error": {},
    }
    for mode in MODES:
        errs = [r.get("model_error") for r in rows if r.get("mode") == mode]
        out["max_abs_model_error"][mode] = _agg([abs(e) for e in errs if e is not None], max)
    out["goals"] = {
        "graphs_vs_host_free_max": f"<= {GOAL_GRAPHS_VS_HOST_FREE}",
        "psr_speedup_fraction_min": f">= {GOAL_SPEEDUP_FRACTION}",
        "graphs_host_share_max": f"<= {GOAL_HOST_SHARE}",
        "mode_mismatches": "0",
    }
    return out


def run(
    om: Any, cfg: Any, args: argparse.Namespace, out: Path, meta: dict, expert_ms: float
) -> int:
    """The --modes measurement (module docstring); `meta` goes into modes.json as is."""
    t0 = time.time()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; known {list(MODES)}")
    E = cfg.num_experts
    prompt = torch.randint(
        0, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1)
    ).to(om.device)
    first = 2  # the prefill's token and the eager hand-over token are set-up
    window = min(args.window or (4 if args.tiny else 8), args.tokens - 1 - first)
    s = Setup(
        om, prompt, args.tokens, first, window, args.cpu_graphs, om.runtime.store.backend == "cuda"
    )
    if args.tokens < first + 2:
        raise SystemExit(f"--tokens must be >= {first + 2} with --modes")
    measure, why = host_model_api()
    cal = calibrate_modes(s, cfg, expert_ms, modes)
    profs = profiles(cal)
    for name, p in profs.items():
        p.save(out / f"modes_profile_{name}.json")
    result = {
        "status": "running",
        **meta,
        "modes": modes,
        "tokens": args.tokens,
        "first_timed_token": first,
        "window": window,
        "prompt_tokens": args.prompt,
        "cpu_graphs": None if s.cuda else args.cpu_graphs,
        "host_model": why,
        "calibration": cal,
        "rows": [],
        "equal": [],
    }
    names = [n for n in args.policies.split(",") if n]
    schedules: dict[tuple[str, str], Any] = {}
    for rho in (float(x) for x in args.residencies.split(",") if x):
        slots = round(rho * E)
        for policy in policies_at(rho, names):
            sched = {}
            for mode in modes:  # a schedule depends on the policy and mode, not residency
                key = (policy.name, "device" if mode == "graphs" else mode)
                if key not in schedules:
                    schedules[key] = schedule_for(s, mode, policy, slots, measure, why)
                sched[mode] = schedules[key]
            rows, eq = run_config(s, modes, policy, slots, sched, profs)
            tag = {"residency": slots / E, "slots": slots, "policy": policy.describe()}
            for r in rows:
                r.update(tag, policy_name=policy.name)
            result["rows"] += rows
            result["equal"].append({**tag, **eq})
            add_speedups(result["rows"])
            result["checks"] = checks(result["rows"], result["equal"])
            result["seconds"] = time.time() - t0
            write_json(out / "modes.json", result)
            (out / "modes.md").write_text(tables(result) + "\n")
            for r in rows:
                print(line(r), flush=True)
    print(tables(result))
    result["status"] = "complete"
    result["seconds"] = time.time() - t0
    write_json(out / "modes.json", result)
    return 0


# --- output ------------------------------------------------------------------------------
def _f(v: Any, spec: str) -> str:
    return "-" if not isinstance(v, (int, float)) or not math.isfinite(v) else format(v, spec)


def line(r: dict) -> str:
    head = f"{pct(r['residency'])} {r['policy']:<24} {r['mode']:<7}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status')}"
    return (
        f"{head} {r['ms_per_token']:8.2f} ms/tok (host-free {_f(r['modeled_host_free_ms'], '.2f')}"
        f", host-aware {_f(r['modeled_host_aware_ms'], '.2f')}), API "
        f"{_f(r['api_calls_per_token'], '.0f')}/tok, kernels {_f(r['kernels_per_token'], '.0f')}"
        f"/tok, host {_f(r['host_share'], '.0%')}; {r['graph_status']}"
    )


def tables(result: dict) -> str:
    cal = result["calibration"]
    lines = [
        f"calibrated here: gather {cal['gather_gbps']:.2f} GB/s (side+join "
        f"{cal['side_gbps']:.2f}), DMA {cal['dma_gbps']:.2f} GB/s, expert "
        f"{cal['expert_ms'] * 1e3:.1f} us, dense {cal['dense_ms_per_layer'] * 1e3:.1f} us/layer "
        f"({cal['full_mode']}, all resident: {cal['full_ms_per_token']:.2f} ms/tok), launch "
        f"{cal['launch_us']:.1f} us, sync {cal['sync_us']:.1f} us; host-aware model: "
        f"{result['host_model']}",
        "",
        "| residency | policy | mode | ms/tok | host-free ms | measured / host-free | "
        "host-aware ms | model error | speedup vs exact | modeled (host-free) | fraction | "
        "API calls/tok | kernels/tok | host ms/tok | host share | misses/tok | graphs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        head = f"| {pct(r['residency'])} | {r['policy']} | {r['mode_label']} |"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')} |" + " |" * 13)
            continue
        lines.append(
            f"{head} {r['ms_per_token']:.2f} | {_f(r.get('modeled_host_free_ms'), '.2f')} | "
            f"{_f(r.get('measured_vs_host_free'), '.2f')}x | "
            f"{_f(r.get('modeled_host_aware_ms'), '.2f')} | {_f(r.get('model_error'), '+.1%')} | "
            f"{_f(r.get('speedup_vs_exact'), '.2f')}x | "
            f"{_f(r.get('modeled_host_free_speedup_vs_exact'), '.2f')}x | "
            f"{_f(r.get('speedup_fraction'), '.2f')} | {_f(r['api_calls_per_token'], '.1f')} | "
            f"{_f(r['kernels_per_token'], '.1f')} | {_f(r['host_ms'], '.3f')} | "
            f"{_f(r['host_share'], '.1%')} | {r['misses_per_token']:.2f} | {r['graph_status']} |"
        )
    lines += [
        f"* profiler, {pct(r['residency'])} {r['policy']} {r['mode']}: {r['profile_error']}"
        for r in result["rows"]
        if r.get("profile_error")
    ]
    lines += [
        "",
        "| residency | policy | modes | tokens equal | hits / misses / prefetches equal |",
        "|---|---|---|---|---|",
    ]
    for e in result["equal"]:
        counts = "; ".join(
            f"{m} {c['hits']:.0f}/{c['misses']:.0f}/{c['prefetches']:.0f}"
            for m, c in e["counts"].items()
        )
        lines.append(
            f"| {pct(e['residency'])} | {e['policy']} | {', '.join(e['modes'])} | "
            f"{e['tokens_equal']} | {e['counts_equal']} ({counts}) |"
        )
    return "\n".join(lines)
