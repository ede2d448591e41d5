"""Modeled time to first token (issue 36 item 5, goal 3): a prompt's prefill on the GPU
profiles of psr.eval.latency, copy-bound (the used experts' bytes over the host link)
against the compute; beside the peers' published figures. Torch-free, like the latency
model. Two models:
  built     (`built_rows`, the end of this module) the schedule psr's prefill issues,
            chunk-major and layer-major (psr.runtime.stream_plan: the planner the runtime
            executes), priced event by event on a timeline: psr's own columns;
  formula   (`model_ttft`, below) closed forms for every shape, the second turn and the
            CPU split's expected counts.

A prompt of T tokens is prefilled in chunks of c tokens (psr.runtime.chunked); per chunk
and MoE layer the chunk's used experts are copied into slots and computed once each over
their tokens (psr.runtime.prefill); every used expert crosses the link in each chunk (a
slab much smaller than E: the experts left in slots between chunks, at most C of a
chunk's u, are not counted). The distinct experts a chunk of n tokens uses per
layer, u(n), come from recorded routing (`union=`: mean distinct per layer of n-token
windows of the embedded model, bench/ttft.py) or, for big-model shapes, the expected
union of uniform routing: u(n) = E (1 - (1 - k/E)^n) (each token picks k of E; tokens
independent). Costs, per profile (psr.eval.latency.Profile):
  copy      an expert's bytes / h2d_gbps + copy_overhead_us;
  experts   a layer-chunk's: max(u bytes / hbm_gbps, 6 H F n k / flops) + u expert_overhead_us;
  dense     a layer-chunk's: max(dense_ms_per_layer, (2 P_dense / L) n / flops + attention
            4 d_attn n (s + n / 2) / flops) (s: tokens before the chunk; causal);
  flops     the GPU's dense bf16 peak (GPU_TFLOPS) x MFU (an assumption, stated).
Schedules:
  today     psr's: chunk by chunk, layer by layer; in a layer the copies run two ahead of
            the compute (double-buffered slots): a + (n_copies - 1) max(a, b) + b beside
            the dense part, a copy and b an expert's compute; nothing overlaps across
            layers (layer L+1's used set is known only once it routes) or chunks;
  split     today with the per-expert CPU split (psr.machine.PrefillSplit): experts with
            fewer tokens than the threshold (prefill_threshold of the copy and the CPU's
            time per token: expert bytes / cpu_gbps + cpu_expert_us) computed on the CPU
            beside the device's work (expected counts from the binomial of uniform routing);
  prefetch  today plus layer L+1's used set copied during layer L (what double-buffering
            across layers would give; at u ~ E the set is every expert, no prediction
            needed): per chunk max(copies, compute) + one layer's fill;
  layer     layer-major: every chunk through layer L while its experts are resident, so a
            layer's experts cross the link once per prompt (u(T)), with prefetch.
bound = max(u(T) L expert bytes / link, compute): the issue's goal is prefill within 1.2x
of it on the RTX 4090 profile. A second turn extends the conversation by SECOND_TURN
tokens and resumes from the prompt cache's last chunk boundary (psr.runtime.chunked), so
it computes the tokens after that boundary, attending to the whole context.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from psr.eval.latency import Profile, get_profile
from psr.machine import prefill_threshold
from psr.runtime.slots import SlotMap
from psr.runtime.stream_plan import (
    PREFETCH_DEPTH,
    PREFETCH_TOKENS,
    ChunkSplit,
    LayerSchedule,
    plan_prefill,
    plan_stream,
    prefetch_plan,
    prefetch_targets,
    schedule,
)

PROMPTS = (64, 512, 4096, 16384)  # 64: where the CPU split tells
SECOND_TURN = 100  # tokens a second turn adds to the conversation
GOAL_RATIO = 1.2  # the issue's: modeled prefill within 1.2x of the bound (RTX 4090)
# Dense bf16 tensor peaks (FP32 accumulate, no sparsity): NVIDIA's Ada whitepaper (RTX
# 4090: 165.2 TFLOPS) and H200 datasheet (989 TFLOPS; 1,979 is with sparsity).
GPU_TFLOPS = {"rtx4090": 165.2, "h200": 989.0}
MFU = 0.5  # assumed fraction of the peak prefill's GEMMs reach (not measured here)

# One union function: tokens -> mean distinct experts per MoE layer.
Union = Callable[[int], float]


@dataclass(frozen=True)
class MoEShape:
    """What prices a model's prefill: its MoE layers' experts and the dense rest."""

    name: str
    moe_layers: int
    experts: int
    top_k: int
    hidden: int
    ffn: int  # an expert's intermediate size
    bits: float  # bits per expert weight in the modeled format (scales included)
    fmt: str
    dense_params: float  # non-expert parameters a token multiplies (attention, shared, head)
    d_attn: int  # attention width for its FLOPs: 4 d_attn per token and context position
    source: str = ""

    @property
    def expert_bytes(self) -> int:
        return round(3 * self.hidden * self.ffn * self.bits / 8)


SHAPES = {
    "olmoe-1b-7b": MoEShape(
        "OLMoE-1B-7B", 16, 64, 8, 2048, 1024, 16, "bf16", 0.37e9, 2048,
        "allenai/OLMoE-1B-7B-0924 config (the latency model's modeled expert)",
    ),
    "qwen3-30b-a3b": MoEShape(
        "Qwen3-30B-A3B", 48, 128, 8, 2048, 768, 8.5, "Q8_0", 1.22e9, 4096,
        "Qwen/Qwen3-30B-A3B config: 32 q heads x 128, 4 kv heads",
    ),
    "deepseek-v3": MoEShape(
        "DeepSeek-V3", 58, 256, 8, 7168, 2048, 4.5, "Q4_K", 15.6e9, 20480,
        "deepseek-ai/DeepSeek-V3 config: 3 dense + 58 MoE layers, 1 shared expert, MLA "
        "(128 heads, 192 qk + 128 v dims); 37B active",
    ),
    "gpt-oss-120b": MoEShape(
        "gpt-oss-120b", 36, 128, 4, 2880, 2880, 4.25, "MXFP4", 1.55e9, 4096,
        "openai/gpt-oss-120b config: 64 q heads x 64 (sliding-window layers priced as "
        "full attention: an upper bound); 5.1B active",
    ),
}  # fmt: skip


# The peers' published prefill figures the issue quotes (their hardware, not the profiles
# above: context, not a side-by-side); tok/s, and the TTFT they imply (tokens / tok/s).
@dataclass(frozen=True)
class Published:
    who: str
    model: str
    hardware: str
    figures: tuple[tuple[int, float, str], ...]  # (tokens, tok/s, as quoted)


PUBLISHED = [
    Published(
        "llama.cpp",
        "gpt-oss-120b (MXFP4), experts in RAM, copied to the GPU for batches >= 32",
        "RTX 3090",
        (
            (512, 380.0, "micro-batch 512 (prompt length not quoted)"),
            (8192, 2091.0, "micro-batch 8192 (prompt length not quoted)"),
        ),
    ),
    Published(
        "KTransformers",
        "Qwen3-30B-A3B, CPU+GPU prefill (AMX kernels on the CPU), layers streamed to the GPU "
        "above a token threshold",
        "one RTX 5090",
        ((1024, 1180.0, "1k-token prompt"), (4096, 3080.0, "~, 4k-token prompt")),
    ),
    Published(
        "FreeToken",
        "each layer's experts double-buffered to the GPU",
        "not in the quote",
        ((8192, 8192 / 1.2, "an 8k chunk in ~1.2 s"),),
    ),
]


def uniform_union(experts: int, top_k: int) -> Union:
    """u(n) = E (1 - (1 - k/E)^n): distinct experts n uniformly routed tokens use."""
    if not 0 < top_k <= experts:
        raise ValueError(f"uniform_union: top_k {top_k} not in [1, experts={experts}]")
    return lambda n: experts * (1.0 - (1.0 - top_k / experts) ** n)


def recorded_union(table: dict[int, float], experts: int) -> Union:
    """u(n) from recorded means `{n: distinct}` (bench/ttft.py): interpolated linearly
    between recorded n, flat past the largest (a union only grows, at most E)."""
    pts = sorted((int(n), float(u)) for n, u in table.items())
    if not pts or pts[0][0] < 1:
        raise ValueError("recorded_union: needs windows of >= 1 token")

    def u(n: int) -> float:
        if n <= pts[0][0]:
            return pts[0][1] * n / pts[0][0]
        for (n0, u0), (n1, u1) in itertools.pairwise(pts):
            if n <= n1:
                return u0 + (u1 - u0) * (n - n0) / (n1 - n0)
        return min(float(experts), pts[-1][1])

    return u


def binom_pmf(n: int, p: float, j: int) -> float:
    return math.comb(n, j) * p**j * (1.0 - p) ** (n - j)


@dataclass
class Costs:
    """One (shape, profile)'s unit costs, seconds."""

    copy: float  # one expert's copy
    hbm_read: float  # one expert's weights read on the GPU
    overhead: float  # one expert's launches
    flops: float  # the GPU's achieved FLOP/s
    dense_floor: float  # a layer's dense part at least (the profile's batch-1 figure)
    cpu_token: float  # one token of one expert on the CPU kernels
    cpu_fixed: float  # a layer's CPU hand-off
    threshold: int  # tokens per expert below which the split computes it on the CPU

    @classmethod
    def of(cls, shape: MoEShape, p: Profile) -> Costs:
        if p.name not in GPU_TFLOPS:
            raise ValueError(f"ttft: no GPU FLOP/s for profile {p.name!r} (GPU_TFLOPS)")
        b = shape.expert_bytes
        copy = b / (p.h2d_gbps * 1e9) + p.copy_overhead_us * 1e-6
        cpu_token = b / (p.cpu_gbps * 1e9) + p.cpu_expert_us * 1e-6
        return cls(
            copy, b / (p.hbm_gbps * 1e9), p.expert_overhead_us * 1e-6,
            GPU_TFLOPS[p.name] * 1e12 * MFU, p.dense_ms_per_layer * 1e-3, cpu_token,
            p.cpu_layer_us * 1e-6, prefill_threshold(copy, cpu_token),
        )  # fmt: skip


@dataclass
class Stage:
    """One layer over some tokens: the link's time, the device's, the CPU's."""

    copy: float
    device: float
    cpu: float
    pipelined: float  # psr's in-layer schedule (copies two ahead of the compute)


def _stage(shape: MoEShape, c: Costs, s: int, n: int, u: float, split: bool) -> Stage:
    """MoE layer over tokens [s, s + n) with u distinct experts copied and computed."""
    L, E, k = shape.moe_layers, shape.experts, shape.top_k
    flops = 2 * shape.dense_params / L * n + 4 * shape.d_attn * n * (s + n / 2)
    dense = max(c.dense_floor, flops / c.flops)
    cpu_n = cpu_tokens = 0.0
    if split and c.threshold > 1:
        p = k / E
        for j in range(1, c.threshold):
            q = E * binom_pmf(n, p, j)
            cpu_n, cpu_tokens = cpu_n + q, cpu_tokens + q * j
    gpu_u = max(u - cpu_n, 0.0)
    expert_flops = 6 * shape.hidden * shape.ffn * (n * k - cpu_tokens)
    experts = max(gpu_u * c.hbm_read, expert_flops / c.flops) + gpu_u * c.overhead
    b = experts / gpu_u if gpu_u > 0 else 0.0
    pipe = c.copy + max((gpu_u - 1) * max(c.copy, b), 0.0) + b if gpu_u > 0 else 0.0
    cpu = c.cpu_fixed + cpu_tokens * c.cpu_token if cpu_n > 0 else 0.0
    return Stage(gpu_u * c.copy, dense + experts, cpu, dense + max(pipe, cpu))


def _overlapped(stages: Sequence[Stage]) -> float:
    """Copies of the next stage in flight during the current one: the busier of the link
    and the device (the CPU beside), plus one stage's fill."""
    link = sum(x.copy for x in stages)
    work = sum(max(x.device, x.cpu) for x in stages)
    fill = min(min(x.copy, x.device) for x in stages)
    return max(link, work) + fill


@dataclass
class TTFT:
    shape: str
    profile: str
    prompt: int  # tokens computed to the first token (a second turn: after the cache)
    context: int  # tokens before them (a second turn: the cached ones)
    chunk: int
    union: str  # "uniform" or "recorded"
    distinct: float  # u(T): distinct experts per layer over the computed tokens
    bound_s: float
    copy_s: float  # u(T) L expert bytes / link
    compute_s: float
    today_s: float
    split_s: float
    prefetch_s: float
    layer_s: float
    threshold: int

    @property
    def ratio(self) -> float:
        """psr's schedule today over the bound."""
        return self.today_s / self.bound_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ratio": self.ratio}


def model_ttft(
    shape: MoEShape | str,
    profile: Profile | str,
    tokens: int,
    chunk: int = 512,
    *,
    context: int = 0,
    union: Union | None = None,
) -> TTFT:
    """Modeled prefill of `tokens` prompt tokens after `context` cached ones (module
    docstring), in chunks at absolute multiples of `chunk`."""
    sh = SHAPES[shape] if isinstance(shape, str) else shape
    p = get_profile(profile)
    if tokens < 1 or chunk < 1 or context < 0:
        raise ValueError(f"ttft: tokens {tokens} and chunk {chunk} must be >= 1, context >= 0")
    u = union or uniform_union(sh.experts, sh.top_k)
    c = Costs.of(sh, p)
    L = sh.moe_layers
    ends = [*range((context // chunk + 1) * chunk, context + tokens, chunk), context + tokens]
    spans = list(zip([context, *ends[:-1]], ends, strict=True))
    per_chunk = [[_stage(sh, c, s, e - s, u(e - s), False)] * L for s, e in spans]
    split = [[_stage(sh, c, s, e - s, u(e - s), True)] * L for s, e in spans]
    whole = [_stage(sh, c, context, tokens, u(tokens), False)] * L
    today = sum(x.pipelined for ch in per_chunk for x in ch)
    # layer-major: a layer's experts copied once, computed over every chunk's tokens
    work = [sum(max(x.device, x.cpu) for x in ch) / L for ch in per_chunk]
    layer = [Stage(whole[0].copy, sum(work), 0.0, 0.0)] * L
    copy_s = u(tokens) * L * c.copy
    compute_s = sum(x.device for ch in per_chunk for x in ch)
    return TTFT(
        sh.name, p.name, tokens, context, chunk, "uniform" if union is None else "recorded",
        u(tokens), max(copy_s, compute_s), copy_s, compute_s, today,
        sum(x.pipelined for ch in split for x in ch),
        sum(_overlapped(ch) for ch in per_chunk), _overlapped(layer), c.threshold,
    )  # fmt: skip


def second_turn(
    shape: MoEShape | str, profile: Profile | str, first: int, chunk: int = 512, **kw: Any
) -> TTFT:
    """A second turn that extends a `first`-token conversation by SECOND_TURN tokens, the
    first turn's boundaries in the prompt cache: it resumes from the last boundary."""
    cached = min(first // chunk * chunk, first + SECOND_TURN - 1)
    return model_ttft(shape, profile, first + SECOND_TURN - cached, chunk, context=cached, **kw)


def ttft_rows(
    profiles: Sequence[str] = ("rtx4090", "h200"),
    shapes: Sequence[str] = tuple(SHAPES),
    prompts: Sequence[int] = PROMPTS,
    chunk: int = 512,
    unions: dict[str, Union] | None = None,
) -> list[dict[str, Any]]:
    """Every (profile, shape, prompt)'s first turn and second turn, as dicts, with uniform
    routing; then again with the recorded union functions `unions` (by shape key)."""
    rows = []
    recorded = [(k, u) for k, u in (unions or {}).items() if k in shapes]
    for prof in profiles:
        for key, u in [*((k, None) for k in shapes), *recorded]:
            for T in prompts:
                first = model_ttft(key, prof, T, chunk, union=u)
                second = second_turn(key, prof, T, chunk, union=u)
                rows.append({"key": key, **first.as_dict(), "second": second.as_dict()})
    return rows


def _s(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.0f}"


def ttft_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table (seconds)."""
    head = (
        "| profile | model (format) | prompt | union | distinct/layer | copy bound s | compute s"
        " | psr today s | x bound | + CPU split s | + prefetch L+1 s | layer-major s | x bound"
        " | 2nd turn (+100) today s | 2nd turn layer-major s |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        sh = SHAPES.get(r["key"])
        name = f"{r['shape']} ({sh.fmt})" if sh else r["shape"]
        sec = r["second"]
        lines.append(
            f"| {r['profile']} | {name} | {r['prompt']} | {r['union']} | {r['distinct']:.1f} | "
            f"{_s(r['copy_s'])} | {_s(r['compute_s'])} | {_s(r['today_s'])} | "
            f"{r['ratio']:.2f} | {_s(r['split_s'])} | {_s(r['prefetch_s'])} | "
            f"{_s(r['layer_s'])} | {r['layer_s'] / r['bound_s']:.2f} | {_s(sec['today_s'])} | "
            f"{_s(sec['layer_s'])} |"
        )
    return "\n".join(lines)


def published_table() -> str:
    """The peers' published figures, as quoted (their hardware), with the implied TTFT."""
    lines = ["| who | model | hardware | tokens | tok/s | implied TTFT s | as quoted |"]
    lines.append("|" + "---|" * 7)
    for p in PUBLISHED:
        for n, tps, what in p.figures:
            lines.append(
                f"| {p.who} | {p.model} | {p.hardware} | {n} | {tps:,.0f} | "
                f"{n / tps:.2f} | {what} |"
            )
    return "\n".join(lines)


def goal(rows: Sequence[dict[str, Any]], profile: str = "rtx4090") -> dict[str, Any]:
    """The issue's goal on `profile`: worst ratio to the bound of psr's schedule today and
    of the layer-major one, and whether each is within GOAL_RATIO."""
    mine = [r for r in rows if r["profile"] == profile]
    today = max(r["ratio"] for r in mine)
    layer = max(r["layer_s"] / r["bound_s"] for r in mine)
    return {
        "profile": profile,
        "worst_today": today,
        "worst_layer_major": layer,
        "today_met": today <= GOAL_RATIO,
        "layer_major_met": layer <= GOAL_RATIO,
    }


def ttft_report(
    profiles: Sequence[str] = ("rtx4090", "h200"),
    unions: dict[str, Union] | None = None,
    chunk: int = 512,
) -> str:
    """What `psr bench ttft` prints (and `psr demo` / `psr eval` may): the modeled table,
    the goal line, the peers' figures."""
    rows = ttft_rows(profiles, chunk=chunk, unions=unions)
    g = goal(rows) if "rtx4090" in profiles else None
    text = [
        f"modeled time to first token (s; chunk {chunk}, MFU {MFU:g} assumed; psr.eval.ttft)",
        ttft_table(rows),
    ]
    if g is not None:
        text.append(
            f"goal (within {GOAL_RATIO}x of max(used experts' bytes / link, compute) on "
            f"rtx4090): psr today worst {g['worst_today']:.2f}x, layer-major with prefetch "
            f"worst {g['worst_layer_major']:.2f}x"
        )
    text += ["published (their hardware, as quoted in issue 36)", published_table()]
    return "\n\n".join(text)


# --- psr's built schedules, priced (issue 36 goal 3) -----------------------------------------
# The schedule psr's prefill issues (psr.runtime.stream_plan: the same planner the runtime
# executes and records, tests/runtime/test_layer_major.py), from synthetic uniform routing
# (each token k distinct experts of E, seeded; one draw shared by the layers), priced on a
# timeline of the link, the device and the CPU worker:
#   dense     per chunk and layer as `_stage` prices it, before the layer's experts (it
#             routes there: the host learns the used set from the device, so the layer's
#             first copies are issued only then);
#   copy      issued when the host reaches it (the reads before it synchronise the host
#             with the device: each read finds its tokens with a data-dependent `where`),
#             starts once the link is free and its slot's last read is done; one expert's
#             copy time; `prefetch` the same into the next layer, `seed` after the reads;
#   read      starts when the device is free and its expert's copy has landed (a wait
#             otherwise); per chunk it covers: max(hbm read, 6 H F n / flops) + launch;
#   CPU part  the split's experts on the CPU worker beside the layer's device work.
SCHEDULE_RESIDENCY = 0.25  # the slab per layer (the offloaded case): capacity E / 4


def uniform_routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> list[list[int]]:
    """Synthetic routing: each token `top_k` distinct experts of `experts`, uniformly."""
    import random

    rng = random.Random(seed)
    return [rng.sample(range(experts), top_k) for _ in range(tokens)]


def _price_layer(sched: LayerSchedule, sh: MoEShape, c: Costs, t: dict[str, Any],
                 at: int, starts: Sequence[int]) -> None:  # fmt: skip
    """Advance the timeline `t` (device, link, waits; `ahead`: per MoE layer, its
    prefetched experts' arrival) over MoE layer `at`."""
    L = sh.moe_layers
    t0 = t["device"]
    for s, n in zip(starts, sched.chunk_tokens, strict=True):
        flops = 2 * sh.dense_params / L * n + 4 * sh.d_attn * n * (s + n / 2)
        t["device"] += max(c.dense_floor, flops / c.flops)
    ready, free = t["ahead"].pop(at, {}), {}  # free: slot -> its last read's end
    for ev in sched.events:
        if ev.kind == "read":
            start = max(t["device"], ready.get(ev.expert, 0.0))
            t["waits"] += start > t["device"]
            work = sum(
                max(c.hbm_read, 6 * sh.hidden * sh.ffn * n / c.flops) + c.overhead
                for n in ev.tokens if n
            )  # fmt: skip
            t["device"] = start + work
            free[ev.slot] = t["device"]
        elif ev.kind != "prefetch" or at + ev.ahead < L:  # (none past the last layer)
            slot_free = free.get(ev.slot, 0.0) if ev.kind != "prefetch" else 0.0
            t["link"] = max(t["link"], t["device"], slot_free) + c.copy
            t["copies"] += 1
            into = t["ahead"].setdefault(at + ev.ahead, {}) if ev.kind == "prefetch" else ready
            into[ev.expert] = t["link"]
    cpu = c.cpu_fixed + sum(sched.cpu_tokens) * c.cpu_token if sum(sched.cpu_tokens) else 0.0
    t["device"] = max(t["device"], t0 + cpu)


def built_schedules(
    sh: MoEShape, c: Costs, tokens: int, chunk: int, layer_major: bool
) -> list[tuple[LayerSchedule, list[int]]]:
    """The schedules psr issues for a `tokens` prompt, in execution order, each with its
    chunks' start positions: layer by layer over every chunk (`layer_major`), else chunk
    by chunk, each chunk through every layer. Layers share one routing draw, so once warm
    they issue the same schedule: planned until then (layer-major: PREFETCH_DEPTH + 1
    layers; chunk-major: 2), the last one repeated."""
    routed = uniform_routing(tokens, sh.experts, sh.top_k)
    cap = max(1, round(SCHEDULE_RESIDENCY * sh.experts))
    on_cpu = lambda n: 0 < n < c.threshold  # noqa: E731
    ends = [*range(chunk, tokens, chunk), tokens]
    starts = [0, *ends[:-1]]
    depth = PREFETCH_DEPTH + 1  # layer 0 cold; 1 prefetched by 0; 2 on, the steady state
    slots = [SlotMap([-1] * cap) for _ in range(min(depth + PREFETCH_DEPTH, sh.moe_layers))]
    if layer_major:
        plans, parts = [], [routed[s:e] for s, e in zip(starts, ends, strict=True)]
        for i, sm in enumerate(slots[:depth]):
            sp = plan_stream(sm, routed, parts, on_cpu)
            ahead = []
            if tokens >= PREFETCH_TOKENS:
                for p in prefetch_targets(i, len(slots)):
                    ahead += [(p - i, s, e) for s, e in prefetch_plan(slots[p], range(sh.experts))]
            plans.append((schedule(i, sp.plan, sp.chunks, ahead), starts))
        return [*plans, *[plans[-1]] * (sh.moe_layers - len(plans))][: sh.moe_layers]
    out = []
    for s, e in zip(starts, ends, strict=True):
        split = ChunkSplit.of(routed[s:e], on_cpu)
        layer = []
        for i, sm in enumerate(slots[:2]):
            plan = plan_prefill(sm, routed[:e], split.copied, e == tokens)
            layer.append((schedule(i, plan, [split]), [s]))
        out += [*layer, *[layer[-1]] * (sh.moe_layers - 2)][: sh.moe_layers]
    return out


def price_schedules(
    sh: MoEShape, c: Costs, scheds: Sequence[tuple[LayerSchedule, list[int]]]
) -> tuple[float, int, int]:
    """(seconds to the first token, copies, reads waited for) of `scheds` on the timeline."""
    t: dict[str, Any] = {"device": 0.0, "link": 0.0, "waits": 0, "copies": 0, "ahead": {}}
    for i, (sched, starts) in enumerate(scheds):
        _price_layer(sched, sh, c, t, i % sh.moe_layers, starts)
    # the first token's logits are the device's; seed copies still on the link do not wait
    return t["device"], t["copies"], t["waits"]


BUILT_SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b")
BUILT_PROMPTS = (512, 4096, 16384)


def built_rows(
    profiles: Sequence[str] = ("rtx4090", "h200"),
    shapes: Sequence[str] = BUILT_SHAPES,
    prompts: Sequence[int] = BUILT_PROMPTS,
    chunk: int = 512,
) -> list[dict[str, Any]]:
    """Every (profile, shape, prompt): the bound and psr's two built schedules priced
    (chunk-major: today's default; layer-major: `set_layer_major`), their copies and the
    reads that waited for one."""
    rows = []
    for prof in profiles:
        for key in shapes:
            sh, p = SHAPES[key], get_profile(prof)
            c = Costs.of(sh, p)
            for T in prompts:
                m = model_ttft(key, prof, T, chunk)
                row: dict[str, Any] = {
                    "profile": p.name, "key": key, "shape": sh.name, "prompt": T,
                    "chunk": chunk, "residency": SCHEDULE_RESIDENCY, "bound_s": m.bound_s,
                    "copy_s": m.copy_s, "compute_s": m.compute_s, "threshold": c.threshold,
                }  # fmt: skip
                for name, lm in (("chunk_major", False), ("layer_major", True)):
                    s, copies, waits = price_schedules(sh, c, built_schedules(sh, c, T, chunk, lm))
                    row |= {f"{name}_s": s, f"{name}_copies": copies, f"{name}_waits": waits}
                rows.append(row)
    return rows


def built_table(rows: Sequence[dict[str, Any]]) -> str:
    """The built schedules' rows as a markdown table (seconds)."""
    lines = [
        "| profile | model (format) | prompt | used experts / link s | compute s | "
        "psr chunk-major s | x bound | copies | psr layer-major s | x bound | copies | "
        "reads waited |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        b = r["bound_s"]
        lines.append(
            f"| {r['profile']} | {r['shape']} ({SHAPES[r['key']].fmt}) | {r['prompt']} | "
            f"{_s(r['copy_s'])} | {_s(r['compute_s'])} | {_s(r['chunk_major_s'])} | "
            f"{r['chunk_major_s'] / b:.2f} | {r['chunk_major_copies']:,} | "
            f"{_s(r['layer_major_s'])} | {r['layer_major_s'] / b:.2f} | "
            f"{r['layer_major_copies']:,} | {r['layer_major_waits']:,} |"
        )
    return "\n".join(lines)


def built_goal(rows: Sequence[dict[str, Any]], profile: str = "rtx4090") -> dict[str, Any]:
    """The issue's goal on `profile` from the built schedules: the worst ratio to the
    bound of each, and whether it is within GOAL_RATIO."""
    mine = [r for r in rows if r["profile"] == profile]
    out: dict[str, Any] = {"profile": profile}
    for name in ("chunk_major", "layer_major"):
        worst = max(r[f"{name}_s"] / r["bound_s"] for r in mine)
        out |= {f"worst_{name}": worst, f"{name}_met": worst <= GOAL_RATIO}
    return out
