"""The store's device-indexed copies as torch custom ops, so that torch.compile traces a
decode step whole (no graph break at the C++ store) and orders the copies right.

`psr_store::gather(slab, rows, count, store, layer, side)` and `psr_store::join(slab, store,
layer)` call `ExpertStore.gather` / `join` on the store registered under the integer
`store` (an opaque C++ object cannot be an op argument). Both declare that they write the
layer's `slab`, and gather reads its copy list: the compiler keeps a gather after the kernel
that wrote the list, the join of a layer before the kernels that read its slots, and every
slab write in program order. `psr_store::cpu_experts(y, x, ids, weights, cpu_list, ...)` and
`psr_store::cpu_join(y, ...)` (experts_on cpu / hybrid) both declare that they write the
layer's CPU result `y`: its reads stay after the join. `psr_store::cpu_expert_ffn` is the
CPU expert kernels (a compiled CPU decode forward runs them rather than the reference).
Eager decoding calls the store directly (the functions below pick the op only while
compiling): no custom-op dispatch.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from psr.store import ExpertStore, cpu_expert_ffn
from psr_kernels.rowformat import RowFormat

_STORES: weakref.WeakValueDictionary[int, ExpertStore] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def register(store: ExpertStore) -> int:
    """An id under which the ops find `store` (held weakly)."""
    key = next(_ids)
    _STORES[key] = store
    return key


def _store(key: int) -> ExpertStore:
    store = _STORES.get(key)
    if store is None:
        raise RuntimeError(f"psr_store: no live store registered as {key}")
    return store


@torch.library.custom_op("psr_store::gather", mutates_args=("slab",))
def _gather(
    slab: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, store: int, layer: int, side: bool
) -> None:
    _store(store).gather(layer, rows, count, side=side)


@_gather.register_fake
def _(
    slab: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, store: int, layer: int, side: bool
) -> None:
    return None


@torch.library.custom_op("psr_store::join", mutates_args=("slab",))
def _join(slab: torch.Tensor, store: int, layer: int) -> None:
    _store(store).join(layer)


@_join.register_fake
def _(slab: torch.Tensor, store: int, layer: int) -> None:
    return None


@torch.library.custom_op("psr_store::cpu_experts", mutates_args=("y",))
def _cpu_experts(
    y: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    cpu_list: torch.Tensor,
    store: int,
    layer: int,
) -> None:
    _store(store).cpu_experts(layer, x, ids, weights, cpu_list, y)


@_cpu_experts.register_fake
def _(
    y: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    cpu_list: torch.Tensor,
    store: int,
    layer: int,
) -> None:
    return None


@torch.library.custom_op("psr_store::cpu_join", mutates_args=("y",))
def _cpu_join(y: torch.Tensor, store: int, layer: int) -> None:
    _store(store).cpu_join(layer)


@_cpu_join.register_fake
def _(y: torch.Tensor, store: int, layer: int) -> None:
    return None


@torch.library.custom_op("psr_store::cpu_expert_ffn", mutates_args=())
def _cpu_expert_ffn(
    x: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    slot_table: torch.Tensor | None,
    hidden_size: int,
    ffn_size: int,
    fmt: str | None,
    group_size: int,
    skip_absent: bool,
) -> torch.Tensor:
    return _kernels_ffn(
        x, rows, slots, weights, slot_table, hidden_size, ffn_size, fmt, group_size, skip_absent
    )


def _kernels_ffn(
    x: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    slot_table: torch.Tensor | None,
    hidden_size: int,
    ffn_size: int,
    fmt: RowFormat | str | None,
    group_size: int,
    skip_absent: bool,
) -> torch.Tensor:
    """The op's body, called directly when eager (no custom-op dispatch)."""
    return cpu_expert_ffn(
        x, rows, slots, weights, hidden_size, ffn_size, fmt=fmt, group_size=group_size,
        slot_table=slot_table, out_dtype=x.dtype, skip_absent=skip_absent,
    )  # fmt: skip


@_cpu_expert_ffn.register_fake
def _(
    x: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    slot_table: torch.Tensor | None,
    hidden_size: int,
    ffn_size: int,
    fmt: str | None,
    group_size: int,
    skip_absent: bool,
) -> torch.Tensor:
    return x.new_empty(x.shape)


def cpu_kernels_ffn(
    x: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    fmt: RowFormat,
    group_size: int,
    slot_table: torch.Tensor | None,
    skip_absent: bool,
) -> torch.Tensor:
    """`psr.store.cpu_expert_ffn` (out in x's dtype), as the custom op while torch.compile
    traces: a compiled CPU decode forward runs the C++ CPU kernels, not the reference."""
    if torch.compiler.is_compiling():  # the op's schema takes the format's word
        y: torch.Tensor = torch.ops.psr_store.cpu_expert_ffn(
            x, rows, slots, weights, slot_table, hidden_size, ffn_size, fmt.kernel_fmt,
            group_size, skip_absent,
        )  # fmt: skip
        return y
    return _kernels_ffn(
        x, rows, slots, weights, slot_table, hidden_size, ffn_size, fmt, group_size, skip_absent
    )


def cpu_experts(
    store: ExpertStore,
    key: int,
    y: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    cpu_list: torch.Tensor,
) -> None:
    """`store.cpu_experts(...)` into `y`, as the custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        torch.ops.psr_store.cpu_experts(y, x, ids, weights, cpu_list, key, layer)
    else:
        store.cpu_experts(layer, x, ids, weights, cpu_list, y)


def cpu_join(store: ExpertStore, key: int, y: torch.Tensor, layer: int) -> None:
    """`store.cpu_join(layer)` (declared as writing `y`), as the custom op while compiling."""
    if torch.compiler.is_compiling():
        torch.ops.psr_store.cpu_join(y, key, layer)
    else:
        store.cpu_join(layer)


def gather(
    store: ExpertStore,
    key: int,
    slab: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    count: torch.Tensor,
    side: bool,
) -> None:
    """`store.gather(...)`, as the custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        torch.ops.psr_store.gather(slab, rows, count, key, layer, side)
    else:
        store.gather(layer, rows, count, side=side)


def join(store: ExpertStore, key: int, slab: torch.Tensor, layer: int) -> None:
    """`store.join(layer)`, as the custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        torch.ops.psr_store.join(slab, key, layer)
    else:
        store.join(layer)
