"""The logical cache and its slot map as device-resident state, updated by kernels.

The spec's `use` and `prefetch` (docs/PSR.md, "Logical cache") run on the device, so a
decode step never reads the cache on the host: routing reads the membership as its bias
mask, the update writes a fixed-size copy list (slot, expert, kind) with a count that the
store's gather consumes, and counters accumulate until read.

State: one int32 tensor `[layers, layout.width]`, one row per MoE layer (`CacheLayout`):
  stamp[E]        recency: a larger stamp is more recent (fresh clock values each time)
  member[E]       1 where the expert is in the logical cache (the routing mask)
  pending[E]      1 where a prefetched expert has not been routed since (prefetches used)
  slot_of[E]      the slab slot of each member, -1 otherwise
  slot_expert[S]  the expert each slab slot holds or is loading, -1 when empty
  header          clock, capacity C (<= S), counters (COUNT_NAMES: routed, hits, misses,
                  prefetches, prefetches used, substituted, cpu experts), the non-finite
                  flag, miss and prefetch list counts, the CPU list's count, the miss-copy
                  cap m (offsets: the constants below, one definition)
  miss_list[k,3]  this step's miss copies (slot, expert, KIND_MISS), -1 rows past count
  cpu_list[k]     this step's misses not inserted (at most m are: experts_on cpu /
                  hybrid), ascending, -1 past the count: computed on the CPU
  pf_list[n,3]    this step's prefetch copies (slot, expert, KIND_PREFETCH), compacted
Stamps are int32: a sequence may run 2**31 / (k + n) decode steps per layer (over 10**8).

Kernels (one program per call, batch 1; `psr_kernels.cache_state_ref` is the torch
reference, written without host reads):
  cache_use(state, layout, layer, ids)               spec `use` of one token's routed ids
  cache_prefetch(state, layout, layer, pred, n)      spec `prefetch` of the first n ids
The `@triton.jit` steps `cache_use_step` / `cache_prefetch_step` take register values,
so the routing kernels can fuse them after their top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from psr_kernels._common import check_launchable, pow2

KIND_MISS = 0
KIND_PREFETCH = 1
# Header fields, relative to `CacheLayout.header`.
CLOCK = 0
CAPACITY = 1
COUNTS = 2  # the counters from here, in COUNT_NAMES order
# `substituted`: routed ids not in the layer's own exact (unbiased) top-k, counted by the
# routing (psr_kernels.decode) beside `use`'s counts.
# `cpu_experts`: misses `use` did not insert under the miss-copy cap (computed on the CPU).
COUNT_NAMES = (
    "routed", "hits", "misses", "prefetches", "prefetch_used", "substituted", "cpu_experts"
)  # fmt: skip
ROUTED, HITS, MISSES, PREFETCHES, PREFETCH_USED, SUBSTITUTED, CPU_EXPERTS = range(len(COUNT_NAMES))
FLAG = COUNTS + len(COUNT_NAMES)  # 1 once a router's input was not finite (NaN / inf)
MISS_N = FLAG + 1
PF_N = FLAG + 2
CPU_N = FLAG + 3
# The most misses `use` inserts per step (experts_on: top_k for "gpu", which is every
# miss; 0 for "cpu"); set by `reset_layer`.
INSERTS = FLAG + 4
HEADER_SIZE = FLAG + 5
_BIG = tl.constexpr(2**31 - 1)  # above any stamp; a constexpr, as kernels require
# The header fields as the kernels address them (constexprs, relative to OFF_HEADER):
# derived from the definitions above, so a new counter moves every kernel's offsets.
H_CLOCK = tl.constexpr(CLOCK)
H_CAPACITY = tl.constexpr(CAPACITY)
H_ROUTED = tl.constexpr(COUNTS + ROUTED)
H_HITS = tl.constexpr(COUNTS + HITS)
H_MISSES = tl.constexpr(COUNTS + MISSES)
H_PREFETCHES = tl.constexpr(COUNTS + PREFETCHES)
H_PREFETCH_USED = tl.constexpr(COUNTS + PREFETCH_USED)
H_SUBSTITUTED = tl.constexpr(COUNTS + SUBSTITUTED)
H_CPU_EXPERTS = tl.constexpr(COUNTS + CPU_EXPERTS)
H_CPU_N = tl.constexpr(CPU_N)
H_INSERTS = tl.constexpr(INSERTS)
H_FLAG = tl.constexpr(FLAG)
H_MISS_N = tl.constexpr(MISS_N)
H_PF_N = tl.constexpr(PF_N)


@dataclass(frozen=True)
class CacheLayout:
    """Offsets of one layer's row: E experts, S slab slots, at most k routed ids per `use`
    and n predicted ids per `prefetch` (n may be 0)."""

    num_experts: int
    num_slots: int
    top_k: int
    max_prefetch: int

    def __post_init__(self) -> None:
        E, S, k, n = self.num_experts, self.num_slots, self.top_k, self.max_prefetch
        for name, v in (("num_experts", E), ("num_slots", S), ("top_k", k)):
            least = 0 if name == "num_slots" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"CacheLayout: {name} must be an int >= {least}, got {v!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"CacheLayout: max_prefetch must be an int >= 0, got {n!r}")
        if not 0 <= S <= E:  # S < k: experts_on cpu / hybrid (capped `use`) only
            raise ValueError(f"CacheLayout: need 0 <= num_slots={S} <= num_experts={E}")
        if n > S:
            raise ValueError(f"CacheLayout: max_prefetch={n} exceeds num_slots={S}")

    stamp = property(lambda self: 0)
    member = property(lambda self: self.num_experts)
    pending = property(lambda self: 2 * self.num_experts)
    slot_of = property(lambda self: 3 * self.num_experts)
    slot_expert = property(lambda self: 4 * self.num_experts)
    header = property(lambda self: 4 * self.num_experts + self.num_slots)
    header_size = property(lambda self: HEADER_SIZE)
    miss_list = property(lambda self: self.header + HEADER_SIZE)
    cpu_list = property(lambda self: self.miss_list + 3 * self.top_k)
    pf_list = property(lambda self: self.cpu_list + self.top_k)
    pf_rows = property(lambda self: max(self.max_prefetch, 1))
    width = property(lambda self: self.pf_list + 3 * self.pf_rows)

    def constexprs(self) -> dict[str, int]:
        """The kernels' compile-time arguments for this layout."""
        return _constexprs(self)


@functools.lru_cache(maxsize=64)
def _constexprs(lo: CacheLayout) -> dict[str, int]:
    return dict(
        E=lo.num_experts,
        S=lo.num_slots,
        K=lo.top_k,
        W=lo.width,
        OFF_MEMBER=lo.member,
        OFF_PENDING=lo.pending,
        OFF_SLOT_OF=lo.slot_of,
        OFF_SLOT_EXPERT=lo.slot_expert,
        OFF_HEADER=lo.header,
        OFF_MISS=lo.miss_list,
        OFF_PF=lo.pf_list,
        BLOCK_E=pow2(lo.num_experts, 2),
        BLOCK_S=pow2(lo.num_slots, 2),
        BLOCK_K=pow2(lo.top_k, 2),
        PF_ROWS=lo.pf_rows,
        BLOCK_N=pow2(lo.pf_rows, 2),
    )


# --------------------------------------------------------------------------- host helpers


def new_state(num_layers: int, layout: CacheLayout, device: torch.device | str) -> torch.Tensor:
    """Empty caches (capacity 0 until `reset_layer`), every slot empty, counters zero."""
    state = torch.zeros(num_layers, layout.width, dtype=torch.int32, device=device)
    for lo, hi in (
        (layout.slot_of, layout.slot_of + layout.num_experts),
        (layout.slot_expert, layout.slot_expert + layout.num_slots),
        (layout.miss_list, layout.width),
    ):
        state[:, lo:hi] = -1
    return state


def reset_layer(
    state: torch.Tensor,
    layout: CacheLayout,
    layer: int,
    capacity: int,
    order: Sequence[int],
    slot_of: dict[int, int],
    slot_expert: Sequence[int],
    pending: Sequence[int] = (),
    inserts: int | None = None,
) -> None:
    """Set one layer's logical cache from the host (a new sequence, after prefill):
    `order` least recent first, `slot_of` its members' slots, `slot_expert` what each slab
    slot holds, `pending` the prefetched members not routed since, `inserts` the most
    misses a `use` inserts (None: all). Counters and the flag are kept; one host-to-device
    copy."""
    lo = layout
    E, S = lo.num_experts, lo.num_slots
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= S:
        raise ValueError(f"capacity {capacity!r} must be an int in [0, num_slots={S}]")
    if capacity < lo.top_k and inserts is None:
        raise ValueError(
            f"capacity {capacity} must be in [top_k={lo.top_k}, num_slots={S}] without a "
            "miss-copy cap (inserts=)"
        )
    if len(order) > capacity or len(set(order)) != len(order) or set(order) != set(slot_of):
        raise ValueError(f"cache order {list(order)} does not match slot map {slot_of}")
    if len(slot_expert) > S:
        raise ValueError(f"slot_expert has {len(slot_expert)} entries for {S} slots")
    row = torch.zeros(lo.width, dtype=torch.int32)
    row[lo.miss_list :] = -1
    row[lo.slot_of : lo.slot_of + E] = -1
    row[lo.slot_expert : lo.slot_expert + S] = -1
    for i, e in enumerate(order):
        row[lo.stamp + e] = i
        row[lo.member + e] = 1
        row[lo.slot_of + e] = slot_of[e]
    for s, e in enumerate(slot_expert):
        row[lo.slot_expert + s] = e
    if not set(pending) <= set(order):
        raise ValueError(f"pending prefetches {sorted(pending)} are not all in {list(order)}")
    for e in pending:
        row[lo.pending + e] = 1
    row[lo.header + CLOCK] = len(order)
    row[lo.header + CAPACITY] = capacity
    k = lo.top_k
    if inserts is not None and (isinstance(inserts, bool) or not 0 <= inserts <= k):
        raise ValueError(f"inserts={inserts!r} must be None or an int in [0, top_k={k}]")
    row[lo.header + INSERTS] = k if inserts is None else inserts
    counts = slice(lo.header + COUNTS, lo.header + COUNTS + len(COUNT_NAMES))
    flag = lo.header + FLAG
    row[counts] = state[layer, counts].cpu()
    row[flag] = state[layer, flag].cpu()
    state[layer].copy_(row.to(state.device), non_blocking=True)


def cache_order(state: torch.Tensor, layout: CacheLayout, layer: int) -> list[int]:
    """A layer's logical cache, least recent first (a host read: tests and diagnostics)."""
    return read_layer(state[layer].cpu(), layout)[0]


def read_layer(
    row: torch.Tensor, layout: CacheLayout
) -> tuple[list[int], list[int], dict[int, int], list[int]]:
    """(order least recent first, pending prefetches, slot of each member, expert of each
    slot) of one layer's row, already on the host."""
    E, S = layout.num_experts, layout.num_slots
    member = row[layout.member : layout.member + E].bool()
    stamp = row[layout.stamp : layout.stamp + E]
    ids = torch.arange(E)[member]
    order = ids[torch.argsort(stamp[member], stable=True)].tolist()
    pending = torch.nonzero(row[layout.pending : layout.pending + E]).flatten().tolist()
    slot_of = row[layout.slot_of : layout.slot_of + E].tolist()
    slot_expert = row[layout.slot_expert : layout.slot_expert + S].tolist()
    return order, pending, {e: slot_of[e] for e in order}, slot_expert


# --------------------------------------------------------------------------- kernels


@triton.jit
def _pick(vec, idx, at):
    """vec[at] for a scalar `at`, from a register vector indexed by `idx`."""
    return tl.sum(tl.where(idx == at, vec, 0), axis=0)


@triton.jit
def _owned(slot_of, slot_expert, scols, cols, capacity):
    """Per slot: within the capacity and mapped by the member it holds (from registers)."""
    valid = (slot_expert >= 0) & (scols < capacity)
    holder = tl.sum(
        tl.where((cols[None, :] == slot_expert[:, None]) & valid[:, None], slot_of[None, :], 0),
        axis=1,
    )
    return valid & (holder == scols)


@triton.jit
def _use_header(
    hdr, cpu_ptrs, kmask, c_exp, clock, n_routed, hits, used, n_miss, inserts,
    CAPPED: tl.constexpr,
):  # fmt: skip
    """`cache_use_step`'s header: the clock, counters and list counts; CAPPED: the CPU list
    (at `cpu_ptrs`), its count and the cpu experts counter."""
    if CAPPED:
        tl.store(cpu_ptrs, c_exp, mask=kmask)
        n_ins = tl.minimum(n_miss, inserts)
        tl.store(hdr + H_CPU_EXPERTS, tl.load(hdr + H_CPU_EXPERTS) + n_miss - n_ins)
        tl.store(hdr + H_CPU_N, n_miss - n_ins)
    else:
        n_ins = n_miss
    tl.store(hdr + H_CLOCK, clock + n_routed)
    tl.store(hdr + H_ROUTED, tl.load(hdr + H_ROUTED) + n_routed)
    tl.store(hdr + H_HITS, tl.load(hdr + H_HITS) + hits)
    tl.store(hdr + H_MISSES, tl.load(hdr + H_MISSES) + n_miss)
    tl.store(hdr + H_PREFETCH_USED, tl.load(hdr + H_PREFETCH_USED) + used)
    tl.store(hdr + H_MISS_N, n_ins)


@triton.jit
def cache_use_step(
    row_ptr,
    routed,  # [BLOCK_E] int1: the token's routed ids
    E: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    OFF_MEMBER: tl.constexpr,
    OFF_PENDING: tl.constexpr,
    OFF_SLOT_OF: tl.constexpr,
    OFF_SLOT_EXPERT: tl.constexpr,
    OFF_HEADER: tl.constexpr,
    OFF_MISS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAPPED: tl.constexpr,
):
    """Spec `use` on one layer's row (the module docstring's state); misses one at a time,
    lowest id first, each a free place (lowest unowned slot) or the eviction of the least
    recent member not routed now; past the row's miss-copy cap (`INSERTS`, and at most
    capacity - hits: a capacity below top_k never evicts a routed id) a miss is not
    inserted but listed for the CPU. CAPPED False (experts_on "gpu", cap top_k): the cap
    is not read, the CPU list, its count and the cpu experts counter not written."""
    cols = tl.arange(0, BLOCK_E)
    emask = cols < E
    scols = tl.arange(0, BLOCK_S)
    smask = scols < S
    kar = tl.arange(0, BLOCK_K)
    routed = routed & emask
    stamp = tl.load(row_ptr + cols, mask=emask, other=0)
    member = tl.load(row_ptr + OFF_MEMBER + cols, mask=emask, other=0) != 0
    pending = tl.load(row_ptr + OFF_PENDING + cols, mask=emask, other=0) != 0
    slot_of = tl.load(row_ptr + OFF_SLOT_OF + cols, mask=emask, other=-1)
    slot_expert = tl.load(row_ptr + OFF_SLOT_EXPERT + scols, mask=smask, other=-1)
    clock = tl.load(row_ptr + OFF_HEADER + H_CLOCK)
    capacity = tl.load(row_ptr + OFF_HEADER + H_CAPACITY)
    if CAPPED:
        inserts = tl.load(row_ptr + OFF_HEADER + H_INSERTS)
    else:
        inserts = K
    owned = _owned(slot_of, slot_expert, scols, cols, capacity)

    n_routed = tl.sum(routed.to(tl.int32), axis=0)
    hits = tl.sum((routed & member).to(tl.int32), axis=0)
    if CAPPED:  # at most capacity - hits: the free places and the members not routed now
        inserts = tl.minimum(inserts, capacity - hits)
    used = tl.sum((routed & pending).to(tl.int32), axis=0)
    pending = pending & ~routed
    size = tl.sum(member.to(tl.int32), axis=0)
    miss = routed & ~member
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    cand = member & ~routed
    m_slot = tl.full([BLOCK_K], -1, tl.int32)
    m_exp = tl.full([BLOCK_K], -1, tl.int32)
    c_exp = tl.full([BLOCK_K], -1, tl.int32)
    for j in tl.static_range(K):
        e = tl.min(tl.where(miss, cols, BLOCK_E), axis=0)
        if CAPPED:  # the first `inserts` misses (lowest ids) inserted, later ones on the CPU
            on_cpu = (e < BLOCK_E) & (j >= inserts)
            c_exp = tl.where((kar == j - inserts) & on_cpu, e, c_exp)
        valid = (e < BLOCK_E) & (j < inserts)
        full = size >= capacity
        low = tl.min(tl.where(cand, stamp, _BIG), axis=0)
        victim = tl.min(tl.where(cand & (stamp == low), cols, BLOCK_E), axis=0)
        evict = valid & full
        gone = (cols == victim) & evict
        free_slot = tl.min(tl.where(~owned & smask, scols, BLOCK_S), axis=0)
        slot = tl.where(evict, _pick(slot_of, cols, victim), free_slot)
        mine = (cols == e) & valid
        member = (member & ~gone) | mine
        pending = pending & ~gone
        cand = cand & ~gone
        slot_of = tl.where(mine, slot, tl.where(gone, -1, slot_of))
        owned = owned | ((scols == slot) & valid)
        slot_expert = tl.where((scols == slot) & valid, e, slot_expert)
        size += (valid & ~full).to(tl.int32)
        miss = miss & (cols != e)
        m_slot = tl.where((kar == j) & valid, slot, m_slot)
        m_exp = tl.where((kar == j) & valid, e, m_exp)
    # Routed ids most recent, a lower id more recent: clock + (# routed ids above it).
    above = n_routed - tl.cumsum(routed.to(tl.int32), axis=0)
    stamp = tl.where(routed, clock + above, stamp)

    tl.store(row_ptr + cols, stamp, mask=emask)
    tl.store(row_ptr + OFF_MEMBER + cols, member.to(tl.int32), mask=emask)
    tl.store(row_ptr + OFF_PENDING + cols, pending.to(tl.int32), mask=emask)
    tl.store(row_ptr + OFF_SLOT_OF + cols, slot_of, mask=emask)
    tl.store(row_ptr + OFF_SLOT_EXPERT + scols, slot_expert, mask=smask)
    kmask = kar < K
    tl.store(row_ptr + OFF_MISS + kar * 3 + 0, m_slot, mask=kmask)
    tl.store(row_ptr + OFF_MISS + kar * 3 + 1, m_exp, mask=kmask)
    tl.store(row_ptr + OFF_MISS + kar * 3 + 2, tl.zeros([BLOCK_K], tl.int32), mask=kmask)
    _use_header(
        row_ptr + OFF_HEADER, row_ptr + OFF_MISS + 3 * K + kar, kmask, c_exp, clock, n_routed,
        hits, used, n_miss, inserts, CAPPED,
    )  # fmt: skip


@triton.jit
def cache_prefetch_step(
    row_ptr,
    pred,  # [BLOCK_N] int32: predicted ids, the first N used
    N: tl.constexpr,
    E: tl.constexpr,
    S: tl.constexpr,
    OFF_MEMBER: tl.constexpr,
    OFF_PENDING: tl.constexpr,
    OFF_SLOT_OF: tl.constexpr,
    OFF_SLOT_EXPERT: tl.constexpr,
    OFF_HEADER: tl.constexpr,
    OFF_PF: tl.constexpr,
    PF_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Spec `prefetch` of pred[:N] on one layer's row, in order (module docstring)."""
    cols = tl.arange(0, BLOCK_E)
    emask = cols < E
    scols = tl.arange(0, BLOCK_S)
    smask = scols < S
    nar = tl.arange(0, BLOCK_N)
    stamp = tl.load(row_ptr + cols, mask=emask, other=0)
    member = tl.load(row_ptr + OFF_MEMBER + cols, mask=emask, other=0) != 0
    pending = tl.load(row_ptr + OFF_PENDING + cols, mask=emask, other=0) != 0
    slot_of = tl.load(row_ptr + OFF_SLOT_OF + cols, mask=emask, other=-1)
    slot_expert = tl.load(row_ptr + OFF_SLOT_EXPERT + scols, mask=smask, other=-1)
    clock = tl.load(row_ptr + OFF_HEADER + H_CLOCK)
    capacity = tl.load(row_ptr + OFF_HEADER + H_CAPACITY)
    owned = _owned(slot_of, slot_expert, scols, cols, capacity)
    size = tl.sum(member.to(tl.int32), axis=0)
    p_slot = tl.full([BLOCK_N], -1, tl.int32)
    p_exp = tl.full([BLOCK_N], -1, tl.int32)
    pos = 0
    for j in tl.static_range(N):
        e = _pick(pred, nar, j)
        mine = cols == e
        ins = tl.sum((member & mine).to(tl.int32), axis=0) == 0
        full = size >= capacity
        low = tl.min(tl.where(member, stamp, _BIG), axis=0)
        victim = tl.min(tl.where(member & (stamp == low), cols, BLOCK_E), axis=0)
        gone = (cols == victim) & ins & full
        free_slot = tl.min(tl.where(~owned & smask, scols, BLOCK_S), axis=0)
        slot = tl.where(full, _pick(slot_of, cols, victim), free_slot)
        new = mine & ins
        member = (member & ~gone) | new
        pending = (pending & ~gone) | new
        slot_of = tl.where(new, slot, tl.where(gone, -1, slot_of))
        owned = owned | ((scols == slot) & ins)
        slot_expert = tl.where((scols == slot) & ins, e, slot_expert)
        stamp = tl.where(mine, clock, stamp)
        clock += 1
        size += (ins & ~full).to(tl.int32)
        p_slot = tl.where((nar == pos) & ins, slot, p_slot)
        p_exp = tl.where((nar == pos) & ins, e, p_exp)
        pos += ins.to(tl.int32)

    tl.store(row_ptr + cols, stamp, mask=emask)
    tl.store(row_ptr + OFF_MEMBER + cols, member.to(tl.int32), mask=emask)
    tl.store(row_ptr + OFF_PENDING + cols, pending.to(tl.int32), mask=emask)
    tl.store(row_ptr + OFF_SLOT_OF + cols, slot_of, mask=emask)
    tl.store(row_ptr + OFF_SLOT_EXPERT + scols, slot_expert, mask=smask)
    rmask = nar < PF_ROWS
    tl.store(row_ptr + OFF_PF + nar * 3 + 0, p_slot, mask=rmask)
    tl.store(row_ptr + OFF_PF + nar * 3 + 1, p_exp, mask=rmask)
    tl.store(row_ptr + OFF_PF + nar * 3 + 2, tl.full([BLOCK_N], 1, tl.int32), mask=rmask)
    hdr = row_ptr + OFF_HEADER
    tl.store(hdr + H_CLOCK, clock)
    tl.store(hdr + H_PREFETCHES, tl.load(hdr + H_PREFETCHES) + pos)
    tl.store(hdr + H_PF_N, pos)


@triton.jit
def _cache_use_kernel(
    state_ptr,
    layer,
    ids_ptr,
    n_ids,
    W: tl.constexpr,
    E: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    OFF_MEMBER: tl.constexpr,
    OFF_PENDING: tl.constexpr,
    OFF_SLOT_OF: tl.constexpr,
    OFF_SLOT_EXPERT: tl.constexpr,
    OFF_HEADER: tl.constexpr,
    OFF_MISS: tl.constexpr,
    OFF_PF: tl.constexpr,
    PF_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAPPED: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    kar = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + kar, mask=kar < n_ids, other=-1)
    routed = tl.max(tl.where(cols[None, :] == ids[:, None], 1, 0), axis=0) != 0
    cache_use_step(
        state_ptr + layer * W,
        routed,
        E,
        S,
        K,
        OFF_MEMBER,
        OFF_PENDING,
        OFF_SLOT_OF,
        OFF_SLOT_EXPERT,
        OFF_HEADER,
        OFF_MISS,
        BLOCK_E,
        BLOCK_S,
        BLOCK_K,
        CAPPED,
    )


@triton.jit
def _cache_prefetch_kernel(
    state_ptr,
    layer,
    pred_ptr,
    N: tl.constexpr,
    W: tl.constexpr,
    E: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    OFF_MEMBER: tl.constexpr,
    OFF_PENDING: tl.constexpr,
    OFF_SLOT_OF: tl.constexpr,
    OFF_SLOT_EXPERT: tl.constexpr,
    OFF_HEADER: tl.constexpr,
    OFF_MISS: tl.constexpr,
    OFF_PF: tl.constexpr,
    PF_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    nar = tl.arange(0, BLOCK_N)
    pred = tl.load(pred_ptr + nar, mask=nar < N, other=-1)
    cache_prefetch_step(
        state_ptr + layer * W,
        pred,
        N,
        E,
        S,
        OFF_MEMBER,
        OFF_PENDING,
        OFF_SLOT_OF,
        OFF_SLOT_EXPERT,
        OFF_HEADER,
        OFF_PF,
        PF_ROWS,
        BLOCK_E,
        BLOCK_S,
        BLOCK_N,
    )


# --------------------------------------------------------------------------- wrappers


def check_state(op: str, state: torch.Tensor, layout: CacheLayout, layer: int) -> None:
    """The state tensor fits the layout and `layer` is one of its rows."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.int32:
        got = state.dtype if isinstance(state, torch.Tensor) else type(state).__name__
        raise TypeError(f"{op}: state must be an int32 tensor, got {got}")
    if state.dim() != 2 or state.shape[1] != layout.width or not state.is_contiguous():
        raise ValueError(
            f"{op}: state must be a contiguous [layers, {layout.width}] tensor for this "
            f"layout, got shape {list(state.shape)}"
        )
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < state.shape[0]:
        raise IndexError(f"{op}: layer {layer!r} out of range [0, {state.shape[0]})")


def _check_ids(op: str, name: str, ids: torch.Tensor, most: int, state: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: {name} must be an int32/int64 tensor")
    if ids.device != state.device:
        raise ValueError(f"{op}: {name} is on {ids.device}, the state on {state.device}")
    if ids.numel() > most or (ids.dim() == 2 and ids.shape[0] != 1) or ids.dim() > 2:
        raise ValueError(
            f"{op}: {name} must be [<= {most}] or [1, <= {most}], got {list(ids.shape)}"
        )


def cache_use(
    state: torch.Tensor,
    layout: CacheLayout,
    layer: int,
    ids: torch.Tensor,
    *,
    capped: bool = True,
) -> None:
    """Spec `use` of one token's routed `ids` (distinct, at most top_k) in one kernel
    (`cache_state_ref.cache_use_ref` is its reference, `capped` as there: False skips the
    miss-copy cap's CPU list where the cap is top_k). Ids are not range-checked here:
    they come from the routing kernel."""
    op = "cache_use"
    check_state(op, state, layout, layer)
    _check_ids(op, "ids", ids, layout.top_k, state)
    check_launchable(op, state, ids)
    flat = ids.reshape(-1)
    _cache_use_kernel[(1,)](
        state, layer, flat, flat.numel(), CAPPED=bool(capped), **layout.constexprs()
    )


def cache_prefetch(
    state: torch.Tensor, layout: CacheLayout, layer: int, predicted: torch.Tensor, n: int
) -> None:
    """Spec `prefetch` of the first `n` `predicted` ids in one kernel (reference:
    `cache_state_ref.cache_prefetch_ref`)."""
    op = "cache_prefetch"
    check_state(op, state, layout, layer)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= layout.max_prefetch:
        raise ValueError(f"{op}: n={n!r} must be an int in [0, {layout.max_prefetch}]")
    _check_ids(op, "predicted", predicted, max(layout.pf_rows, predicted.numel()), state)
    if predicted.numel() < n:
        raise ValueError(f"{op}: {predicted.numel()} predicted ids, fewer than n={n}")
    check_launchable(op, state, predicted)
    flat = predicted.reshape(-1)
    _cache_prefetch_kernel[(1,)](state, layer, flat, N=n, **layout.constexprs())
