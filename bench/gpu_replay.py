"""Trace replay: the embedded model's decode traces, replayed with OLMoE-1B-7B-sized experts
on this machine's expert store and Triton expert kernel, against the latency model.

    python bench/gpu_replay.py --out DIR              # GPU: 4 prompts x 48 tokens, OLMoE experts
    python bench/gpu_replay.py --out DIR --tiny       # CPU rehearsal: tiny shapes, short loops

1. Traces: the embedded model (psr.DEFAULT_MODEL, float32, on the CPU) greedily decodes
   held-out prompts under each standard policy at its operating points
   (`standard_policies(operating_points(DEFAULT_MODEL, rho))`) at 50% and 25% residency,
   recording per decode token and MoE layer the slots read and the copies issued.
2. Store: one ExpertStore (cuda backend on a GPU) with as many layers, experts and slots
   as the traces use, each expert 3 x 2048 x 1024 bf16 = 12.6 MB in pinned host memory.
3. Replay, per decoder layer of each token: the dense stand-in (a bf16 GEMV loop, or
   `torch.cuda._sleep`, sized to the H200 profile's dense_ms_per_layer); at a MoE layer
   the host waits for the compute stream (batch-1 routing puts the router's ids on the
   host, as the runtime's does), enqueues the step's copies on the store's copy stream
   in trace order, then acquire -> psr_kernels.expert_ffn on the slab's slots -> release.
   ms/token from CUDA events over whole traces, after a warm-up, median of repeats.
4. Model: a profile calibrated on this machine (`psr.eval.latency.calibrate`) from the
   store's measured copy GB/s, the dense stand-in alone, and the replay without copies
   (expert time); `simulate` of each trace under it vs the measured ms/token: the model
   error, and the speedup vs exact measured vs modeled.
5. Quantized experts (`--formats`, default int8,int4,fp8, in that order; `--format-policies`,
   default exact,psr): per format a second store of that format's uint8 rows
   (`psr_kernels.quantize_expert` of random OLMoE-shaped experts, a few reused for every
   expert id: only the bytes and the kernel matter), copies moving those bytes and
   `psr_kernels.expert_ffn(..., fmt=)` on the slab. The same routing traces, `bytes_ratio` set
   to the format's (row bytes over the bf16 replay's row bytes), replayed and modeled:
   the expert kernel's time is calibrated per format (the replay without copies), the
   copy rate stays the bf16 one (the model prices a copy by its bytes). A format is
   skipped when the time left (`--budget-s`, default $PSR_STAGE_LIMIT_S) would not cover
   it (estimated from the last format's time).

Writes DIR/replay.json (rewritten after every policy: a timeout keeps what was done),
DIR/replay.md, DIR/replay_profile.json (+ replay_profile_<fmt>.json) and DIR/traces/*.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

import psr_kernels as pk
from psr.eval.latency import calibrate, simulate
from psr.eval.report import pct
from psr.models import DEFAULT_MODEL, load
from psr.points import operating_points
from psr.policy import Policy, standard_policies
from psr.runtime import Trace
from psr.store import ExpertStore, LayerSpec, backend_info

OLMOE_HF = (2048, 1024)  # OLMoE-1B-7B: hidden, expert FFN
TINY_HF = (64, 32)
H200_DENSE_MS = 0.08  # the built-in h200 profile's dense_ms_per_layer
DEFAULT_FORMATS = "int8,int4,fp8"  # most valuable first: a short budget keeps int8
FIRST_FORMAT_EST_S = 30.0  # a format's expected seconds on an H200 before one was timed


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- traces


def heldout_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens, evenly spaced over the first half of the model's
    held-out text (never trained on)."""
    text = (Path(DEFAULT_MODEL) / "heldout.txt").read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"]
    half = ids[: len(ids) // 2]
    step = max(1, (len(half) - length) // max(n, 1))
    return [half[i * step : i * step + length] for i in range(n)]


def num_experts_of(config, trace: Trace) -> int:
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1 + max(e for tok in trace.tokens for s in tok for e in s.experts)


def record(policy: Policy, rho: float, prompts: list[list[int]] | None, args) -> dict:
    """Decode the prompts under one policy on the CPU; the trace and its counts."""
    t0 = time.time()
    model = load(DEFAULT_MODEL, policy, rho, device="cpu", dtype="float32", progress=False)
    if prompts is None:
        prompts = heldout_prompts(model.tokenizer, args.prompts, args.prompt_len)
    rec = model.record_trace()
    for p in prompts:
        model.generate(p, args.tokens)
    trace = rec.trace
    E = num_experts_of(model.config, trace)
    report = model.stats.report()
    del model
    c = trace.counts()
    n = max(c["tokens"], 1)
    return {
        "residency": rho,
        "policy": policy.describe(),
        "spec": policy.spec(),
        "trace": trace,
        "prompts": prompts,
        "num_experts": E,
        "slots": max(
            int(rho * E + 0.5),
            1 + max((sl for t in trace.tokens for s in t for sl in s.slots), default=-1),
        ),
        "tokens": c["tokens"],
        "misses_per_token": c["misses"] / n,
        "prefetches_per_token": c["prefetches"] / n,
        "copies_per_token": (c["misses"] + c["prefetches"]) / n,
        "hit_rate": report.get("hit_rate"),
        "prefetch_used_frac": report.get("prefetch_used_frac"),
        "record_s": round(time.time() - t0, 2),
    }


# ---------------------------------------------------------------------- device helpers


class Clock:
    """Elapsed seconds of enqueued work: CUDA events on a GPU, wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self) -> None:
        self.sync()
        self.t0 = time.perf_counter()
        if self.cuda:
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e1 = torch.cuda.Event(enable_timing=True)
            self.e0.record()

    def stop(self) -> tuple[float, float]:
        """(device seconds, wall seconds)."""
        if self.cuda:
            self.e1.record()
            self.e1.synchronize()
            wall = time.perf_counter() - self.t0
            return self.e0.elapsed_time(self.e1) * 1e-3, wall
        wall = time.perf_counter() - self.t0
        return wall, wall


class Dense:
    """Stand-in for a decoder layer's dense work (attention, norms, router), sized to
    `target_ms`: `reps` bf16 GEMVs of a [rows, cols] weight, or one `torch.cuda._sleep`."""

    def __init__(self, device: torch.device, kind: str, target_ms: float, tiny: bool) -> None:
        self.device, self.target_ms = device, target_ms
        self.kind = kind if device.type == "cuda" else "gemv"
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        rows, cols = (128, 128) if tiny else (8192, 4096)
        g = torch.Generator(device="cpu").manual_seed(7)
        if self.kind == "gemv":
            self.w = torch.randn(rows, cols, generator=g).to(dtype).to(device)
            self.x = torch.randn(cols, generator=g).to(dtype).to(device)
        self.reps, self.cycles = 1, 0
        self.clock = Clock(device)
        self._calibrate()

    def _one(self, n: int) -> float:
        self.clock.start()
        for _ in range(n):
            if self.kind == "sleep":
                torch.cuda._sleep(self.cycles)
            else:
                torch.mv(self.w, self.x)
        return self.clock.stop()[0] / n

    def _calibrate(self) -> None:
        if self.kind == "sleep":
            self.cycles = 1_000_000
            self._one(2)
            per_cycle_ms = self._one(5) * 1e3 / self.cycles
            self.cycles = max(1, int(self.target_ms / per_cycle_ms))
        else:
            self._one(20)
            one_ms = self._one(200) * 1e3
            self.reps = max(1, round(self.target_ms / one_ms))
        self.ms = self.layer_ms(50)

    def layer_ms(self, n: int) -> float:
        self.clock.start()
        for _ in range(n):
            self()
        return self.clock.stop()[0] * 1e3 / n

    def __call__(self) -> None:
        if self.kind == "sleep":
            torch.cuda._sleep(self.cycles)
        else:
            for _ in range(self.reps):
                torch.mv(self.w, self.x)

    def describe(self) -> dict:
        d = {"kind": self.kind, "target_ms": self.target_ms, "stand_alone_ms": self.ms}
        if self.kind == "sleep":
            d["cycles"] = self.cycles
        else:
            d |= {"reps": self.reps, "weight": list(self.w.shape), "dtype": str(self.w.dtype)}
        return d


class Replayer:
    """Replays plans on `store`; `ffn(x, slab, slots, w, H, F, check_slots=...)` is the
    expert kernel (expert_ffn; for quantized rows with their `fmt` bound), `x_dtype` the
    activations' dtype (default: the store's)."""

    def __init__(
        self,
        store: ExpertStore,
        H: int,
        F: int,
        k: int,
        ffn,
        dense: Dense,
        x_dtype: torch.dtype | None = None,
    ) -> None:
        self.store, self.H, self.F, self.ffn, self.dense = store, H, F, ffn, dense
        self.device = store.device
        self.cuda = self.device.type == "cuda"
        self.clock = Clock(self.device)
        self.slabs = [store.slab(i) for i in range(len(store.layers))]
        g = torch.Generator(device="cpu").manual_seed(3)
        self.x = torch.randn(1, H, generator=g).to(x_dtype or store.dtype).to(self.device)
        self.w = torch.full((1, k), 1.0 / k, device=self.device)

    def route_sync(self) -> None:
        """Batch 1: the router's ids go to the host before any copy is issued."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def plan(self, trace: Trace, tokens: int | None = None) -> list[list]:
        """Per token, per decoder layer: None (dense only) or (layer, slots, slots tensor,
        copy batches): consecutive copies into one layer go as one enqueue_copies batch,
        as the runtime issues them (the layer's misses, then its prefetches)."""
        moe_at = {d: i for i, d in enumerate(trace.moe_layers)}
        out = []
        for tok in trace.tokens[:tokens] if tokens else trace.tokens:
            by = {s.layer: s for s in tok}
            row: list = []
            for d in range(trace.num_decoder_layers):
                m = moe_at.get(d)
                if m is None:
                    row.append(None)
                    continue
                s = by[m]
                batches: list[tuple[int, list[int], list[int]]] = []
                for c in s.copies:  # a slot at most once per batch (the store's rule)
                    if batches and batches[-1][0] == c.layer and c.slot not in batches[-1][1]:
                        batches[-1][1].append(c.slot)
                        batches[-1][2].append(c.expert)
                    else:
                        batches.append((c.layer, [c.slot], [c.expert]))
                st = torch.tensor([s.slots], device=self.device)
                row.append((m, list(s.slots), st, batches))
            out.append(row)
        return out

    def run(self, plan: list[list], copies: bool = True, experts: bool = True) -> dict:
        store, ffn, dense, H, F = self.store, self.ffn, self.dense, self.H, self.F
        stall0 = store.counters()["stall_s"]
        self.clock.start()
        for row in plan:
            for item in row:
                dense()
                if item is None:
                    continue
                m, slots, st, batches = item
                self.route_sync()
                if copies:
                    for layer, ss, es in batches:
                        store.enqueue_copies(layer, ss, es)
                if experts:
                    store.acquire(m, slots)
                    ffn(self.x, self.slabs[m], st, self.w, H, F, check_slots=False)
                    store.release(m, slots)
        dev_s, wall_s = self.clock.stop()
        store.synchronize()
        n = max(len(plan), 1)
        return {
            "ms_per_token": dev_s * 1e3 / n,
            "wall_ms_per_token": wall_s * 1e3 / n,
            "stall_ms_per_token": (store.counters()["stall_s"] - stall0) * 1e3 / n,
        }

    def measure(self, trace: Trace, repeats: int, warm: int, **kw) -> dict:
        if warm:
            self.run(self.plan(trace, warm), **kw)
        plan = self.plan(trace)
        runs = [self.run(plan, **kw) for _ in range(repeats)]
        med = statistics.median(r["ms_per_token"] for r in runs)
        best = min(runs, key=lambda r: abs(r["ms_per_token"] - med))
        return best | {"ms_per_token": med, "runs_ms": [r["ms_per_token"] for r in runs]}


def measure_h2d(store: ExpertStore, slots: int, experts: int, rounds: int, per_round: int) -> dict:
    """The store's copy engine: back-to-back expert copies into layer 0's slots."""
    nbytes = store.expert_bytes[0]
    clock = Clock(store.device)
    best = float("inf")
    for r in range(rounds + 1):  # the first round warms up
        clock.sync()
        store.synchronize()
        t = time.perf_counter()
        for j in range(per_round):
            base = (r * per_round + j) * slots
            store.enqueue_copies(
                0, list(range(slots)), [(base + s) % experts for s in range(slots)]
            )
        store.synchronize()
        if r:
            best = min(best, time.perf_counter() - t)
    total = nbytes * slots * per_round
    return {"h2d_gbps": total / best / 1e9, "bytes_per_round": total, "best_round_ms": best * 1e3}


def kernel_check(rep: Replayer, k: int, E: int, fmt: str | None = None) -> dict:
    """Copy k experts through the store, run the expert kernel on the slab (expert_ffn,
    with `fmt` for quantized rows), compare it with the torch reference, and
    byte-compare the slots with their host copies."""
    store, dev = rep.store, rep.device
    can_triton = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    slots, experts = list(range(k)), [(3 * i + 1) % E for i in range(k)]
    store.enqueue_copies(0, slots, experts)
    st = torch.tensor([slots], device=dev)
    out: dict = {"kernel": "triton" if can_triton else "skipped (no GPU, no TRITON_INTERPRET=1)"}
    if fmt is not None:
        out["format"] = fmt
    with store.reading(0, slots, experts) as slab:
        args = (rep.x, slab, st, rep.w, rep.H, rep.F)
        ref = pk.expert_ffn_ref(*args, fmt=fmt, out_dtype=torch.float32)
        if can_triton:
            try:
                y = pk.expert_ffn(*args, fmt=fmt, out_dtype=torch.float32)
                err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                out["rel_max_err"] = err
            except Exception as e:  # e.g. no C compiler for Triton's launcher
                out["kernel_error"] = f"{type(e).__name__}: {e}"[-2000:]
    out["slots_verified"] = all(store.verify(0, s) for s in slots)
    out["ok"] = (
        out["slots_verified"] and "kernel_error" not in out and out.get("rel_max_err", 0.0) < 1e-2
    )
    return out


# ------------------------------------------------------------------------------ report


def _cell(r: dict, key: str, fmt: str) -> str:
    """A table cell: `r[key]` formatted, or '-' when the run has no such figure."""
    v = r.get(key)
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    lines = [
        "| residency | policy | misses/tok | copies/tok | measured ms/tok | modeled ms/tok | "
        "model error | stall ms/tok meas / mod | speedup meas | speedup mod | speedup error |"
        " h200 profile ms/tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = partial(_cell, r)
        lines.append(
            f"| {pct(r['residency'])} | {r['policy']} | {r['misses_per_token']:.2f} | "
            f"{r['copies_per_token']:.2f} | {r['ms_per_token']:.3f} | {r['modeled_ms']:.3f} | "
            f"{f('model_error', '+.1%')} | {f('stall_ms_per_token', '.3f')} / "
            f"{f('modeled_stall_ms', '.3f')} | {f('speedup_vs_exact', '.2f')}x | "
            f"{f('modeled_speedup_vs_exact', '.2f')}x | {f('speedup_error', '+.1%')} | "
            f"{f('modeled_h200_ms', '.3f')} |"
        )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = [
        "| residency | policy | format | bytes ratio | copies/tok | measured ms/tok | "
        "modeled ms/tok | model error | vs bf16 exact meas | vs bf16 exact mod | "
        "speedup error | vs exact (same format) meas / mod | h200 profile ms/tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = partial(_cell, r)
        lines.append(
            f"| {pct(r['residency'])} | {r['policy']} | {r['format']} | {r['bytes_ratio']:.3f} | "
            f"{r['copies_per_token']:.2f} | {r['ms_per_token']:.3f} | {r['modeled_ms']:.3f} | "
            f"{f('model_error', '+.1%')} | {f('speedup_vs_bf16_exact', '.2f')}x | "
            f"{f('modeled_speedup_vs_bf16_exact', '.2f')}x | "
            f"{f('speedup_vs_bf16_exact_error', '+.1%')} | {f('speedup_vs_exact', '.2f')}x / "
            f"{f('modeled_speedup_vs_exact', '.2f')}x | {f('modeled_h200_ms', '.3f')} |"
        )
    return "\n".join(lines)


def add_format_speedups(frows: list[dict], rows: list[dict]) -> None:
    """Each format row vs bf16 exact at its residency (measured, modeled, their error) and
    vs exact in the same format."""
    for r in frows:
        rho = r["residency"]
        b16 = next((b for b in rows if b["residency"] == rho and b["policy"] == "exact"), None)
        if b16 is not None:
            r["speedup_vs_bf16_exact"] = b16["ms_per_token"] / r["ms_per_token"]
            r["modeled_speedup_vs_bf16_exact"] = b16["modeled_ms"] / r["modeled_ms"]
            r["speedup_vs_bf16_exact_error"] = (
                r["speedup_vs_bf16_exact"] / r["modeled_speedup_vs_bf16_exact"] - 1
            )
        same = next(
            (
                b
                for b in frows
                if b["residency"] == rho and b["format"] == r["format"] and b["policy"] == "exact"
            ),
            None,
        )
        if same is not None:
            r["speedup_vs_exact"] = same["ms_per_token"] / r["ms_per_token"]
            r["modeled_speedup_vs_exact"] = same["modeled_ms"] / r["modeled_ms"]


def add_speedups(rows: list[dict]) -> None:
    for r in rows:
        base = next(
            (b for b in rows if b["residency"] == r["residency"] and b["policy"] == "exact"), None
        )
        if base is None:
            continue
        r["speedup_vs_exact"] = base["ms_per_token"] / r["ms_per_token"]
        r["modeled_speedup_vs_exact"] = base["modeled_ms"] / r["modeled_ms"]
        r["speedup_error"] = r["speedup_vs_exact"] / r["modeled_speedup_vs_exact"] - 1


def checks(rows: list[dict]) -> dict:
    errs = [abs(r["model_error"]) for r in rows if r.get("model_error") is not None]
    psr_rows = [r for r in rows if r["spec"].startswith("psr") and "speedup_error" in r]
    return {
        "max_abs_model_error": max(errs) if errs else None,
        "psr_speedup_error": {f"{r['residency']:g}": r["speedup_error"] for r in psr_rows},
        "max_abs_psr_speedup_error": (
            max(abs(r["speedup_error"]) for r in psr_rows) if psr_rows else None
        ),
    }


def format_checks(frows: list[dict]) -> dict:
    """Per format: max |model error| over its rows, and the psr speedup vs bf16 exact,
    measured vs modeled, per residency; with the max over formats."""
    by: dict[str, dict] = {}
    for fmt in dict.fromkeys(r["format"] for r in frows):
        mine = [r for r in frows if r["format"] == fmt]
        psr = [r for r in mine if r["spec"].startswith("psr") and "speedup_vs_bf16_exact" in r]
        by[fmt] = {
            "max_abs_model_error": max(abs(r["model_error"]) for r in mine),
            "psr_speedup_vs_bf16_exact": {
                f"{r['residency']:g}": r["speedup_vs_bf16_exact"] for r in psr
            },
            "psr_speedup_vs_bf16_exact_error": {
                f"{r['residency']:g}": r["speedup_vs_bf16_exact_error"] for r in psr
            },
        }
    errs = [v["max_abs_model_error"] for v in by.values()]
    return {"by_format": by, "max_abs_model_error": max(errs) if errs else None}


def write(out: Path, result: dict) -> None:
    rows, frows = result["rows"], result.get("format_rows", [])
    add_speedups(rows)
    add_format_speedups(frows, rows)
    result["checks"] = checks(rows)
    result["format_checks"] = format_checks(frows)
    tmp = out / "replay.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / "replay.json")
    md = table(rows) + "\n"
    if frows:
        md += "\nQuantized expert formats (the same traces; bf16 exact is the baseline):\n\n"
        md += format_table(frows) + "\n"
    (out / "replay.md").write_text(md)


# ---------------------------------------------------------------------- quantized formats


def quant_store(fmt: str, H: int, F: int, E: int, n_moe: int, slots: int, backend: str):
    """A store of `fmt`'s uint8 rows: a few quantized random OLMoE-shaped experts, reused
    for every expert id, every slot loaded. (store, row bytes, seconds to set up)."""
    t = time.time()
    nbytes = pk.QuantLayout.of(fmt, H, F).nbytes
    g = torch.Generator(device="cpu").manual_seed(1)
    pool = []
    for _ in range(min(E, 2)):
        gate = torch.randn(F, H, generator=g) * H**-0.5
        up = torch.randn(F, H, generator=g) * H**-0.5
        down = torch.randn(H, F, generator=g) * F**-0.5
        pool.append(pk.quantize_expert(gate, up, down, fmt))
    store = ExpertStore([LayerSpec(E, slots, nbytes)] * n_moe, torch.uint8, backend=backend)
    for layer in range(n_moe):
        for e in range(E):
            store.register(layer, e, pool[(layer + e) % len(pool)])
    for layer in range(n_moe):
        store.enqueue_copies(layer, list(range(slots)), [s % E for s in range(slots)])
    store.synchronize()
    return store, nbytes, round(time.time() - t, 2)


def replay_format(
    fmt: str,
    kept: list[tuple[float, Policy, Trace, dict]],
    ctx: dict,
    result: dict,
    out: Path,
    args,
) -> None:
    """Replay the kept traces with `fmt`'s rows and kernel; rows into result["format_rows"]
    (written after each), the format's calibration into result["formats"][fmt]."""
    H, F, E, k = ctx["H"], ctx["F"], ctx["E"], ctx["k"]
    repeats, warm, base_bytes = ctx["repeats"], ctx["warm"], ctx["base_bytes"]
    t0 = time.time()
    info: dict = {"status": "setting up"}
    result["formats"][fmt] = info
    store, nbytes, setup_s = quant_store(fmt, H, F, E, ctx["n_moe"], ctx["slots"], ctx["backend"])
    ratio = nbytes / base_bytes  # what a copy / expert read costs vs this replay's bf16 rows
    info |= {
        "row_bytes": nbytes,
        "bytes_ratio": ratio,
        "bytes_ratio_vs_bf16": pk.bytes_ratio(fmt, H, F),
        "setup_s": setup_s,
    }
    log(
        f"  {fmt}: {ctx['n_moe']} x {E} rows of {nbytes / 1e6:.2f} MB (bytes ratio "
        f"{ratio:.3f}), set up in {setup_s} s"
    )
    use_triton = ctx["use_triton"]

    def ffn_of(triton: bool):
        kern = pk.expert_ffn if triton else pk.expert_ffn_ref

        def ffn(x, slab, st, w, H, F, check_slots=False):
            return kern(x, slab, st, w, H, F, fmt=fmt, check_slots=check_slots)

        return ffn

    try:
        rep = Replayer(store, H, F, k, ffn_of(use_triton), ctx["dense"], x_dtype=ctx["dtype"])
        info["kernel_check"] = kernel_check(rep, k, E, fmt)
        info["ffn"] = "triton expert_ffn_quant" if use_triton else "torch expert_ffn_quant_ref"
        log(f"  {fmt} kernel check: {info['kernel_check']}")
        if use_triton and "kernel_error" in info["kernel_check"]:
            rep.ffn = ffn_of(False)
            info["ffn"] = "torch expert_ffn_quant_ref (the Triton kernel failed)"
            log(f"  the Triton {fmt} kernel failed; replaying with expert_ffn_quant_ref")
        # The expert kernel's time in this format (the replay without copies, minus the
        # dense stand-in); the copy rate stays the bf16 calibration's: the model prices a
        # copy by its bytes, which the copy stage's per-format figures check.
        trace0 = ctx["trace0"]
        h2d = measure_h2d(store, ctx["slots"], E, rounds=2 if args.tiny else 3, per_round=2)
        c_only = rep.measure(trace0, repeats, warm, copies=False, experts=True)
        expert_ms = max(1e-6, (c_only["ms_per_token"] - ctx["dense_only_ms"]) / ctx["routed"])
        prof = dataclasses.replace(
            ctx["profile"],
            name=f"replay-measured-{fmt}",
            hbm_gbps=nbytes / (expert_ms * 1e-3) / 1e9,
            expert_overhead_us=0.0,
            notes=f"{ctx['profile'].name} with the {fmt} expert kernel's measured time",
        )
        prof.save(out / f"replay_profile_{fmt}.json")
        info |= {
            "expert_ms": expert_ms,
            "expert_ms_vs_bf16": expert_ms / ctx["expert_ms"],
            "compute_only_ms_per_token": c_only["ms_per_token"],
            "h2d_gbps": h2d["h2d_gbps"],
            "h2d_vs_bf16": h2d["h2d_gbps"] / ctx["h2d_gbps"],
            "profile": prof.name,
            "profile_hbm_gbps": prof.hbm_gbps,
            "status": "replaying",
        }
        log(
            f"  {fmt} calibrated: expert {expert_ms * 1e3:.1f} us "
            f"({info['expert_ms_vs_bf16']:.2f}x bf16), copy {h2d['h2d_gbps']:.1f} GB/s"
        )
        for rho, policy, trace, rec in kept:
            tr = dataclasses.replace(trace, bytes_ratio=ratio)
            m = rep.measure(tr, repeats, warm)
            sim = simulate(tr, prof)
            row = {
                **rec,
                "format": fmt,
                "bytes_ratio": ratio,
                **m,
                "modeled_ms": sim.ms_per_token,
                "modeled_stall_ms": sim.stall_ms,
                "modeled_copy_ms": sim.copy_ms,
                "modeled_compute_ms": sim.compute_ms,
                "modeled_h200_ms": simulate(tr, "h200", nbytes).ms_per_token,
            }
            row["model_error"] = row["modeled_ms"] / row["ms_per_token"] - 1
            result["format_rows"].append(row)
            result["seconds"] = round(time.time() - ctx["t_start"], 1)
            write(out, result)
            log(
                f"  {pct(rho)} {policy.describe():<24} {fmt:<4} {row['ms_per_token']:8.3f} ms/tok "
                f"(modeled {row['modeled_ms']:.3f}, err {row['model_error']:+.1%}); "
                f"vs bf16 exact {row.get('speedup_vs_bf16_exact', float('nan')):.2f}x"
            )
        info["status"] = "complete"
    finally:
        store.close()
        info["seconds"] = round(time.time() - t0, 1)


# -------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny experts, short runs")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (4; tiny 2)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per prompt (48; tiny 6)")
    ap.add_argument("--residency", default="0.5,0.25")
    ap.add_argument("--repeats", type=int, default=None, help="timed replays per trace (3; tiny 1)")
    ap.add_argument("--warm", type=int, default=None, help="warm-up tokens per trace (8; tiny 2)")
    ap.add_argument("--dense", choices=["gemv", "sleep"], default="gemv")
    ap.add_argument("--dense-ms", type=float, default=H200_DENSE_MS, help="per decoder layer")
    ap.add_argument("--ffn", choices=["auto", "triton", "torch"], default="auto")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default=None)
    ap.add_argument(
        "--formats",
        default=DEFAULT_FORMATS,
        help=f"quantized expert formats replayed after bf16, in order ({DEFAULT_FORMATS}; "
        "'' for none)",
    )
    ap.add_argument(
        "--format-policies",
        default="exact,psr",
        help="policies replayed in each format (exact,psr: the operating point and baseline)",
    )
    env_budget = os.environ.get("PSR_STAGE_LIMIT_S")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=float(env_budget) if env_budget else None,
        help="this script's seconds (default $PSR_STAGE_LIMIT_S, set by gpu_bench.sh): "
        "formats that would not fit are skipped",
    )
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in pk.QUANT_FORMATS:
            ap.error(f"--formats: {f!r} is not one of {', '.join(pk.QUANT_FORMATS)}")
    fpols = {p.strip() for p in args.format_policies.split(",") if p.strip()}
    tiny = args.tiny
    args.prompts = args.prompts or (2 if tiny else 4)
    args.tokens = args.tokens or (6 if tiny else 48)
    repeats = args.repeats or (1 if tiny else 3)
    warm = args.warm if args.warm is not None else (2 if tiny else 8)
    out = Path(args.out)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    backend = args.backend or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    H, F = TINY_HF if tiny else OLMOE_HF
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    triton_ok = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    use_triton = args.ffn == "triton" or (args.ffn == "auto" and device.type == "cuda")
    if use_triton and not triton_ok:
        raise SystemExit("--ffn triton on the CPU needs TRITON_INTERPRET=1")
    ffn = pk.expert_ffn if use_triton else pk.expert_ffn_ref
    rhos = [float(x) for x in args.residency.split(",") if x.strip()]
    configs = [
        (rho, p) for rho in rhos for p in standard_policies(operating_points(DEFAULT_MODEL, rho))
    ]
    result: dict = {
        "status": "started",
        "mode": "tiny" if tiny else "gpu",
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "backend_info": backend_info(),
        "expert_shape": [3, H, F],
        "dtype": str(dtype),
        "ffn": "triton expert_ffn" if use_triton else "torch expert_ffn_ref",
        "prompts": args.prompts,
        "new_tokens": args.tokens,
        "repeats": repeats,
        "warm_tokens": warm,
        "rows": [],
        "format_list": formats,
        "format_policies": sorted(fpols),
        "formats": {},
        "format_rows": [],
    }
    log(
        f"replay: {len(configs)} configs, experts {3}x{H}x{F} {dtype}, store {backend}, "
        f"{result['ffn']}, dense {args.dense} {args.dense_ms} ms/layer"
    )

    # The baseline first: its trace sizes the store and calibrates the model.
    first = record(configs[0][1], configs[0][0], None, args)
    prompts = first["prompts"]
    E, k = first["num_experts"], first["trace"].top_k
    n_moe = len(first["trace"].moe_layers)
    max_slots = max(min(E, int(rho * E + 0.5)) for rho in rhos)
    max_slots = max(max_slots, first["slots"], k)
    log(
        f"  traced {configs[0][1].describe()} at {pct(configs[0][0])}: {first['tokens']} tokens "
        f"in {first['record_s']} s; model: {n_moe} MoE layers, {E} experts, top-{k}"
    )
    t = time.time()
    store = ExpertStore([LayerSpec(E, max_slots, 3 * H * F)] * n_moe, dtype, backend=backend)
    g = torch.Generator(device="cpu").manual_seed(0)
    pool = [(torch.randn(3 * H * F, generator=g) * H**-0.5).to(dtype) for _ in range(min(E, 4))]
    for layer in range(n_moe):
        for e in range(E):
            store.register(layer, e, pool[(layer + e) % len(pool)])
    del pool
    for layer in range(n_moe):  # every slot loaded: the traces start after a prefill
        store.enqueue_copies(layer, list(range(max_slots)), [s % E for s in range(max_slots)])
    store.synchronize()
    result["store"] = {
        "layers": n_moe,
        "experts": E,
        "slots": max_slots,
        "expert_bytes": store.expert_bytes[0],
        "host_gb": n_moe * E * store.expert_bytes[0] / 1e9,
        "setup_s": round(time.time() - t, 2),
    }
    log(
        f"  store: {n_moe} x {E} experts of {store.expert_bytes[0] / 1e6:.1f} MB, "
        f"{max_slots} slots/layer, set up in {result['store']['setup_s']} s"
    )
    dense = Dense(device, args.dense, args.dense_ms, tiny)
    result["dense"] = dense.describe()
    rep = Replayer(store, H, F, k, ffn, dense)
    result["kernel_check"] = kernel_check(rep, k, E)
    log(f"  kernel check: {result['kernel_check']}")
    if use_triton and "kernel_error" in result["kernel_check"]:
        # Keep the model check alive: the torch reference reads the same slab slots.
        rep.ffn = pk.expert_ffn_ref
        result["ffn"] = "torch expert_ffn_ref (the Triton kernel failed: see kernel_check)"
        log("  the Triton kernel failed; replaying with expert_ffn_ref")

    # Calibration on this machine: copy engine, dense alone, experts without copies.
    trace0 = first["trace"]
    h2d = measure_h2d(store, max_slots, E, rounds=2 if tiny else 3, per_round=2)
    d_only = rep.measure(trace0, repeats, warm, copies=False, experts=False)
    c_only = rep.measure(trace0, repeats, warm, copies=False, experts=True)
    routed = sum(len(s.experts) for tok in trace0.tokens for s in tok) / max(len(trace0.tokens), 1)
    dense_ms = d_only["ms_per_token"] / trace0.num_decoder_layers
    expert_ms = max(1e-6, (c_only["ms_per_token"] - d_only["ms_per_token"]) / routed)
    measured = {
        "h2d_gbps": h2d["h2d_gbps"],
        "expert_ms": expert_ms,
        "dense_ms_per_layer": dense_ms,
        "expert_bytes": store.expert_bytes[0],
    }
    profile = calibrate("replay-measured", measured, base="h200")
    profile.save(out / "replay_profile.json")
    result["calibration"] = {
        **measured,
        "h2d": h2d,
        "dense_only_ms_per_token": d_only["ms_per_token"],
        "compute_only_ms_per_token": c_only["ms_per_token"],
        "routed_per_token": routed,
        "profile": profile.name,
    }
    log(
        f"  calibrated: copy {h2d['h2d_gbps']:.1f} GB/s, expert {expert_ms * 1e3:.1f} us, "
        f"dense {dense_ms * 1e3:.1f} us/layer"
    )
    result["status"] = "replaying"
    write(out, result)

    kept: list[tuple[float, Policy, Trace, dict]] = []  # replayed again in each format
    for i, (rho, policy) in enumerate(configs):
        rec = first if i == 0 else record(policy, rho, prompts, args)
        trace = rec.pop("trace")
        rec.pop("prompts")
        if formats and policy.spec().split(":")[0] in fpols:
            kept.append((rho, policy, trace, dict(rec)))
        name = f"{rho:g}_{policy.spec().replace(':', '_').replace(',', '_').replace('=', '')}"
        trace.save(out / "traces" / f"{name}.json")
        m = rep.measure(trace, repeats, warm)
        sim = simulate(trace, profile)
        row = {
            **rec,
            **m,
            "modeled_ms": sim.ms_per_token,
            "modeled_stall_ms": sim.stall_ms,
            "modeled_copy_ms": sim.copy_ms,
            "modeled_compute_ms": sim.compute_ms,
            "modeled_lower_bound_ms": sim.lower_bound_ms,
            "modeled_h200_ms": simulate(trace, "h200", store.expert_bytes[0]).ms_per_token,
        }
        row["model_error"] = row["modeled_ms"] / row["ms_per_token"] - 1
        result["rows"].append(row)
        result["seconds"] = round(time.time() - t_start, 1)
        write(out, result)
        log(
            f"  {pct(rho)} {policy.describe():<24} {row['ms_per_token']:8.3f} ms/tok (modeled "
            f"{row['modeled_ms']:.3f}, err {row['model_error']:+.1%}); misses/tok "
            f"{row['misses_per_token']:.2f}, copies/tok {row['copies_per_token']:.2f}; "
            f"traced in {rec['record_s']} s"
        )
    base_bytes = store.expert_bytes[0]
    store.close()

    ctx = {
        "H": H,
        "F": F,
        "E": E,
        "k": k,
        "n_moe": n_moe,
        "slots": max_slots,
        "backend": backend,
        "dtype": dtype,
        "use_triton": use_triton,
        "dense": dense,
        "repeats": repeats,
        "warm": warm,
        "base_bytes": base_bytes,
        "trace0": trace0,
        "dense_only_ms": d_only["ms_per_token"],
        "routed": routed,
        "expert_ms": expert_ms,
        "h2d_gbps": h2d["h2d_gbps"],
        "profile": profile,
        "t_start": t_start,
    }
    last_s, failed = None, []
    for fmt in formats:
        left = None if args.budget_s is None else args.budget_s - (time.time() - t_start)
        need = last_s if last_s is not None else (0.0 if tiny else FIRST_FORMAT_EST_S)
        if left is not None and left < need * 1.2 + 20:  # + python start-up, writing
            result["formats"][fmt] = {
                "status": f"skipped: {left:.0f} s left, about {need:.0f} s needed"
            }
            log(f"  {fmt}: skipped ({left:.0f} s left of --budget-s, ~{need:.0f} s needed)")
            write(out, result)
            continue
        try:
            replay_format(fmt, kept, ctx, result, out, args)
        except Exception as e:  # keep bf16's rows and the other formats
            result["formats"][fmt]["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
            failed.append(fmt)
            log(f"  {fmt}: FAILED: {type(e).__name__}: {e}")
        write(out, result)
        last_s = result["formats"][fmt].get("seconds")
    result["status"] = "complete"
    result["seconds"] = round(time.time() - t_start, 1)
    write(out, result)
    log(table(result["rows"]))
    if result["format_rows"]:
        log(format_table(result["format_rows"]))
    c = result["checks"]
    log(
        f"max |model error| {c['max_abs_model_error']:.1%}; psr speedup error "
        + ", ".join(f"{k}: {v:+.1%}" for k, v in c["psr_speedup_error"].items())
    )
    for fmt, v in result["format_checks"]["by_format"].items():
        log(
            f"{fmt}: max |model error| {v['max_abs_model_error']:.1%}; psr vs bf16 exact "
            + ", ".join(f"{k}: {x:.2f}x" for k, x in v["psr_speedup_vs_bf16_exact"].items())
        )
    if failed:
        log(f"failed formats: {', '.join(failed)} (replay.json: formats.<fmt>.status)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
