"""Memory tiers: which experts the store holds in host memory under a `host_memory=` budget,
and where in the checkpoint's files the others stay (pageable rows).

The budget counts what psr keeps in host memory: on the CPU backend the dense weights, the
slab (host memory there) and the held expert rows; on CUDA the held rows alone (pinned; the
dense weights and the slab are on the GPU). Experts beyond it stay in the memory-mapped
checkpoint and are read (pread, page cache or disk) when a copy needs them; routing never
depends on the tier, only the copies' time does.

A row can stay in the file only if the file holds exactly its bytes: a float checkpoint
loaded in its own dtype with `expert_format` native (gate, up, down as separate tensors or
slices of a fused gate_up), or a GGUF file (rows are the file's blocks). Rows that are
converted at load (another dtype, quantized, transposed, pre-quantized blocks) must all
fit the budget, or the load fails saying why.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:  # the budget arithmetic is torch-free (`psr inspect` of a GGUF file)
    import psr_kernels as pk
    from psr.store import Segment

# A row's file segments, or None if the file does not hold the row's bytes.
Locator = Callable[[int], "list[Segment] | None"]

SAFE_FRACTION = 0.8  # of MemAvailable: the default budget when the model does not fit


def meminfo() -> dict[str, int]:
    """/proc/meminfo's MemTotal and MemAvailable in bytes ({} where there is none)."""
    out: dict[str, int] = {}
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def fmt_bytes(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def default_budget(fixed: int, rows: int) -> int | None:
    """The budget when none is given: None (hold every expert) when `fixed` (dense + slab in
    host memory) + every row fits SAFE_FRACTION of MemAvailable, else that fraction."""
    avail = meminfo().get("MemAvailable")
    if avail is None or fixed + rows <= SAFE_FRACTION * avail:
        return None
    return int(SAFE_FRACTION * avail)


class MemoryOptions(TypedDict, total=False):
    """`psr.load`'s memory-tier keywords."""

    host_memory: str | int | None  # '48GB', '48GiB', bytes, 'unlimited'; None: the default
    host_profile: str | Path | Sequence[Sequence[float]] | None  # routing counts [layer][e]


def memory_options(kw: dict[str, Any] | MemoryOptions) -> tuple[Any, Any]:
    """(host_memory, host_profile) of `load`'s keywords; an unknown keyword is a TypeError,
    as for any other function."""
    extra = sorted(set(kw) - set(MemoryOptions.__annotations__))
    if extra:
        raise TypeError(f"load() got an unexpected keyword argument {extra[0]!r}")
    return kw.get("host_memory"), kw.get("host_profile")


@dataclass(frozen=True)
class TierPlan:
    """Per MoE layer the experts the store holds; the rest are pageable."""

    held: list[list[int]]
    budget: int | None  # bytes (None: unlimited)
    held_bytes: int
    pageable_bytes: int

    def num_held(self) -> list[int]:
        return [len(h) for h in self.held]


def load_profile(
    profile: str | Path | Sequence[Sequence[float]], shape: tuple[int, int]
) -> list[list[float]]:
    """A routing profile: per MoE layer, per expert, how often it was routed to (a nested
    list, or a JSON file holding one or {"counts": ...}); checked against (layers, experts)."""
    data: Any = profile
    if isinstance(profile, (str, Path)):
        try:
            data = json.loads(Path(profile).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"host_profile {profile}: cannot read a JSON profile: {e}") from None
        if isinstance(data, dict):
            data = data.get("counts")
    L, E = shape
    ok = (
        isinstance(data, (list, tuple))
        and len(data) == L
        and all(isinstance(r, (list, tuple)) and len(r) == E for r in data)
        and all(isinstance(v, (int, float)) and v >= 0 for r in data for v in r)
    )
    if not ok:
        raise ValueError(
            f"host_profile must hold {L} lists (one per MoE layer) of {E} non-negative counts"
        )
    return [[float(v) for v in r] for r in data]


def choose_held(
    row_bytes: Sequence[int],
    num_experts: int,
    room: int,
    profile: Sequence[Sequence[float]] | None = None,
) -> list[list[int]]:
    """Which experts to hold in `room` bytes of rows: by a routing profile (the most-routed
    (layer, expert) rows first, ties by layer balance), else layer-balanced (each layer
    the same number of rows, the remainder to the first layers; experts in id order)."""
    L = len(row_bytes)
    if room >= sum(row_bytes) * num_experts:
        return [list(range(num_experts)) for _ in range(L)]
    held: list[list[int]] = [[] for _ in range(L)]
    if profile is not None:
        order = sorted(
            ((l, e) for l in range(L) for e in range(num_experts)),
            key=lambda le: (-profile[le[0]][le[1]], le[1], le[0]),
        )
        for l, e in order:
            if row_bytes[l] <= room:
                held[l].append(e)
                room -= row_bytes[l]
        return [sorted(h) for h in held]
    # Round-robin over layers: layer-balanced also when rows differ per layer (GGUF).
    for e in range(num_experts):
        for l in range(L):
            if row_bytes[l] <= room:
                held[l].append(e)
                room -= row_bytes[l]
    return held


def plan_tiers(
    budget: int | None,
    fixed: int,
    row_bytes: Sequence[int],
    num_experts: int,
    pageable_ok: str | None,
    profile: Sequence[Sequence[float]] | None,
    cuda: bool,
) -> TierPlan:
    """Check the budget and choose the held experts. `fixed`: host bytes that are not rows
    (dense weights and slab on the CPU backend, 0 on CUDA); `pageable_ok`: None if rows can
    stay in the file, else why not. Errors name the budget and what it misses."""
    total = sum(row_bytes) * num_experts
    if budget is None:
        return TierPlan([list(range(num_experts))] * len(row_bytes), None, total, 0)
    mem = meminfo().get("MemTotal")
    if mem is not None and budget > mem:
        what = "pin (page-locked memory cannot exceed RAM)" if cuda else "hold"
        raise ValueError(
            f"host_memory={fmt_bytes(budget)} exceeds what this machine can {what}: "
            f"MemTotal is {fmt_bytes(mem)}"
        )
    if budget < fixed:
        raise ValueError(
            f"host_memory={fmt_bytes(budget)} ({budget} bytes) is below what the model keeps "
            f"in host memory besides experts: {fmt_bytes(fixed)} ({fixed} bytes: dense weights "
            "and the expert slab on the CPU backend)"
        )
    held = choose_held(row_bytes, num_experts, budget - fixed, profile)
    held_bytes = sum(len(h) * b for h, b in zip(held, row_bytes, strict=True))
    if held_bytes < total and pageable_ok is not None:
        raise ValueError(
            f"host_memory={fmt_bytes(budget)} holds {fmt_bytes(held_bytes)} of the "
            f"{fmt_bytes(total)} of experts, but they cannot stay in the checkpoint file "
            f"({pageable_ok}): all must fit the budget (>= {fmt_bytes(fixed + total)})"
        )
    return TierPlan(held, budget, held_bytes, total - held_bytes)


# --- where rows are in the files -------------------------------------------------------


def gguf_locator(parts: dict[str, Any], fmt: pk.RowFormat, hidden: int, ffn: int) -> Locator:
    """A GGUF layer's rows: each part's file bytes at its aligned offset in the row
    (`GGMLLayout`), zero segments for the padding between them."""
    import psr_kernels as pk

    lay = pk.GGMLLayout.of(fmt, hidden, ffn)
    starts = (lay.gate, lay.up, lay.down)

    def locate(e: int) -> list[Segment]:
        segs: list[Segment] = []
        at = 0
        for p, start in zip(("gate", "up", "down"), starts, strict=True):
            t = parts[p]
            if start > at:
                segs.append(("", 0, start - at, "padding"))
            segs.append((str(t.file), t.offset + e * t.row_bytes, t.row_bytes, t.name))
            at = start + t.row_bytes
        if lay.nbytes > at:
            segs.append(("", 0, lay.nbytes - at, "padding"))
        return segs

    return locate


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def float_locators(
    ckpt: Any,
    family: str,
    moe_idx: list[int],
    num_experts: int,
    store_dtype: str,
    fmt: pk.FormatLike,
) -> tuple[list[Locator] | None, str | None]:
    """Per MoE layer, expert -> its row's segments in a safetensors checkpoint; or (None,
    why not) when the rows are converted at load (quantized, another dtype, transposed)."""
    import psr_kernels as pk
    from psr.models.families import expert_tensor_names, family_of, fused_expert_names

    rf = pk.RowFormat.parse(fmt)
    if not rf.is_float or rf.dtype not in (None, store_dtype):
        return None, f"expert_format={rf.name!r} converts them at load"
    if family_of(family).expert_layout in ("gpt_oss", "llama4"):
        return None, "this family's experts are transposed at load"

    def same_dtype(name: str) -> str | None:
        have = _ST_DTYPES.get(ckpt.dtype(name))
        if have != store_dtype:
            return (
                f"tensor {name!r} is {ckpt.dtype(name)} in the file, the store holds {store_dtype}"
            )
        return None

    out: list[Locator] = []
    for d in moe_idx:
        fused = fused_expert_names(family, d)
        pair = next(((g, n) for g, n in fused if g in ckpt and n in ckpt), None)
        if pair is not None:
            why = same_dtype(pair[0]) or same_dtype(pair[1])
            if why:
                return None, why

            def fused_rows(e: int, gu: str = pair[0], dn: str = pair[1]) -> list[Segment]:
                return [(*ckpt.span(gu, e), gu), (*ckpt.span(dn, e), dn)]

            out.append(fused_rows)
            continue
        first = next(c for c in expert_tensor_names(family, d, 0) if all(n in ckpt for n in c))
        why = next((w for w in map(same_dtype, first) if w), None)
        if why:
            return None, why

        def locate(e: int, d: int = d) -> list[Segment]:
            names = next(c for c in expert_tensor_names(family, d, e) if all(n in ckpt for n in c))
            return [(*ckpt.span(n), n) for n in names]

        out.append(locate)
    return out, None


def gguf_locators(
    ckpt: Any, moe_idx: list[int], formats: list[pk.RowFormat], hidden: int, ffn: int
) -> list[Locator]:
    """Per MoE layer of a GGUF file, expert -> its row's segments (the file's blocks)."""
    return [
        gguf_locator(ckpt.expert_tensors(d), f, hidden, ffn)
        for d, f in zip(moe_idx, formats, strict=True)
    ]


@dataclass(frozen=True)
class Tiers:
    """What the fill registers as pageable: per layer the held experts and the locator."""

    held: list[set[int]]
    locate: list[Locator]

    def pageable(self, layer: int, expert: int) -> list[Segment] | None:
        if expert in self.held[layer]:
            return None
        segs = self.locate[layer](expert)
        if segs is None:  # a locator only exists where every row can stay in the file
            raise AssertionError(f"layer {layer} expert {expert} has no file segments")
        return segs
