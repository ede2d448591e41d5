"""Plain-torch reference of the device-resident logical cache (`psr_kernels.cache_state`).

The spec's `use` and `prefetch` (docs/PSR.md, "Logical cache") and the slot map that
mirrors them, on one layer's row of the packed state (`CacheLayout`), written with
fixed-shape tensor ops only: no `.item()`, no boolean indexing, no data-dependent
shapes, so it runs on any device without a host read. It is the CPU path of the
sync-free decode step and the oracle the Triton kernels are tested against;
`psr/cache.py` (`LogicalCache`) and `psr/runtime/slots.py` (`SlotMap`) stay the readable
references both are tested equal to.

Recency is a stamp per expert from a per-layer clock: a larger stamp is more recent,
and every operation hands out fresh clock values, so stamps of members are distinct and
"least recent" is the member with the smallest stamp.
"""

from __future__ import annotations

import torch

from psr_kernels.cache_state import (
    CAPACITY,
    CLOCK,
    COUNTS,
    KIND_MISS,
    KIND_PREFETCH,
    MISS_N,
    PF_N,
    PREFETCHES,
    CacheLayout,
)

_BIG = torch.iinfo(torch.int32).max


class _Row:
    """Named views of one layer's state row (writes go to the state)."""

    def __init__(self, state: torch.Tensor, layout: CacheLayout, layer: int) -> None:
        lo = layout
        row = state[layer]
        E, S = lo.num_experts, lo.num_slots
        self.row = row
        self.stamp = row[lo.stamp : lo.stamp + E]
        self.member = row[lo.member : lo.member + E]
        self.pending = row[lo.pending : lo.pending + E]
        self.slot_of = row[lo.slot_of : lo.slot_of + E]
        self.slot_expert = row[lo.slot_expert : lo.slot_expert + S]
        self.header = row[lo.header : lo.header + lo.header_size]
        self.miss_list = row[lo.miss_list : lo.miss_list + 3 * lo.top_k].view(lo.top_k, 3)
        self.pf_list = row[lo.pf_list : lo.pf_list + 3 * lo.pf_rows].view(lo.pf_rows, 3)


def _owned(
    slot_of: torch.Tensor, slot_expert: torch.Tensor, capacity: torch.Tensor
) -> torch.Tensor:
    """Per slot: among the first `capacity` and mapped by the logical member it holds."""
    S = slot_expert.shape[0]
    s = torch.arange(S, device=slot_expert.device, dtype=slot_expert.dtype)
    holder = slot_of[slot_expert.clamp(min=0).long()]
    return (slot_expert >= 0) & (holder == s) & (s < capacity)


def _lowest(flags: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the first `count` True entries in ascending order (padded with
    len(flags) where there are fewer), as a fixed-shape [count] tensor."""
    n = flags.shape[0]
    idx = torch.arange(n, device=flags.device)
    key = torch.where(flags, idx, torch.full_like(idx, n))
    out = torch.sort(key).values
    if count > n:
        out = torch.cat([out, torch.full((count - n,), n, device=flags.device, dtype=out.dtype)])
    return out[:count]


def cache_use_ref(state: torch.Tensor, layout: CacheLayout, layer: int, ids: torch.Tensor) -> None:
    """Spec `use` of this token's routed `ids` ([k] or [1, k], distinct, k <= top_k) on
    `layer`'s row: misses inserted in ascending id order, each into a free place or
    evicting the least recent member not routed now (its slot reused; a free place takes
    the lowest slot no member maps to); then the routed ids become most recent, a lower
    id more recent. Writes the miss copy list (slot, expert, KIND_MISS) with its count
    and adds routed / hits / misses / prefetches used to the counters."""
    r = _Row(state, layout, layer)
    dev, dt = state.device, state.dtype
    E, K = layout.num_experts, layout.top_k
    ids = ids.reshape(-1).long()
    k = ids.shape[0]
    e_ar = torch.arange(E, device=dev, dtype=dt)
    routed = torch.zeros(E, dtype=torch.bool, device=dev).index_fill_(0, ids, True)
    member, pending = r.member != 0, r.pending != 0
    capacity = r.header[CAPACITY]
    hits = (routed & member).sum()
    used = (routed & pending).sum()
    miss = routed & ~member
    n_miss = miss.sum()
    free = (capacity - member.sum()).clamp(min=0)
    j = torch.arange(K, device=dev)
    miss_ids = _lowest(miss, K)  # ascending; == E past the misses
    valid = j < n_miss
    evicting = valid & (j >= free)
    # The least recent members not routed now, in eviction order.
    key = torch.where(member & ~routed, r.stamp, torch.full_like(r.stamp, _BIG))
    victims = torch.sort(key, stable=True).indices[(j - free).clamp(min=0, max=E - 1)]
    free_slots = _lowest(_owned(r.slot_of, r.slot_expert, capacity).logical_not(), K)
    free_slots = free_slots.clamp(max=layout.num_slots - 1)
    slot = torch.where(evicting, r.slot_of[victims].long(), free_slots[j.clamp(max=K - 1)])
    slot = torch.where(valid, slot, -1)
    ins = (miss_ids[:, None] == e_ar[None, :]) & valid[:, None]  # [K, E]
    out = (victims[:, None] == e_ar[None, :]) & evicting[:, None]
    inserted, evicted = ins.any(0), out.any(0)
    new_slot = (ins * slot[:, None]).sum(0)
    s_ar = torch.arange(layout.num_slots, device=dev)
    put = (slot[:, None] == s_ar[None, :]) & valid[:, None]  # [K, S]
    r.slot_expert.copy_(
        torch.where(put.any(0), (put * miss_ids[:, None]).sum(0), r.slot_expert.long())
    )
    r.slot_of.copy_(torch.where(inserted, new_slot, torch.where(evicted, -1, r.slot_of.long())))
    r.member.copy_(((member & ~evicted) | inserted).to(dt))
    r.pending.copy_((pending & ~evicted & ~routed).to(dt))
    # Routed ids most recent, the lower id more recent: stamp = clock + (# routed above it).
    clock = r.header[CLOCK]
    above = routed.sum() - routed.to(torch.int64).cumsum(0)
    r.stamp.copy_(torch.where(routed, clock + above, r.stamp.long()))
    r.header[CLOCK] += k
    counts = torch.stack([torch.full_like(hits, k), hits, n_miss, torch.zeros_like(hits), used])
    r.header[COUNTS : COUNTS + 5] += counts.to(dt)
    rows = torch.stack(
        [slot, torch.where(valid, miss_ids, -1), torch.full_like(slot, KIND_MISS)], 1
    )
    r.miss_list.copy_(rows)
    r.header[MISS_N] = n_miss.to(dt)


def cache_prefetch_ref(
    state: torch.Tensor, layout: CacheLayout, layer: int, predicted: torch.Tensor, n: int
) -> None:
    """Spec `prefetch` of the first `n` of `predicted` ([>= n] or [1, >= n]) into `layer`'s
    row, in order: a member becomes most recent (no copy); another id is inserted as most
    recent, evicting the least recent member when the cache is full (a free place takes
    the lowest slot no member maps to). Writes the prefetch copy list (slot, expert,
    KIND_PREFETCH), compacted, with its count, and adds the prefetches to the counters."""
    if not 0 <= n <= layout.max_prefetch:
        raise ValueError(f"cache_prefetch_ref: n={n} must be in [0, {layout.max_prefetch}]")
    r = _Row(state, layout, layer)
    dev, dt = state.device, state.dtype
    E, S, R = layout.num_experts, layout.num_slots, layout.pf_rows
    pred = predicted.reshape(-1).long()[:n]
    e_ar = torch.arange(E, device=dev)
    s_ar = torch.arange(S, device=dev)
    rows_ar = torch.arange(R, device=dev)
    capacity = r.header[CAPACITY]
    member, pending = r.member != 0, r.pending != 0
    stamp, slot_of, slot_expert = r.stamp.long(), r.slot_of.long(), r.slot_expert.long()
    clock = r.header[CLOCK].long()
    rows = torch.full((R, 3), -1, dtype=torch.int64, device=dev)
    rows[:, 2] = KIND_PREFETCH
    pos = torch.zeros((), dtype=torch.int64, device=dev)
    for j in range(n):
        oh = e_ar == pred[j]
        ins = ~(member & oh).any()
        full = member.sum() >= capacity
        victim = torch.argmin(torch.where(member, stamp, torch.full_like(stamp, _BIG)))
        out = (e_ar == victim) & ins & full
        free = _lowest(_owned(slot_of, slot_expert, capacity).logical_not(), 1)[0]
        # index_select, not slot_of[victim]: a 0-dim index would be read on the host
        victim_slot = slot_of.index_select(0, victim.view(1))[0]
        slot = torch.where(full, victim_slot, free.clamp(max=S - 1))
        member = (member & ~out) | (oh & ins)
        pending = (pending & ~out) | (oh & ins)
        slot_of = torch.where(oh & ins, slot, torch.where(out, -1, slot_of))
        slot_expert = torch.where((s_ar == slot) & ins, pred[j], slot_expert)
        stamp = torch.where(oh, clock, stamp)
        clock = clock + 1
        row = torch.stack([slot, pred[j], torch.full_like(slot, KIND_PREFETCH)])
        rows = torch.where(((rows_ar == pos) & ins)[:, None], row[None, :], rows)
        pos = pos + ins.long()
    r.member.copy_(member.to(dt))
    r.pending.copy_(pending.to(dt))
    r.stamp.copy_(stamp)
    r.slot_of.copy_(slot_of)
    r.slot_expert.copy_(slot_expert)
    r.header[CLOCK] = clock.to(dt)
    r.header[COUNTS + PREFETCHES] += pos.to(dt)
    r.pf_list.copy_(rows)
    r.header[PF_N] = pos.to(dt)
