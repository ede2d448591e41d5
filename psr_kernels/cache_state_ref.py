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

Both run once per MoE layer and decode token on the CPU, where every tensor op costs a
few microseconds, so they are written in few, cheap ops (31 for `use`, 12 more with the
miss-copy cap, `capped=True`; 12 + 16 per id for `prefetch`; a formulation with dense one-hot
masks took 109 and 27 + 52 per id):
  - Where an id goes is one ordering of the slots, the "place key": a free slot (among
    the first C, held by no member) keys below zero, lowest slot first; a member's slot
    keys by its stamp, least recent first; any other slot keys `_BIG`. The j-th miss
    takes the j-th place (free places first: the spec evicts only when the cache is
    full); a prefetch takes the first place.
  - They work on an int64 copy of the row (indices and values alike, so no casts),
    written back once, with one scratch cell after it: writes that must not happen are
    sent there, instead of masking dense one-hot tensors.
  - The four per-expert fields are consecutive, so `_Row.experts` ([4, E]) reads or
    writes an expert's (stamp, member, pending, slot_of) with one index.
They rely on the state's invariants, which both keep: a member's slot_of is its slot
(among the first C, slot_expert naming it back), a non-member's is -1, member and
pending are 0 / 1, and pending ids are members.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from psr_kernels.cache_state import (
    CAPACITY,
    CLOCK,
    COUNTS,
    CPU_EXPERTS,
    CPU_N,
    HITS,
    INSERTS,
    KIND_MISS,
    KIND_PREFETCH,
    MISS_N,
    MISSES,
    PF_N,
    PREFETCH_USED,
    PREFETCHES,
    ROUTED,
    CacheLayout,
)

_BIG = torch.iinfo(torch.int32).max  # above any stamp: not a place
# Rows of `_Row.experts`.
_STAMP, _MEMBER, _PENDING, _SLOT_OF = range(4)


@dataclass(frozen=True)
class _Consts:
    """Fixed int64 tensors of one layout on one device (read, never written)."""

    sizes: tuple[int, ...]  # the sizes of a working copy's fields (`_Row`)
    zero: torch.Tensor  # [1] 0 (also the scratch cell a working copy starts with)
    one: torch.Tensor  # [1] 1
    big: torch.Tensor  # [1] _BIG
    first: torch.Tensor  # [1] a place key below every other
    slot_ids: torch.Tensor  # [S + 1] 0..S; element S of a place key is its scratch cell
    free_key: torch.Tensor  # [S + 1] slot s -> s - (S + 1) < 0: free places, lowest first
    # cache_use_ref
    routed_k: torch.Tensor  # [2] K, K: the clock and routed counter steps of K ids
    above: torch.Tensor  # [K] K-1 .. 0: routed ids above each of K ascending ids
    use_counts: torch.Tensor  # [6] header fields it adds to: clock, routed, hits, used,
    # misses, cpu experts (uncapped: the first five)
    use_counts_gpu: torch.Tensor  # [5] the first five (uncapped: no cpu experts)
    miss_n: torch.Tensor  # [1] MISS_N
    lists: torch.Tensor  # [2] header fields of the list counts: MISS_N, CPU_N
    miss_rows: torch.Tensor  # [K] 0 .. K-1
    list_at: torch.Tensor  # [K] 0, 3, 6, ...: the miss list's rows
    use_at: torch.Tensor  # [8, 1] row offsets of its writes
    use_vals: torch.Tensor  # [4, K] the constant values of its first four: 0, 0, -1, 1
    scratch_at: torch.Tensor  # [1] the scratch cell's index in a working copy (W)
    no_miss: torch.Tensor  # [1] -1: the id of a miss row past the count
    no_misses: torch.Tensor  # [K, 3] an empty miss list: rows (-1, -1, KIND_MISS)
    # cache_prefetch_ref
    clocks: torch.Tensor  # [R, 1] 0 .. R-1: clock steps of the predicted ids
    evicted: torch.Tensor  # [3, 1] member, pending, slot_of of an evicted id: 0, 0, -1
    kind_pf: torch.Tensor  # [1] KIND_PREFETCH
    pf_rows: torch.Tensor  # [R, 1] 0 .. R-1
    no_pf: torch.Tensor  # [3] a prefetch row past the count: (-1, -1, KIND_PREFETCH)


def _consts(layout: CacheLayout, device: torch.device) -> _Consts:
    """`_make_consts`, made once per layout and device in eager mode; under torch.compile
    made in the graph (constants there), as dynamo does not trace an lru_cache."""
    if torch.compiler.is_compiling():
        return _make_consts(layout, device)
    return _cached_consts(layout, device)


def _make_consts(layout: CacheLayout, device: torch.device) -> _Consts:
    lo = layout
    E, S, K, R = lo.num_experts, lo.num_slots, lo.top_k, lo.pf_rows

    def t(*v: int) -> torch.Tensor:
        # Filled on the device, not copied from the host (`torch.tensor`): psr counts
        # host-to-device copies in the decode step (psr.eval.host_probe), and there are none.
        return torch.stack([torch.full((), x, dtype=torch.int64, device=device) for x in v])

    def ar(*v: int) -> torch.Tensor:
        return torch.arange(*v, device=device)

    ml = lo.miss_list
    use_at = (E, 2 * E, 3 * E, E, 3 * E, lo.slot_expert, ml, ml + 1)
    counts = (
        CLOCK, COUNTS + ROUTED, COUNTS + HITS, COUNTS + PREFETCH_USED, COUNTS + MISSES,
        COUNTS + CPU_EXPERTS,
    )  # fmt: skip
    return _Consts(
        sizes=(lo.slot_expert, S, lo.header_size, 3 * K, K, 3 * R, 1),
        zero=t(0),
        one=t(1),
        big=t(_BIG),
        first=t(-_BIG),
        slot_ids=ar(S + 1),
        free_key=ar(S + 1) - (S + 1),
        routed_k=t(K, K),
        above=ar(K - 1, -1, -1),
        use_counts=t(*counts),
        use_counts_gpu=t(*counts[:5]),
        miss_n=t(MISS_N),
        lists=t(MISS_N, CPU_N),
        miss_rows=ar(K),
        list_at=ar(0, 3 * K, 3),
        use_at=t(*use_at)[:, None],
        use_vals=t(0, 0, -1, 1)[:, None].expand(4, K).contiguous(),
        scratch_at=t(lo.width),
        no_miss=t(-1),
        no_misses=t(-1, -1, KIND_MISS).expand(K, 3).contiguous(),
        clocks=ar(R)[:, None],
        evicted=t(0, 0, -1)[:, None],
        kind_pf=t(KIND_PREFETCH),
        pf_rows=ar(R)[:, None],
        no_pf=t(-1, -1, KIND_PREFETCH),
    )


_cached_consts = functools.lru_cache(maxsize=64)(_make_consts)


class _Row:
    """An int64 working copy of one layer's row, with a scratch cell after it, and named
    views of it; `done()` writes it back."""

    def __init__(self, state: torch.Tensor, layout: CacheLayout, layer: int, c: _Consts) -> None:
        lo = layout
        self.state, self.layer = state, layer
        self.work = torch.cat([state[layer], c.zero])
        # The layout's fields in order: stamp, member, pending and slot_of ([4, E]: one
        # index reads or writes an expert's four), slot_expert, header, the copy lists.
        parts = self.work.split_with_sizes(c.sizes)
        experts, self.slot_expert, self.header, miss, self.cpu_list, pf, _ = parts
        self.experts = experts.view(4, lo.num_experts)
        self.stamp, _, self.pending, self.slot_of = self.experts.unbind()
        self.miss_list, self.pf_list = miss.view(lo.top_k, 3), pf.view(lo.pf_rows, 3)

    def field(self, at: int) -> torch.Tensor:
        """Header field `at` as a [1] view."""
        return self.header[at : at + 1]

    def done(self) -> None:
        """Write the working copy back to the state."""
        self.state[self.layer].copy_(self.work[:-1])


def _place_key(r: _Row, c: _Consts) -> torch.Tensor:
    """[S + 1] the place key of every slot (module docstring); element S is a scratch
    cell, where a non-member's slot_of -1 lands."""
    key = torch.where(c.slot_ids < r.header[CAPACITY], c.free_key, c.big)
    key.index_put_((r.slot_of,), r.stamp)  # members: their recency
    return key


def _padded(t: torch.Tensor, fill: torch.Tensor, n: int) -> torch.Tensor:
    """`t` ([S]) extended to at least `n` entries with `fill` ([1]); itself when S >= n (the
    layout decides: a slab smaller than top_k, experts_on cpu / hybrid)."""
    return t if t.shape[0] >= n else torch.cat([t, fill.expand(n - t.shape[0])])


def cache_use_ref(
    state: torch.Tensor,
    layout: CacheLayout,
    layer: int,
    ids: torch.Tensor,
    *,
    capped: bool = True,
) -> None:
    """Spec `use` of this token's routed `ids` ([k] or [1, k], distinct, k <= top_k) on
    `layer`'s row: misses inserted in ascending id order, each into a free place or
    evicting the least recent member not routed now (its slot reused; a free place takes
    the lowest slot no member maps to); then the routed ids become most recent, a lower
    id more recent. Writes the miss copy list (slot, expert, KIND_MISS) with its count
    and adds routed / hits / misses / prefetches used to the counters. Past the row's
    miss-copy cap (`INSERTS`), misses are not inserted: they are listed, ascending, in the
    CPU list with its count and counted as cpu experts.

    `capped=False` (experts_on "gpu", whose cap is top_k): the cap is not read and the CPU
    list, its count and the cpu experts counter are not written (they stay -1, 0 and 0),
    9 ops fewer; on a row whose cap is top_k the state is bit-identical to capped=True's."""
    c = _consts(layout, state.device)
    r = _Row(state, layout, layer, c)
    S, K = layout.num_slots, layout.top_k
    routed = ids.reshape(-1).long().sort().values  # ascending
    k = routed.shape[0]
    routed_k = c.routed_k if k == K else c.routed_k.new_full((2,), k)  # [k, k]
    cols = r.experts.index_select(1, routed)  # [4, k]: stamp, member, pending, slot_of
    hits_used = cols[_MEMBER:_SLOT_OF].sum(1)  # [hits, prefetches used]
    n_miss = routed_k[:1] - hits_used[:1]
    # The misses ascending, first: a stable sort of the member flags keeps id order.
    miss = routed.index_select(0, cols[_MEMBER].sort(stable=True).indices)
    if k < K:
        miss = torch.cat([miss, c.no_miss.expand(K - k)])
    # The j-th miss goes to the j-th place; routed members are not places (kept).
    key = _place_key(r, c)
    key.index_put_((cols[_SLOT_OF],), c.big)  # a miss's slot_of -1: the scratch cell
    # The K first places, in order (keys are distinct but _BIG ones, which no miss takes).
    # A slab of S < K slots is padded with non-places (slot -1: never a valid row's).
    place_key, place = torch.topk(_padded(key[:S], c.big, K), K, largest=False)
    slot_expert = _padded(r.slot_expert, c.no_miss, K)
    if capped:  # the first `inserts` misses are inserted, the others listed for the CPU
        # At most capacity - hits: the free places and the members not routed now.
        room = r.header[CAPACITY : CAPACITY + 1] - hits_used[:1]
        n_ins = torch.minimum(n_miss, torch.minimum(r.header[INSERTS : INSERTS + 1], room))
        n_cpu = n_miss - n_ins
        at_cpu = (c.miss_rows + n_ins).clamp_(max=K - 1)
        r.cpu_list.copy_(torch.where(c.miss_rows < n_cpu, miss.index_select(0, at_cpu), c.no_miss))
    else:  # every miss inserted
        n_ins = n_miss
    valid = c.miss_rows < n_ins  # rows with an inserted miss
    evict = valid & (place_key >= 0)  # ... into a member's place
    victim = slot_expert.index_select(0, place)
    # Every change in one write, by miss row; a row without a miss, or into a free place,
    # sends the writes it must not make to the scratch cell:
    #   the evicted member: member 0, pending 0, slot_of -1;
    #   the miss: member 1, slot_of = its place, slot_expert[place] = the miss;
    #   the miss list's row: (place, miss) (the list starts as empty rows).
    r.miss_list.copy_(c.no_misses)
    at = torch.stack([victim, victim, victim, miss, miss, place, c.list_at, c.list_at]) + c.use_at
    do = torch.stack([evict, evict, evict, valid, valid, valid, valid, valid])
    place_miss = torch.stack([place, miss])
    r.work.index_put_(
        (torch.where(do, at, c.scratch_at),), torch.cat([c.use_vals, place_miss, place_miss])
    )
    # The routed ids most recent, a lower id more recent (stamp = clock + # routed above
    # it), and no longer pending.
    r.stamp.index_copy_(0, routed, r.header[CLOCK] + (c.above if k == K else c.above[K - k :]))
    r.pending.index_fill_(0, routed, 0)
    if capped:
        r.header.index_add_(0, c.use_counts, torch.cat([routed_k, hits_used, n_miss, n_cpu]))
        r.header.index_copy_(0, c.lists, torch.cat([n_ins, n_cpu]))
    else:
        r.header.index_add_(0, c.use_counts_gpu, torch.cat([routed_k, hits_used, n_miss]))
        r.header.index_copy_(0, c.miss_n, n_miss)
    r.done()


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
    c = _consts(layout, state.device)
    r = _Row(state, layout, layer, c)
    # One [1] tensor per id (a 0-dim index would be read on the host), and its stamp.
    pred = predicted.reshape(-1)[:n, None].long().unbind()
    clock = (r.header[CLOCK] + c.clocks[:n]).unbind()
    key = _place_key(r, c)
    places = key[: layout.num_slots]  # kept current below
    fields = r.experts[_MEMBER:]  # member, pending, slot_of
    pos = c.zero  # rows written so far
    for p, now in zip(pred, clock, strict=True):
        _, member, pending, own = r.experts.index_select(1, p)
        key.index_put_((own,), c.first)  # a member's own slot first (else: the scratch)
        best, place = places.min(0, keepdim=True)
        new = c.one - member
        # A new id in a member's place (best >= 0) evicts that member; otherwise this
        # write lands on p's own column, rewritten in full next.
        victim = torch.where(best >= 0, r.slot_expert.index_select(0, place), p)
        fields.index_copy_(1, victim, c.evicted)
        r.experts.index_copy_(1, p, torch.stack([now, c.one, pending + new, place]))
        r.slot_expert.index_copy_(0, place, p)  # a member's own slot already names it
        places.index_copy_(0, place, now)
        # Every id writes row `pos`; only an insertion keeps it (pos moves on).
        r.pf_list.index_copy_(0, pos, torch.stack([place, p, c.kind_pf], 1))
        pos = pos + new
    r.field(CLOCK).add_(n)
    r.field(COUNTS + PREFETCHES).add_(pos)
    r.field(PF_N).copy_(pos)
    r.pf_list.copy_(torch.where(c.pf_rows < pos, r.pf_list, c.no_pf))
    r.done()
