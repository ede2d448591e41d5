"""The memory plan: given the device memory, the host memory and a context length, what
goes where before anything loads, and whether it fits.

On the device: the dense part (every weight but the routed experts, in a dense format),
the KV cache of `context` tokens (psr.runtime.kv: what each attention kind caches, in a
KV format), a workspace (the prefill chunk's activations and logits, and on CUDA a
reserve for the context and the allocator), and the expert slab: as many slots per layer
as fit in what is left (at most every expert; at least top_k with experts_on 'gpu', none
needed with 'cpu' / 'hybrid'). In host memory: the expert rows up to the budget
(psr.models.tiers: on the CPU backend the dense part and the slab count against it too);
the rest stay pageable in the checkpoint file where the file holds the rows' bytes.

A plan that fits carries, given a device's rates (`Rates`: a latency profile's, `psr inspect
--profile`), its modeled decode time per token: a batch-1 roofline (`modeled_decode`).

A plan that does not fit says which part is over, by how much, and what to change. `psr
inspect --gpu-memory` prints it; `psr.load(..., gpu_memory=...)` chooses its slots from it
and refuses before any weight is copied. Torch-free (`psr inspect` of a GGUF file).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psr.vocab as vocab
from psr.machine import expected_misses
from psr.models.formats import rowformat
from psr.models.tiers import choose_held, fmt_bytes
from psr.runtime.kv import check_kv_format, kv_by_kind, kv_format

# Dense formats the plan counts: "native", the file's own tensor types (GGUF blocks; a
# safetensors checkpoint's dtype), or "float", dequantized to the model dtype (what
# psr.load does today). Branch densequant's LoadConfig.dense_format takes the same words.
DENSE_FORMATS = ("native", "float")
# CUDA: the context and the caching allocator's slack, which no tensor accounts for
# (an assumption, not measured here; about what a CUDA 12 context takes on a recent GPU).
CUDA_RESERVE = 512 * 2**20
# What the plan may suggest changing when it does not fit (psr.load passes the ones it has).
LEVERS = ("slots", "experts_on", "context", "dtype", "dense_format", "kv_format", "host_memory")


class MemoryPlanError(ValueError):
    """A plan that does not fit: the one-line message names the part and the shortfall."""


@dataclass(frozen=True)
class ModelMemory:
    """A model's facts the plan needs (psr.models.inspect reads them from the checkpoint)."""

    config: Any  # the (text) config: layers, heads, hidden, vocab (psr.runtime.kv reads it)
    dense: dict[str, int]  # DENSE_FORMATS -> bytes of everything but the routed experts
    rows: list[int]  # one expert's bytes in each sparse layer, in the store's format
    num_experts: int
    top_k: int
    itemsize: int  # the model dtype's
    pageable: str | None = None  # None: rows not held can stay in the file; else why not

    @property
    def slot_bytes(self) -> int:
        """One expert slot in every sparse layer."""
        return sum(self.rows)

    @property
    def max_context(self) -> int | None:
        n = getattr(self.config, "max_position_embeddings", None)
        return int(n) if n else None


@dataclass(frozen=True)
class Rates:
    """What the modeled decode time reads: a latency profile's figures (psr.eval.latency.
    Profile; `psr inspect --profile` passes one). Bandwidths in GB/s, costs in µs."""

    name: str
    hbm_gbps: float  # device memory: batch-1 GEMVs read their weights at this rate
    h2d_gbps: float  # host -> device copies of expert rows
    copy_overhead_us: float  # per copy
    cpu_gbps: float  # the CPU expert kernels over host rows
    cpu_layer_us: float  # per layer with CPU experts: hand-off and merge
    cpu_expert_us: float  # per CPU expert


@dataclass(frozen=True)
class Budget:
    """What the plan is asked for. gpu_memory / host_memory in bytes (host None: every
    expert held); context None: the model's max_position_embeddings; slots None: as many
    as fit; cuda False: the CPU backend (its "device" memory is host memory)."""

    gpu_memory: int
    host_memory: int | None = None
    context: int | None = None
    experts_on: str = "gpu"
    dense_format: str | None = None  # None: psr.load's (default_dense_format)
    kv_format: str = "auto"  # or "fit": the first of `kv_fit` whose plan fits
    kv_fit: tuple[str, ...] = vocab.KV_FIT_ORDER
    slots: int | None = None
    prefill_chunk: int = 512
    cuda: bool = True
    levers: tuple[str, ...] = LEVERS
    dtype: str | None = None  # the compute dtype (psr.load's dtype=); None: the model's
    rates: Rates | None = None  # a device's rates: the plan's modeled decode time (CUDA)

    def __post_init__(self) -> None:
        if self.dense_format is None:
            object.__setattr__(self, "dense_format", default_dense_format())
        if self.dense_format not in DENSE_FORMATS:
            raise ValueError(
                f"dense_format must be one of {', '.join(DENSE_FORMATS)}; got {self.dense_format!r}"
            )
        if vocab.kv_choice(self.kv_format) != "fit":
            kv_format(self.kv_format)
        vocab.parse_experts_on(self.experts_on)
        if self.dtype is not None:
            vocab.canonical_dtype(self.dtype)


def default_dense_format() -> str:
    """What psr.load does with dense weights by default: LoadConfig's dense_format where it
    has one (branch densequant), else "float" (dequantized to the compute dtype)."""
    from psr.load_config import LoadConfig

    return str(getattr(LoadConfig(), "dense_format", None) or "float")


def workspace_bytes(config: Any, itemsize: int, chunk: int, cuda: bool) -> int:
    """The device memory decode and prefill take beyond weights and KV, as modeled: one
    prefill chunk's logits (model dtype and the float32 copy sampling reads), 16 hidden
    vectors a token (residual, norms, attention in and out, expert in and out) and a dense
    MLP's three intermediates; on CUDA plus CUDA_RESERVE. Attention scores are not counted
    (transformers' sdpa does not keep them)."""
    c = getattr(config, "text_config", None) or config
    H, V = int(c.hidden_size), int(c.vocab_size)
    F = int(getattr(c, "intermediate_size", 0) or 0)
    act = chunk * (V * (itemsize + 4) + (16 * H + 3 * F) * itemsize)
    return act + (CUDA_RESERVE if cuda else 0)


@dataclass
class MemoryPlan:
    """What goes where (bytes), and the verdict (`fits`; else `shortfall` and `advice`)."""

    gpu_memory: int
    host_memory: int | None
    context: int
    experts_on: str
    dense_format: str
    kv_format: str
    dense: int
    kv: dict[str, int]  # attention kind -> bytes at `context` tokens
    workspace: int
    slot_bytes: int  # one slot in every sparse layer
    num_experts: int
    top_k: int
    slots: int  # per layer (the most that fit, or the asked number)
    host_rows: int  # expert rows held in host memory
    pageable: int  # expert rows left in the checkpoint file
    cuda: bool = True
    shortfall: list[str] = field(default_factory=list)  # one line per part over, with by how much
    advice: list[str] = field(default_factory=list)  # what to change, with its effect
    modeled: dict[str, Any] | None = None  # modeled_decode's figures (with Budget.rates)
    chosen: str = ""  # kv_format "fit": what it picked and why

    @property
    def fits(self) -> bool:
        return not self.shortfall

    @property
    def slab(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def residency(self) -> float:
        return self.slots / self.num_experts

    @property
    def device_total(self) -> int:
        return self.dense + sum(self.kv.values()) + self.workspace + self.slab

    def to_dict(self) -> dict[str, Any]:
        props = ("fits", "slab", "residency", "device_total")
        return asdict(self) | {p: getattr(self, p) for p in props}

    def message(self) -> str:
        """One line: the verdict, and what to change when it does not fit."""
        if self.fits:
            return (
                f"fits: {self.slots} of {self.num_experts} experts per layer on the device "
                f"(residency {self.residency:.3g}), {fmt_bytes(self.device_total)} of "
                f"{fmt_bytes(self.gpu_memory)}"
            )
        fix = f"; change: {', '.join(self.advice)}" if self.advice else ""
        tried = f"; {self.chosen}" if self.chosen else ""
        return "does not fit: " + "; ".join(self.shortfall) + fix + tried

    def check(self, what: str = "") -> MemoryPlan:
        """This plan, or MemoryPlanError with `message()` (after `what: `) when it does not
        fit."""
        if not self.fits:
            raise MemoryPlanError(f"{what}: {self.message()}" if what else self.message())
        return self

    def table(self) -> str:
        kv = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.kv.items())
        where = "device" if self.cuda else "device (host memory: CPU backend)"
        host = "every expert" if self.host_memory is None else fmt_bytes(self.host_memory)
        rows = [
            (f"dense part ({self.dense_format})", self.dense, where),
            (
                f"KV cache, {self.context} tokens ({self.kv_format}: {kv})",
                sum(self.kv.values()),
                where,
            ),
            (
                "workspace (prefill chunk" + (", CUDA reserve)" if self.cuda else ")"),
                self.workspace,
                where,
            ),
            (
                f"expert slab: {self.slots}/{self.num_experts} per layer "
                f"(residency {self.residency:.3g}, top_k {self.top_k})",
                self.slab,
                where,
            ),
            (f"device total (budget {fmt_bytes(self.gpu_memory)})", self.device_total, where),
            (f"expert rows held (host budget {host})", self.host_rows, "host RAM"),
            ("expert rows pageable", self.pageable, "checkpoint file"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"  plan (experts_on={self.experts_on})"]
        lines += [f"    {n:<{width}}  {fmt_bytes(b):>11}  {w}" for n, b, w in rows]
        lines.append(f"  verdict    {self.message()}")
        if self.chosen:
            lines.append(f"  chosen     {self.chosen}")
        if self.modeled:
            d = self.modeled
            lines.append(
                f"  modeled    {d['ms_per_token']:.2f} ms/token decode on {d['rates']} "
                f"(roofline: dense {d['dense_ms']:.2f} + KV {d['kv_ms']:.2f} + experts "
                f"{d['experts_ms']:.2f} ms; {d['misses_per_layer']:.2f} of top_k {self.top_k} "
                "missing the slab per layer, routing independent of the cache)"
            )
        return "\n".join(lines)


def plan_memory(m: ModelMemory, b: Budget) -> MemoryPlan:
    """The plan of model `m` under budget `b` (never raises for a plan that does not fit:
    `MemoryPlan.check` does). kv_format "fit": the plan of the first format of
    `b.kv_fit` that fits and that every layer kind takes (none fits: the last's)."""
    if b.kv_format == "fit":
        return _fit_kv(m, b)
    if b.dtype is not None:  # dequantized dense weights, KV values and activations in it
        size = rowformat().FLOAT_ITEMSIZE[vocab.canonical_dtype(b.dtype)]
        float_dense = m.dense["float"] // m.itemsize * size
        m = replace(m, dense=m.dense | {"float": float_dense}, itemsize=size)
    context = b.context if b.context is not None else (m.max_context or 4096)
    dense = m.dense[str(b.dense_format)]
    kv = kv_by_kind(m.config, m.itemsize, context, b.kv_format)
    chunk = min(b.prefill_chunk, context)
    ws = workspace_bytes(m.config, m.itemsize, chunk, b.cuda)
    where = vocab.parse_experts_on(b.experts_on)[0]
    least = m.top_k if where == "gpu" else 0
    if b.slots is not None and not least <= b.slots <= m.num_experts:
        raise ValueError(
            f"slots={b.slots} must be in [{least}, {m.num_experts}] with "
            f"experts_on={b.experts_on!r} (top_k={m.top_k}, {m.num_experts} experts)"
        )
    left = b.gpu_memory - dense - sum(kv.values()) - ws
    fit = max(left, 0) // m.slot_bytes if m.slot_bytes else m.num_experts
    slots = b.slots if b.slots is not None else max(least, min(m.num_experts, fit))
    p = MemoryPlan(
        b.gpu_memory, b.host_memory, context, b.experts_on, str(b.dense_format), b.kv_format,
        dense, kv, ws, m.slot_bytes, m.num_experts, m.top_k, slots, 0, 0, b.cuda,
    )  # fmt: skip
    if p.device_total > b.gpu_memory:
        over = p.device_total - b.gpu_memory
        p.shortfall.append(
            f"device memory {fmt_bytes(b.gpu_memory)} is short by {fmt_bytes(over)} ({_parts(p)})"
        )
        p.advice += _device_advice(m, b, p, least)
    _host(m, b, p, where)
    if b.rates is not None and b.cuda and p.fits:
        p.modeled = modeled_decode(m, p, b.rates)
    return p


def modeled_decode(m: ModelMemory, p: MemoryPlan, r: Rates) -> dict[str, Any]:
    """Plan `p`'s decode time per token at batch 1, as a roofline on rates `r`: every dense
    byte and the KV cache of `p.context` tokens read once at r.hbm_gbps (the embedding's
    bytes too: an upper bound by its size); per MoE layer, k (1 - C / E) of the top_k
    experts miss the C-slot slab (machine.expected_misses: routing independent of the
    cache; reuse between tokens only lowers it). The hits and the misses computed on the
    CPU run side by side (a CPU layer pays its hand-off and a call per expert, its rows read
    at r.cpu_gbps); a copied miss crosses the host link (r.h2d_gbps, a copy overhead)
    beside them, then is computed on the device. experts_on 'gpu' copies every miss,
    'cpu' copies none, 'hybrid' the number (whole, or all) that is fastest, up to its cap.
    Host launch costs and Python are not counted."""
    hbm = r.hbm_gbps * 1e9
    k = p.top_k
    misses = expected_misses(k, p.slots, p.num_experts)
    where, caps = vocab.parse_experts_on(p.experts_on)
    experts = 0.0
    for i, row in enumerate(m.rows):
        counts = {"gpu": [misses], "cpu": [0.0]}.get(where)
        if counts is None:  # hybrid: up to its cap (hybrid:M), else any number
            cap = caps[min(i, len(caps) - 1)] if isinstance(caps, list) else caps
            most = misses if cap is None else min(misses, cap)
            counts = [float(n) for n in range(int(most) + 1)] + [most]
        copy = row / (r.h2d_gbps * 1e9) + r.copy_overhead_us * 1e-6
        cpu = row / (r.cpu_gbps * 1e9) + r.cpu_expert_us * 1e-6
        times = []
        for copied in counts:
            on_cpu = misses - copied
            cpu_s = r.cpu_layer_us * 1e-6 + on_cpu * cpu if on_cpu > 0 else 0.0
            side = max((k - misses) * row / hbm, copied * copy, cpu_s)
            times.append(side + copied * row / hbm)
        experts += min(times)
    dense, kv = p.dense / hbm, sum(p.kv.values()) / hbm
    return {
        "rates": r.name,
        "ms_per_token": (dense + kv + experts) * 1e3,
        "dense_ms": dense * 1e3,
        "kv_ms": kv * 1e3,
        "experts_ms": experts * 1e3,
        "misses_per_layer": misses,
    }


def _parts(p: MemoryPlan) -> str:
    """The device's parts in order, and the first that crosses the budget."""
    parts = [
        ("dense part", p.dense),
        ("KV cache", sum(p.kv.values())),
        ("workspace", p.workspace),
        (f"slab of {p.slots} slots", p.slab),
    ]
    total, over = 0, ""
    for name, n in parts:
        total += n
        if not over and total > p.gpu_memory:
            over = name
    shown = " + ".join(f"{name} {fmt_bytes(n)}" for name, n in parts)
    return f"{shown} = {fmt_bytes(total)}; over from the {over}"


def _takes(config: Any, fmt: str) -> bool:
    """Whether every layer kind of `config` has a cache in KV format `fmt`."""
    try:
        check_kv_format(config, fmt)
    except ValueError:  # a kind with no compact form (linear attention's state)
        return False
    return True


def _fit_kv(m: ModelMemory, b: Budget) -> MemoryPlan:
    tried: list[MemoryPlan] = []
    for fmt in (f for f in b.kv_fit if _takes(m.config, f)):
        tried.append(plan_memory(m, replace(b, kv_format=fmt)))
        if tried[-1].fits:
            break
    p = tried[-1]
    if not p.fits:
        names = ", ".join(t.kv_format for t in tried)
        p.chosen = f"kv_format 'fit': no format fits ({names} tried; {p.kv_format} shown)"
    elif len(tried) > 1:
        first = tried[0]
        short = fmt_bytes(first.device_total - b.gpu_memory)
        p.chosen = f"kv_format 'fit' chose {p.kv_format!r}: {first.kv_format!r} is short by {short}"
    else:
        p.chosen = f"kv_format 'fit' chose {p.kv_format!r}"
    return p


def _device_advice(m: ModelMemory, b: Budget, p: MemoryPlan, least: int) -> list[str]:
    """What would bring the device part within budget, each with its effect."""
    out = [f"gpu_memory >= {fmt_bytes(p.device_total)}"]
    fixed = p.device_total - p.slab
    if "slots" in b.levers and b.slots is not None and b.slots > least and fixed < b.gpu_memory:
        most = max(least, min(b.slots, (b.gpu_memory - fixed) // max(m.slot_bytes, 1)))
        out.append(f"slots <= {most}")
    if "experts_on" in b.levers and least and p.slots == least and b.slots is None:
        out.append(f"experts_on='cpu' or 'hybrid' (no slot needed: -{fmt_bytes(p.slab)})")
    if "dtype" in b.levers and m.itemsize > 2:  # the same slots, half the floats
        half = plan_memory(m, replace(b, dtype="bfloat16", slots=p.slots, levers=()))
        out.append(f"dtype='bfloat16' (-{fmt_bytes(p.device_total - half.device_total)})")
    native = m.dense["native"]
    if "dense_format" in b.levers and b.dense_format == "float" and native < p.dense:
        out.append(f"dense_format='native' (-{fmt_bytes(p.dense - native)})")
    if "kv_format" in b.levers and b.kv_format == "auto" and m.itemsize > 1:
        try:
            small = sum(kv_by_kind(m.config, m.itemsize, p.context, "fp8").values())
            out.append(f"kv_format='fp8' (-{fmt_bytes(sum(p.kv.values()) - small)})")
        except ValueError:  # a recurrent state has no fp8 form
            pass
    if "context" in b.levers:
        room = b.gpu_memory - p.dense - least * m.slot_bytes
        n = _most_tokens(m, b, p.context, room)
        if n:
            out.append(f"context <= {n} tokens")
    return out


def _most_tokens(m: ModelMemory, b: Budget, context: int, room: int) -> int:
    """The longest context (< `context`) whose KV cache and workspace fit `room` bytes
    (0: none); both grow with tokens, so a bisection."""

    def need(n: int) -> int:
        kv = sum(kv_by_kind(m.config, m.itemsize, n, b.kv_format).values())
        return kv + workspace_bytes(m.config, m.itemsize, min(b.prefill_chunk, n), b.cuda)

    lo, hi = 0, context - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= room else (lo, mid - 1)
    return lo


def _host(m: ModelMemory, b: Budget, p: MemoryPlan, where: str) -> None:
    """Host memory: the rows held under the budget (tiers.choose_held's layer-balanced
    choice), the rest pageable; a shortfall where the rest cannot stay in the file."""
    total = m.slot_bytes * m.num_experts
    fixed = 0 if b.cuda else p.dense + p.slab
    if b.host_memory is None:
        p.host_rows = total
        return
    held = choose_held(m.rows, m.num_experts, max(b.host_memory - fixed, 0))
    p.host_rows = sum(len(h) * r for h, r in zip(held, m.rows, strict=True))
    p.pageable = total - p.host_rows
    why = m.pageable if where == "gpu" else f"experts_on={b.experts_on!r} reads them in place"
    all_rows = bool(p.pageable) and why is not None  # every row must be held
    if fixed <= b.host_memory and not all_rows:
        return
    parts = [("the dense part and slab (CPU backend)", fixed)] if fixed else []
    parts += [("every expert row", total)] if all_rows else []
    need = sum(n for _, n in parts)
    shown = " + ".join(f"{what} {fmt_bytes(n)}" for what, n in parts)
    p.shortfall.append(
        f"host memory {fmt_bytes(b.host_memory)} is short by {fmt_bytes(need - b.host_memory)} "
        f"({shown}{'; ' + str(why) if all_rows else ''})"
    )
    if "host_memory" in b.levers:
        p.advice.append(f"host_memory >= {fmt_bytes(need)}")
    if "experts_on" in b.levers and all_rows and fixed <= b.host_memory and m.pageable is None:
        p.advice.append("experts_on='gpu' (rows beyond the budget stay in the file)")
