"""The CPU decode step's logical-cache `use` and `prefetch`, each in one extension call
(csrc/cpu/router.cpp).

    cpu_cache_use(state, layout, layer, ids, capped=, logits=)
    cpu_cache_prefetch(state, layout, layer, predicted, n)

On the CPU every torch op of the decode step's reference (`psr_kernels.cache_state_ref`'s
`cache_use_ref`, 31 ops, 12 more capped, and `decode._flag`'s three) costs microseconds,
so a decode token paid ~0.3 ms per MoE layer for them. This is the same integer update of
one layer's int32 row in C++, and the router logits' non-finite flag: the row it leaves is
bit-identical to the references' (tests/runtime/test_cpu_router.py), so the logical cache,
the copy lists, the counts and every output are unchanged. `cache_prefetch_ref`'s loop
(about ten ops per predicted id, ~0.2 ms per MoE layer at n = 1) is the same in one call.
`psr_kernels.decode_step_ref` takes them as its `use` and `prefetch` on the CPU
(runtime/device_decode.py).
"""

from __future__ import annotations

import functools

import torch

import psr._C as _C
from psr_kernels import cache_state as cs
from psr_kernels.cache_state import CacheLayout


@functools.lru_cache(maxsize=64)
def _offsets(layout: CacheLayout) -> torch.Tensor:
    """The layout's offsets and header fields, in csrc/cpu/router.cpp's `Off` order."""
    lo = layout
    counts = (cs.ROUTED, cs.HITS, cs.MISSES, cs.PREFETCH_USED, cs.CPU_EXPERTS)
    return torch.tensor(
        [
            lo.num_experts, lo.num_slots, lo.top_k, lo.member, lo.pending, lo.slot_of,
            lo.slot_expert, lo.header, lo.miss_list, lo.cpu_list, cs.CLOCK, cs.CAPACITY,
            *(cs.COUNTS + c for c in counts), cs.FLAG, cs.MISS_N, cs.CPU_N, cs.INSERTS,
            cs.KIND_MISS, lo.pf_list, lo.pf_rows, cs.COUNTS + cs.PREFETCHES, cs.PF_N,
            cs.KIND_PREFETCH,
        ],
        dtype=torch.int64,
    )  # fmt: skip


def prepare_cache_use(layout: CacheLayout) -> None:
    """Build `layout`'s offsets now, at the step's setup: not from host data inside the
    first decode forward (the host probe counts that as a transfer in the MoE path)."""
    _offsets(layout)


def _row(state: torch.Tensor, layout: CacheLayout, layer: int, op: str) -> int:
    """The address of `layer`'s row of a checked CPU state."""
    if state.device.type != "cpu" or state.dtype != torch.int32 or not state.is_contiguous():
        raise ValueError(f"{op}: state must be a contiguous int32 CPU tensor")
    if state.dim() != 2 or state.shape[1] != layout.width:
        raise ValueError(f"{op}: state must be [layers, {layout.width}], got {list(state.shape)}")
    if not 0 <= layer < state.shape[0]:
        raise ValueError(f"{op}: layer {layer} outside [0, {state.shape[0]})")
    return int(state.data_ptr() + layer * layout.width * state.element_size())


def cpu_cache_prefetch(
    state: torch.Tensor, layout: CacheLayout, layer: int, predicted: torch.Tensor, n: int
) -> None:
    """`cache_prefetch_ref(state, layout, layer, predicted, n)` on the CPU state in one
    call: the same row, bit for bit. `predicted`: an integer CPU tensor (`[>= n]` or
    `[1, >= n]`) whose first n ids are prefetched in order."""
    op = "cpu_cache_prefetch"
    row = _row(state, layout, layer, op)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= layout.max_prefetch:
        raise ValueError(f"{op}: n={n!r} must be an int in [0, {layout.max_prefetch}]")
    if predicted.device.type != "cpu" or predicted.is_floating_point():
        raise ValueError(f"{op}: predicted must be an integer CPU tensor")
    if predicted.numel() < n:
        raise ValueError(f"{op}: {predicted.numel()} predicted ids, fewer than n={n}")
    pred = predicted.reshape(-1)[:n].to(torch.int64).contiguous()
    off = _offsets(layout)
    _C.cpu_cache_prefetch(row, off.data_ptr(), off.numel(), pred.data_ptr(), n)


def cpu_cache_use(
    state: torch.Tensor,
    layout: CacheLayout,
    layer: int,
    ids: torch.Tensor,
    *,
    capped: bool = True,
    logits: torch.Tensor | None = None,
) -> None:
    """`cache_use_ref(state, layout, layer, ids, capped=capped)` on the CPU state, preceded
    by the row's non-finite flag |= any element of `logits` not finite (`decode._flag`),
    in one call: the same row, bit for bit. `state` int32 `[layers, layout.width]`
    contiguous on the CPU; `ids` the routed ids (`[k]` or `[1, k]`, distinct, k <= top_k,
    any integer dtype); `logits` (optional) the router logits of any float dtype."""
    row = _row(state, layout, layer, "cpu_cache_use")
    if ids.device.type != "cpu" or ids.is_floating_point():
        raise ValueError("cpu_cache_use: ids must be an integer CPU tensor")
    if not 1 <= ids.numel() <= layout.top_k:
        raise ValueError(
            f"cpu_cache_use: need 1 to top_k={layout.top_k} routed ids, got {ids.numel()}"
        )
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    x, n = 0, 0
    if logits is not None:
        if logits.device.type != "cpu" or not logits.is_floating_point():
            raise ValueError("cpu_cache_use: logits must be a float CPU tensor")
        logits = logits.to(torch.float32).contiguous()
        x, n = logits.data_ptr(), logits.numel()
    off = _offsets(layout)
    _C.cpu_cache_use(row, off.data_ptr(), off.numel(), ids.data_ptr(), ids.numel(), capped, x, n)
