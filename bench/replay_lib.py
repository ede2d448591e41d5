"""The trace replay's machinery; bench/gpu_replay.py is its command line (and describes
the method), replay_tables.py its tables and checks.

* traces: `record` decodes held-out prompts under one policy on the CPU (the embedded model);
* device: `Clock`, the `Dense` stand-in, `Replayer` (a trace's copies and expert kernels on
  an ExpertStore), `measure_h2d`, `kernel_check`;
* the bf16 replay: the store, the calibration, every policy's trace (`replay`);
* quantized formats: `quant_store`, `replay_format`, `replay_formats` (within the budget).

The expert kernel is `psr_kernels.kernel_ops(compute, device).expert_ffn` (`fmt=` for
quantized rows): `--compute auto` follows `PSR_COMPUTE`, then the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from replay_tables import write

import psr_kernels as pk
from psr.eval.labels import pct
from psr.eval.latency import Profile, calibrate, simulate
from psr.models import DEFAULT_MODEL, load
from psr.points import operating_points
from psr.policy import Policy, standard_policies
from psr.runtime import Trace
from psr.store import ExpertStore, LayerSpec, backend_info
from psr_kernels import KernelOps

OLMOE_HF = (2048, 1024)  # OLMoE-1B-7B: hidden, expert FFN
TINY_HF = (64, 32)
FIRST_FORMAT_EST_S = 30.0  # a format's expected seconds on an H200 before one was timed


def log(msg: str) -> None:
    print(msg, flush=True)


def ffn_label(ops: KernelOps, fmt: str | None = None) -> str:
    """Which expert kernel runs: the compute path and its function (with the format)."""
    name = f"{ops.path} {ops.expert_ffn.__name__}"
    return name if fmt is None else f"{name} fmt={fmt}"


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
    """Replays plans on `store`; `ops.expert_ffn` is the expert kernel (with `fmt` for
    quantized rows), `x_dtype` the activations' dtype (default: the store's)."""

    def __init__(
        self,
        store: ExpertStore,
        H: int,
        F: int,
        k: int,
        ops: KernelOps,
        dense: Dense,
        x_dtype: torch.dtype | None = None,
        fmt: str | None = None,
    ) -> None:
        self.store, self.H, self.F, self.ops, self.dense = store, H, F, ops, dense
        self.fmt = fmt
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
        store, ffn, dense, H, F = self.store, self.ops.expert_ffn, self.dense, self.H, self.F
        fmt = self.fmt
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
                    ffn(self.x, self.slabs[m], st, self.w, H, F, fmt=fmt, check_slots=False)
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
    try:
        triton: KernelOps | None = pk.kernel_ops("triton", dev)
    except RuntimeError:  # no GPU and no TRITON_INTERPRET=1
        triton = None
    slots, experts = list(range(k)), [(3 * i + 1) % E for i in range(k)]
    store.enqueue_copies(0, slots, experts)
    st = torch.tensor([slots], device=dev)
    skipped = "skipped (no GPU, no TRITON_INTERPRET=1)"
    out: dict = {"kernel": "triton" if triton is not None else skipped}
    if fmt is not None:
        out["format"] = fmt
    with store.reading(0, slots, experts) as slab:
        args = (rep.x, slab, st, rep.w, rep.H, rep.F)
        ref = pk.kernel_ops("torch", dev).expert_ffn(*args, fmt=fmt, out_dtype=torch.float32)
        if triton is not None:
            try:
                y = triton.expert_ffn(*args, fmt=fmt, out_dtype=torch.float32)
                err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                out["rel_max_err"] = err
            except Exception as e:  # e.g. no C compiler for Triton's launcher
                out["kernel_error"] = f"{type(e).__name__}: {e}"[-2000:]
    out["slots_verified"] = all(store.verify(0, s) for s in slots)
    out["ok"] = (
        out["slots_verified"] and "kernel_error" not in out and out.get("rel_max_err", 0.0) < 1e-2
    )
    return out


# ------------------------------------------------------------------------- bf16 replay


@dataclass
class Bf16:
    """What the format replays reuse from the bf16 replay: the shapes and store layout,
    the compute path chosen, the stand-in, the calibration and its profile."""

    H: int
    F: int
    E: int
    k: int
    n_moe: int
    slots: int
    backend: str
    dtype: torch.dtype
    ops: KernelOps
    dense: Dense
    base_bytes: int
    trace0: Trace
    calibration: dict
    profile: Profile
    t_start: float


def bf16_store(
    H: int, F: int, E: int, n_moe: int, slots: int, dtype: torch.dtype, backend: str
) -> tuple[ExpertStore, dict]:
    """The store of 3 x H x F `dtype` experts (a few random ones reused for every expert
    id), every slot loaded: the traces start after a prefill. (store, its description)."""
    t = time.time()
    store = ExpertStore([LayerSpec(E, slots, 3 * H * F)] * n_moe, dtype, backend=backend)
    g = torch.Generator(device="cpu").manual_seed(0)
    pool = [(torch.randn(3 * H * F, generator=g) * H**-0.5).to(dtype) for _ in range(min(E, 4))]
    for layer in range(n_moe):
        for e in range(E):
            store.register(layer, e, pool[(layer + e) % len(pool)])
    del pool
    for layer in range(n_moe):
        store.enqueue_copies(layer, list(range(slots)), [s % E for s in range(slots)])
    store.synchronize()
    info = {
        "layers": n_moe,
        "experts": E,
        "slots": slots,
        "expert_bytes": store.expert_bytes[0],
        "host_gb": n_moe * E * store.expert_bytes[0] / 1e9,
        "setup_s": round(time.time() - t, 2),
    }
    return store, info


def check_kernel(rep: Replayer, k: int, E: int, into: dict) -> None:
    """`kernel_check` into `into["kernel_check"]`, the kernel that replays into
    `into["ffn"]`. Where the Triton kernel failed, replay with the torch reference instead:
    it reads the same slab slots, so the model check stays alive."""
    fmt = rep.fmt
    what = "" if fmt is None else f"{fmt} "
    into["kernel_check"] = kernel_check(rep, k, E, fmt)
    into["ffn"] = ffn_label(rep.ops, fmt)
    log(f"  {what}kernel check: {into['kernel_check']}")
    if rep.ops.path == "triton" and "kernel_error" in into["kernel_check"]:
        rep.ops = pk.kernel_ops("torch", rep.device)
        into["ffn"] = f"{ffn_label(rep.ops, fmt)} (the Triton kernel failed: see kernel_check)"
        log(f"  the Triton {what}kernel failed; replaying with {rep.ops.expert_ffn.__name__}")


def calibrate_bf16(
    rep: Replayer, trace0: Trace, slots: int, args: argparse.Namespace
) -> tuple[dict, Profile]:
    """This machine's profile: the copy engine, the dense stand-in alone, the experts
    without copies (saved as DIR/replay_profile.json). (the figures, the profile)."""
    E = rep.store.layers[0].num_experts
    h2d = measure_h2d(rep.store, slots, E, rounds=2 if args.tiny else 3, per_round=2)
    d_only = rep.measure(trace0, args.repeats, args.warm, copies=False, experts=False)
    c_only = rep.measure(trace0, args.repeats, args.warm, copies=False, experts=True)
    routed = sum(len(s.experts) for tok in trace0.tokens for s in tok) / max(len(trace0.tokens), 1)
    dense_ms = d_only["ms_per_token"] / trace0.num_decoder_layers
    expert_ms = max(1e-6, (c_only["ms_per_token"] - d_only["ms_per_token"]) / routed)
    measured = {
        "h2d_gbps": h2d["h2d_gbps"],
        "expert_ms": expert_ms,
        "dense_ms_per_layer": dense_ms,
        "expert_bytes": rep.store.expert_bytes[0],
    }
    profile = calibrate("replay-measured", measured, base="h200")
    profile.save(Path(args.out) / "replay_profile.json")
    log(
        f"  calibrated: copy {h2d['h2d_gbps']:.1f} GB/s, expert {expert_ms * 1e3:.1f} us, "
        f"dense {dense_ms * 1e3:.1f} us/layer"
    )
    calibration = {
        **measured,
        "h2d": h2d,
        "dense_only_ms_per_token": d_only["ms_per_token"],
        "compute_only_ms_per_token": c_only["ms_per_token"],
        "routed_per_token": routed,
        "profile": profile.name,
    }
    return calibration, profile


def trace_name(rho: float, policy: Policy) -> str:
    """A trace's file name (no suffix): residency and policy spec."""
    return f"{rho:g}_{policy.spec().replace(':', '_').replace(',', '_').replace('=', '')}"


def replay_row(rep: Replayer, trace: Trace, rec: dict, profile: Profile, args) -> dict:
    """One policy's bf16 row: its counts, the measured replay and the model of its trace."""
    m = rep.measure(trace, args.repeats, args.warm)
    sim = simulate(trace, profile)
    row = {
        **rec,
        **m,
        "modeled_ms": sim.ms_per_token,
        "modeled_stall_ms": sim.stall_ms,
        "modeled_copy_ms": sim.copy_ms,
        "modeled_compute_ms": sim.compute_ms,
        "modeled_lower_bound_ms": sim.lower_bound_ms,
        "modeled_h200_ms": simulate(trace, "h200", rep.store.expert_bytes[0]).ms_per_token,
    }
    row["model_error"] = row["modeled_ms"] / row["ms_per_token"] - 1
    return row


Kept = tuple[float, Policy, Trace, dict]  # a trace replayed again in each format


def replay(
    args: argparse.Namespace, backend: str, ops: KernelOps, formats: list[str], fpols: set[str]
) -> tuple[dict, list[str]]:
    """The whole replay (bench/gpu_replay.py's docstring): bf16 under every policy, then
    exact and psr (`fpols`) in each format. (the result, also in DIR/replay.json and
    rewritten after every policy; the formats that failed)."""
    out = Path(args.out)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    tiny = args.tiny
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    H, F = TINY_HF if tiny else OLMOE_HF
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
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
        "ffn": ffn_label(ops),
        "prompts": args.prompts,
        "new_tokens": args.tokens,
        "repeats": args.repeats,
        "warm_tokens": args.warm,
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
    store, result["store"] = bf16_store(H, F, E, n_moe, max_slots, dtype, backend)
    log(
        f"  store: {n_moe} x {E} experts of {store.expert_bytes[0] / 1e6:.1f} MB, "
        f"{max_slots} slots/layer, set up in {result['store']['setup_s']} s"
    )
    dense = Dense(device, args.dense, args.dense_ms, tiny)
    result["dense"] = dense.describe()
    rep = Replayer(store, H, F, k, ops, dense)
    check_kernel(rep, k, E, result)
    trace0 = first["trace"]
    result["calibration"], profile = calibrate_bf16(rep, trace0, max_slots, args)
    result["status"] = "replaying"
    write(out, result)

    kept: list[Kept] = []
    for i, (rho, policy) in enumerate(configs):
        rec = first if i == 0 else record(policy, rho, prompts, args)
        trace = rec.pop("trace")
        rec.pop("prompts")
        if formats and policy.spec().split(":")[0] in fpols:
            kept.append((rho, policy, trace, dict(rec)))
        trace.save(out / "traces" / f"{trace_name(rho, policy)}.json")
        row = replay_row(rep, trace, rec, profile, args)
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

    bf16 = Bf16(
        H=H,
        F=F,
        E=E,
        k=k,
        n_moe=n_moe,
        slots=max_slots,
        backend=backend,
        dtype=dtype,
        ops=ops,
        dense=dense,
        base_bytes=base_bytes,
        trace0=trace0,
        calibration=result["calibration"],
        profile=profile,
        t_start=t_start,
    )
    failed = replay_formats(formats, kept, bf16, result, args)
    result["status"] = "complete"
    result["seconds"] = round(time.time() - t_start, 1)
    write(out, result)
    return result, failed


# ---------------------------------------------------------------------- quantized formats


def quant_store(
    fmt: str, H: int, F: int, E: int, n_moe: int, slots: int, backend: str
) -> tuple[ExpertStore, int, float]:
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
    fmt: str, kept: list[Kept], bf16: Bf16, result: dict, args: argparse.Namespace
) -> None:
    """Replay the kept traces with `fmt`'s rows and kernel; rows into result["format_rows"]
    (written after each), the format's calibration into result["formats"][fmt]."""
    H, F, E, k = bf16.H, bf16.F, bf16.E, bf16.k
    repeats, warm, base_bytes = args.repeats, args.warm, bf16.base_bytes
    out = Path(args.out)
    t0 = time.time()
    info: dict = {"status": "setting up"}
    result["formats"][fmt] = info
    store, nbytes, setup_s = quant_store(fmt, H, F, E, bf16.n_moe, bf16.slots, bf16.backend)
    ratio = nbytes / base_bytes  # what a copy / expert read costs vs this replay's bf16 rows
    info |= {
        "row_bytes": nbytes,
        "bytes_ratio": ratio,
        "bytes_ratio_vs_bf16": pk.bytes_ratio(fmt, H, F),
        "setup_s": setup_s,
    }
    log(
        f"  {fmt}: {bf16.n_moe} x {E} rows of {nbytes / 1e6:.2f} MB (bytes ratio "
        f"{ratio:.3f}), set up in {setup_s} s"
    )
    try:
        rep = Replayer(store, H, F, k, bf16.ops, bf16.dense, x_dtype=bf16.dtype, fmt=fmt)
        check_kernel(rep, k, E, info)
        # The expert kernel's time in this format (the replay without copies, minus the
        # dense stand-in); the copy rate stays the bf16 calibration's: the model prices a
        # copy by its bytes, which the copy stage's per-format figures check.
        cal = bf16.calibration
        h2d = measure_h2d(store, bf16.slots, E, rounds=2 if args.tiny else 3, per_round=2)
        c_only = rep.measure(bf16.trace0, repeats, warm, copies=False, experts=True)
        dense_only_ms, routed = cal["dense_only_ms_per_token"], cal["routed_per_token"]
        expert_ms = max(1e-6, (c_only["ms_per_token"] - dense_only_ms) / routed)
        prof = dataclasses.replace(
            bf16.profile,
            name=f"replay-measured-{fmt}",
            hbm_gbps=nbytes / (expert_ms * 1e-3) / 1e9,
            expert_overhead_us=0.0,
            notes=f"{bf16.profile.name} with the {fmt} expert kernel's measured time",
        )
        prof.save(out / f"replay_profile_{fmt}.json")
        info |= {
            "expert_ms": expert_ms,
            "expert_ms_vs_bf16": expert_ms / cal["expert_ms"],
            "compute_only_ms_per_token": c_only["ms_per_token"],
            "h2d_gbps": h2d["h2d_gbps"],
            "h2d_vs_bf16": h2d["h2d_gbps"] / cal["h2d_gbps"],
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
            result["seconds"] = round(time.time() - bf16.t_start, 1)
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


def replay_formats(
    formats: list[str], kept: list[Kept], bf16: Bf16, result: dict, args: argparse.Namespace
) -> list[str]:
    """Each format in order, skipped when the time left (`args.budget_s`) would not cover
    it (estimated from the last format's time); a failure keeps bf16's rows and the other
    formats. The formats that failed."""
    out = Path(args.out)
    last_s, failed = None, []
    for fmt in formats:
        left = None if args.budget_s is None else args.budget_s - (time.time() - bf16.t_start)
        need = last_s if last_s is not None else (0.0 if args.tiny else FIRST_FORMAT_EST_S)
        if left is not None and left < need * 1.2 + 20:  # + python start-up, writing
            result["formats"][fmt] = {
                "status": f"skipped: {left:.0f} s left, about {need:.0f} s needed"
            }
            log(f"  {fmt}: skipped ({left:.0f} s left of --budget-s, ~{need:.0f} s needed)")
            write(out, result)
            continue
        try:
            replay_format(fmt, kept, bf16, result, args)
        except Exception as e:  # keep bf16's rows and the other formats
            result["formats"][fmt]["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
            failed.append(fmt)
            log(f"  {fmt}: FAILED: {type(e).__name__}: {e}")
        write(out, result)
        last_s = result["formats"][fmt].get("seconds")
    return failed
