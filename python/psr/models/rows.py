"""The expert rows a load puts in the host store, one pipeline for every source.

A `RowSource` says, per MoE layer, how to read an expert's parts (a safetensors
checkpoint's matrices, a built model's experts module, a GGUF file's blocks, a
pre-quantized checkpoint's blocks), the row format the store and kernels take, and how the
parts become the row the store registers (cast, quantized, or packed blocks). `make_store`
sizes the store from it, `fill_store` registers every row (the ones the tier plan leaves in
the file as pageable), `fill_from_cache` reads a quantized-expert cache instead.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

import psr_kernels as pk
from psr.models.checkpoint import CheckpointError
from psr.models.quant_cache import QuantCache
from psr.models.tiers import Locator, TierPlan, Tiers
from psr.runtime.spec import MoESpec
from psr.store import ExpertStore, LayerSpec
from psr.store.cpu_kernels import tile_q4k

# int4's group along the input dimension: the rows, their byte size and the quantized-expert
# cache's key must agree on it.
GROUP_SIZE = 128

PartsReader = Callable[[int], list[torch.Tensor]]  # expert id -> its parts, as the source holds
Pack = Callable[[int, list[torch.Tensor]], list[torch.Tensor]]  # (layer, parts) -> its row


@dataclass(frozen=True)
class RowSource:
    """Where a load's expert rows come from and what they are, per MoE layer."""

    readers: Sequence[PartsReader]
    formats: list[pk.RowFormat]  # each layer's row format, as the runtime takes it
    dtype: torch.dtype  # the store's element type
    numel: list[int]  # a row's elements of `dtype`
    pack: Pack
    label: str  # named in the progress bar
    locators: list[Locator] | None = None  # each row's file segments, where rows can stay
    why_not: str | None = None  # why rows cannot stay in the file (None: they can)
    release: Callable[[int], None] | None = None  # after layer i is in (drops its pages)

    @property
    def row_bytes(self) -> list[int]:
        return [n * self.dtype.itemsize for n in self.numel]

    def tiers(self, plan: TierPlan) -> Tiers | None:
        """The pageable rows of `plan` (None: every row held)."""
        if not plan.pageable_bytes or self.locators is None:
            return None
        return Tiers([set(h) for h in plan.held], self.locators)


def matrix_source(
    readers: Sequence[PartsReader],
    spec: MoESpec,
    dtype: torch.dtype,
    fmt: pk.RowFormat,
    label: str,
) -> RowSource:
    """Experts read as float matrices (gate, up, down, or fused gate_up, down), kept in
    `dtype` (float formats with their own dtype: that one) or quantized into one uint8 row
    each (quantized formats)."""
    L, H, F = len(readers), spec.hidden_size, spec.ffn_size
    if fmt.is_quant:
        nbytes = pk.QuantLayout.of(fmt, H, F, GROUP_SIZE).nbytes

        def quantize(i: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
            return [_quantized_row(parts, F, fmt)]

        return RowSource(readers, [fmt] * L, torch.uint8, [nbytes] * L, quantize, label)
    dt = getattr(torch, fmt.dtype) if fmt.dtype is not None else dtype

    def cast(i: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p.to(dt).contiguous() for p in parts]

    # Float rows of any dtype run as the runtime's native rows (the store's dtype says which).
    return RowSource(readers, [pk.NATIVE] * L, dt, [spec.expert_numel] * L, cast, label)


def _quantized_row(parts: list[torch.Tensor], ffn: int, fmt: pk.RowFormat) -> torch.Tensor:
    if len(parts) == 2:  # fused: gate_up [2F, H], down [H, F]
        (gate, up), down = torch.split(parts[0], ffn), parts[1]
    else:
        gate, up, down = parts
    return pk.quantize_expert(gate, up, down, fmt, group_size=GROUP_SIZE)


def block_source(
    readers: Sequence[PartsReader],
    formats: list[pk.RowFormat],
    spec: MoESpec,
    label: str,
    locators: list[Locator] | None,
    why_not: str | None,
    release: Callable[[int], None] | None = None,
) -> RowSource:
    """Experts read as blocks (gate, up, down bytes; `formats`: each layer's GGML row
    format), packed as the file holds them: no dequantized or intermediate copy."""
    H, F = spec.hidden_size, spec.ffn_size
    lays = [pk.GGMLLayout.of(f, H, F) for f in formats]

    def pack(i: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return pk.pack_ggml_parts(lays[i], parts)

    return RowSource(readers, list(formats), torch.uint8, [lay.nbytes for lay in lays], pack,
                     label, locators, why_not, release)  # fmt: skip


def tiled_source(source: RowSource, spec: MoESpec) -> RowSource:
    """`source` with each layer's Q4_K parts in the CPU kernels' tiles of 8 rows
    (RowFormat.tiled: the same bytes a row, permuted within each tile; pack tiles them), for
    rows only the CPU kernels and the reference read. Rows left in the file (pageable)
    cannot be tiled: such a source is for loads that hold every row."""
    H, F = spec.hidden_size, spec.ffn_size
    formats = [f.tiled(H, F) for f in source.formats]
    if formats == source.formats:
        return source
    shapes = ((F, H), (F, H), (H, F))  # each part's rows, inputs

    def pack(i: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        types = formats[i].block_types
        out = [
            tile_q4k(p.view(n, -1), k).reshape(-1) if t.tile_rows > 1 else p
            for p, t, (n, k) in zip(parts, types, shapes, strict=True)
        ]
        return source.pack(i, out)

    return dataclasses.replace(source, formats=formats, pack=pack, locators=None)


def make_store(
    source: RowSource,
    num_experts: int,
    capacity: int,
    device: torch.device,
    copy_retries: int | None = None,
    held: list[int] | None = None,
) -> ExpertStore:
    """One store layer per MoE layer, its rows the source's; `held[i]` of layer i's rows
    in host memory (default all). The backend follows the compute device."""
    cuda = device.type == "cuda"
    held = held or [num_experts] * len(source.numel)
    return ExpertStore(
        [LayerSpec(num_experts, capacity, n, h) for n, h in zip(source.numel, held, strict=True)],
        source.dtype,
        backend="cuda" if cuda else "cpu",
        device=device.index if cuda else None,
        copy_retries=copy_retries,
    )


def fill_store(
    store: ExpertStore,
    source: RowSource,
    num_experts: int,
    progress: bool,
    tiers: Tiers | None = None,
) -> None:
    """Register every expert of every layer as the source packs it, behind one progress
    bar; experts `tiers` does not hold are registered pageable (their file segments, never
    read here)."""
    with tqdm(
        total=len(source.readers) * num_experts,
        desc=f"experts -> host store ({source.label})",
        disable=not progress,
        unit="expert",
    ) as bar:
        for i, read in enumerate(source.readers):
            for e in range(num_experts):
                segs = None if tiers is None else tiers.pageable(i, e)
                if segs is not None:
                    store.register_pageable(i, e, segs)
                else:
                    store.register(i, e, source.pack(i, read(e)))
                bar.update()
            if source.release is not None:
                source.release(i)


def fill_from_cache(
    cache: QuantCache, store: ExpertStore, source: RowSource, num_experts: int, progress: bool
) -> bool:
    """Fill the host store from the cache file, one layer at a time, after checking it:
    its header, then one expert per layer quantized afresh and compared byte for byte.
    False (with a warning) when it does not hold this checkpoint's rows."""
    if not cache.check():
        return False
    try:
        n, desc = len(source.readers), "experts <- quantized cache"
        bar = tqdm(cache.layers(), total=n, desc=desc, disable=not progress, unit="layer")
        for i, rows in enumerate(bar):
            e = (7 * i + 3) % num_experts  # a different expert per layer
            if not torch.equal(rows[e], source.pack(i, source.readers[i](e))[0]):
                cache.reject(f"layer {i} expert {e} differs from this checkpoint's")
                return False
            for e in range(num_experts):
                store.register(i, e, rows[e])
    except CheckpointError:
        raise  # the checkpoint itself is bad: say so, as a load without a cache would
    except Exception as err:  # an unreadable cache file is rebuilt, never trusted
        cache.reject(f"{type(err).__name__}: {err}")
        return False
    return True


def fill_cached(
    store: ExpertStore,
    source: RowSource,
    num_experts: int,
    progress: bool,
    tiers: Tiers | None,
    cache: QuantCache | None,
) -> None:
    """`fill_store`, or the rows from `cache` when it holds them (written there when it
    does not: a failed write only warns, the model loaded all the same)."""
    if cache is not None and fill_from_cache(cache, store, source, num_experts, progress):
        return
    fill_store(store, source, num_experts, progress, tiers)
    if cache is None:
        return
    try:
        cache.write([store.host(i) for i in range(len(source.readers))])
    except Exception as err:
        warnings.warn(
            f"could not write the quantized-expert cache {cache.path}: {type(err).__name__}: {err}",
            stacklevel=4,
        )
