"""The device-resident logical cache (psr_kernels.cache_state) against the readable
references, psr.cache.LogicalCache + psr.runtime.slots.SlotMap: every cache order, slot,
pending prefetch, counter and copy list equal after every operation, on long random
streams over many (E, C, k, n), C = k, C = E, n = 0 and n = C, slabs with more slots than
the capacity, and caches that start part empty; and with a miss-copy cap (experts_on cpu /
hybrid: at most m misses inserted, the others in the CPU list), slabs smaller than top-k (C in
0, 1, k - 1). The torch reference runs the long
streams; the Triton kernel (interpreter here) runs shorter ones against it. Uncapped streams run
`use` with capped=False (experts_on gpu: the cap's code skipped) beside a twin with capped=True:
the states stay bit-identical."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import pytest
import torch

from psr.cache import LogicalCache
from psr.runtime.slots import SlotMap
from psr_kernels import cache_state as cs
from psr_kernels.cache_state_ref import cache_prefetch_ref, cache_use_ref


@dataclass
class Oracle:
    """One layer as the host-driven engine keeps it, plus the counters it adds."""

    cache: LogicalCache
    slots: SlotMap
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(cs.COUNT_NAMES, 0))
    last: list[tuple[int, int]] = field(default_factory=list)
    cap: int | None = None  # the miss-copy cap (None: the spec's use)
    cpu: list[int] = field(default_factory=list)  # the last use's misses not inserted

    def use(self, routed: list[int]) -> None:
        r = self.cache.use(routed, self.cap)
        slots, experts = self.slots.place(r.misses)
        self.last = list(zip(slots, experts, strict=True))
        self.cpu = r.cpu
        misses = len(slots) + len(r.cpu)
        for key, v in (("routed", len(routed)), ("hits", r.hits), ("misses", misses)):
            self.counts[key] += v
        self.counts["prefetch_used"] += r.prefetch_used
        self.counts["cpu_experts"] += len(r.cpu)

    def prefetch(self, predicted: list[int], n: int) -> None:
        slots, experts = self.slots.place(self.cache.prefetch(predicted, n))
        self.last = list(zip(slots, experts, strict=True))
        self.counts["prefetches"] += len(slots)


def _start(rng: random.Random, E: int, C: int, S: int, fill: int) -> tuple[Oracle, list[int]]:
    """A cache of `fill` members in random recency order, each in its own slot among the
    first C, and leftovers (non-members) or empties in the other slots."""
    order = rng.sample(range(E), fill)
    member_slots = rng.sample(range(C), fill)
    slot_expert = [-1] * S
    for e, s in zip(order, member_slots, strict=True):
        slot_expert[s] = e
    others = [e for e in range(E) if e not in order]
    for s in range(S):
        if slot_expert[s] < 0 and others and rng.random() < 0.6:
            slot_expert[s] = others.pop(rng.randrange(len(others)))
    cache = LogicalCache(C, E)
    cache.reset(order)
    slots = SlotMap(slot_expert[:C])
    slots.slot_of = dict(zip(order, member_slots, strict=True))
    return Oracle(cache, slots), slot_expert


def _assert_equal(o: Oracle, state: torch.Tensor, lo: cs.CacheLayout, C: int, kind: int) -> None:
    row = state[0].cpu()
    E = lo.num_experts
    assert cs.cache_order(state, lo, 0) == o.cache.order()
    slot_of = row[lo.slot_of : lo.slot_of + E].tolist()
    assert {e: s for e, s in enumerate(slot_of) if s >= 0} == o.slots.slot_of
    assert row[lo.slot_expert : lo.slot_expert + C].tolist() == o.slots.slot_expert
    pending = row[lo.pending : lo.pending + E].nonzero().flatten().tolist()
    assert set(pending) == o.cache._pending_prefetch
    hdr = row[lo.header : lo.header + cs.HEADER_SIZE].tolist()
    counts = hdr[cs.COUNTS : cs.COUNTS + len(cs.COUNT_NAMES)]
    assert dict(zip(cs.COUNT_NAMES, counts, strict=True)) == o.counts
    if kind == cs.KIND_MISS:
        rows, count = row[lo.miss_list : lo.cpu_list].view(-1, 3).tolist(), hdr[cs.MISS_N]
        cpu = row[lo.cpu_list : lo.pf_list].tolist()
        assert hdr[cs.CPU_N] == len(o.cpu)
        assert cpu == o.cpu + [-1] * (lo.top_k - len(o.cpu))
    else:
        rows, count = row[lo.pf_list : lo.width].view(-1, 3).tolist(), hdr[cs.PF_N]
    assert count == len(o.last)
    assert [(s, e) for s, e, _ in rows[:count]] == o.last
    assert all(k == kind for *_, k in rows)
    assert all(s == -1 and e == -1 for s, e, _ in rows[count:])


def _routed(rng: random.Random, o: Oracle, E: int, k: int) -> list[int]:
    """k distinct ids, mostly cached ones (so hits, misses and evictions all happen)."""
    members = o.cache.order()
    hot = rng.sample(members, min(len(members), rng.randint(0, k)))
    rest = [e for e in range(E) if e not in hot]
    return hot + rng.sample(rest, k - len(hot))


def _run(
    E: int,
    C: int,
    S: int,
    k: int,
    n: int,
    fill: int,
    steps: int,
    seed: int,
    kernel: bool,
    cap: int | None = None,
    capped: bool | None = None,
) -> None:
    """`capped`: the flag of the `use` under test (None: True with a cap, else False);
    uncapped streams also run a reference with the other flag, which must stay equal."""
    if capped is None:
        capped = cap is not None
    assert capped or cap is None, "capped=False is for rows whose cap is top_k"
    rng = random.Random(seed)
    lo = cs.CacheLayout(E, S, k, n)
    o, slot_expert = _start(rng, E, C, S, fill)
    o.cap = cap
    state = cs.new_state(1, lo, "cpu")
    order, slot_of = o.cache.order(), o.slots.slot_of
    cs.reset_layer(state, lo, 0, C, order, slot_of, slot_expert, inserts=cap)
    twin = state.clone()  # the reference beside the kernel
    other = state.clone() if cap is None else None  # the other flag's reference
    for _ in range(steps):
        routed = _routed(rng, o, E, k)
        ids = torch.tensor(routed)[None]
        o.use(routed)
        if kernel:
            cs.cache_use(state, lo, 0, ids, capped=capped)
            cache_use_ref(twin, lo, 0, ids, capped=capped)
            assert torch.equal(state, twin)
        else:
            cache_use_ref(state, lo, 0, ids, capped=capped)
        if other is not None:
            cache_use_ref(other, lo, 0, ids, capped=not capped)
            assert torch.equal(state, other), "capped=True and False differ on an uncapped row"
        _assert_equal(o, state, lo, C, cs.KIND_MISS)
        pred = rng.sample(range(E), n)
        o.prefetch(pred, n)
        p = torch.tensor(pred, dtype=torch.int32)
        if kernel:
            cs.cache_prefetch(state, lo, 0, p, n)
            cache_prefetch_ref(twin, lo, 0, p, n)
            assert torch.equal(state, twin)
        else:
            cache_prefetch_ref(state, lo, 0, p, n)
        if other is not None:
            cache_prefetch_ref(other, lo, 0, p, n)
        _assert_equal(o, state, lo, C, cs.KIND_PREFETCH)


# (E, C, S, k, n): C = k, C = E, n = 0, n = C, S > C, tiny and DeepSeek-sized E.
SHAPES = [
    (8, 2, 2, 2, 1),
    (8, 8, 8, 2, 2),
    (16, 4, 4, 4, 0),
    (16, 6, 6, 2, 6),
    (16, 5, 9, 3, 2),
    (32, 8, 8, 4, 1),
    (64, 32, 40, 8, 2),
    (64, 8, 8, 8, 3),
    (64, 64, 64, 8, 4),
    (256, 96, 128, 8, 2),
]


def _seed(*key: object) -> int:
    """A seed per case, the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(key).encode())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-C{}-S{}-k{}-n{}".format(*s))
@pytest.mark.parametrize("fill", ["full", "part", "empty"])
def test_reference_equals_logical_cache_on_long_streams(shape, fill: str) -> None:
    E, C, S, k, n = shape
    start = {"full": C, "part": C // 2, "empty": 0}[fill]
    _run(
        E, C, S, k, n, start, steps=300, seed=zlib.crc32(repr((shape, fill)).encode()), kernel=False
    )


KERNEL_SHAPES = [
    (8, 2, 2, 2, 1),
    (16, 5, 9, 3, 2),
    (16, 6, 6, 2, 6),
    (16, 4, 8, 2, 0),
    (64, 64, 64, 8, 4),
]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "E{}-C{}-S{}-k{}-n{}".format(*s))
@pytest.mark.parametrize("fill", ["full", "part", "empty"])
@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "capped"])
def test_kernel_equals_reference_and_logical_cache(shape, fill: str, capped: bool) -> None:
    E, C, S, k, n = shape
    start = {"full": C, "part": C // 2, "empty": 0}[fill]
    _run(E, C, S, k, n, start, steps=12, seed=_seed(shape, fill), kernel=True, capped=capped)


CAP_SHAPES = [(8, 2, 2, 2, 1), (16, 5, 9, 3, 2), (64, 32, 40, 8, 2), (64, 8, 8, 8, 3)]


@pytest.mark.parametrize("shape", CAP_SHAPES, ids=lambda s: "E{}-C{}-S{}-k{}-n{}".format(*s))
@pytest.mark.parametrize("cap", [0, 1, 2])
def test_capped_use_reference_equals_logical_cache(shape, cap: int) -> None:
    E, C, S, k, n = shape
    _run(E, C, S, k, n, C // 2, steps=200, seed=_seed("cap", shape, cap), kernel=False, cap=cap)


@pytest.mark.parametrize("cap", [0, 1])
def test_capped_use_kernel_equals_reference_and_logical_cache(cap: int) -> None:
    E, C, S, k, n = 16, 5, 9, 3, 2
    _run(E, C, S, k, n, C, steps=8, seed=_seed("cap-kernel", cap), kernel=True, cap=cap)


# A slab smaller than top-k (experts_on cpu / hybrid): C = 0 (no cache), C = 1, C = k - 1,
# a slab with more slots than the capacity; caps 0, 1 and k (hybrid's cap at its largest:
# then capacity - hits bounds the insertions).
SMALL_SHAPES = [(8, 0, 0, 2, 0), (8, 1, 1, 2, 1), (16, 2, 3, 3, 1), (64, 7, 9, 8, 2)]


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: "E{}-C{}-S{}-k{}-n{}".format(*s))
@pytest.mark.parametrize("cap", [0, 1, "k"])
@pytest.mark.parametrize("fill", ["full", "empty"])
def test_slab_below_top_k_reference_equals_logical_cache(shape, cap, fill: str) -> None:
    E, C, S, k, n = shape
    m = k if cap == "k" else cap
    start = C if fill == "full" else 0
    _run(E, C, S, k, n, start, steps=200, seed=_seed("small", shape, cap, fill), kernel=False,
         cap=m)  # fmt: skip


@pytest.mark.parametrize("shape", SMALL_SHAPES[:3], ids=lambda s: "E{}-C{}-S{}-k{}-n{}".format(*s))
def test_slab_below_top_k_kernel_equals_reference(shape) -> None:
    E, C, S, k, n = shape
    _run(E, C, S, k, n, C, steps=8, seed=_seed("small-kernel", shape), kernel=True, cap=k)


def test_slab_below_top_k_never_evicts_a_routed_id() -> None:
    """capacity - hits bounds the insertions: with C = 1 holding a routed id, no miss is
    inserted (it would have to evict it); with C = 1 holding another id, one is."""
    c = LogicalCache(1, 8)
    c.reset([3])
    r = c.use([3, 5], max_inserts=2)
    assert (r.hits, [m.expert for m in r.misses], r.cpu, c.order()) == (1, [], [5], [3])
    r = c.use([1, 6], max_inserts=2)
    assert ([(m.expert, m.evicted) for m in r.misses], r.cpu, c.order()) == ([(1, 3)], [6], [1])
    empty = LogicalCache(0, 8)
    r = empty.use([2, 4], max_inserts=2)
    assert (r.hits, r.misses, r.cpu, empty.order()) == (0, [], [2, 4], [])
    with pytest.raises(ValueError, match=r"exceed the capacity 0 \(an uncapped use"):
        empty.use([2, 4])


def test_state_and_arguments_are_checked() -> None:
    lo = cs.CacheLayout(16, 4, 2, 1)
    state = cs.new_state(2, lo, "cpu")
    with pytest.raises(IndexError, match="layer 2 out of range"):
        cs.cache_use(state, lo, 2, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"contiguous \[layers, "):
        cs.cache_use(state[:, :-1], lo, 0, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="int32 tensor"):
        cs.cache_use(state.long(), lo, 0, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"ids must be \[<= 2\]"):
        cs.cache_use(state, lo, 0, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"n=2 must be an int in \[0, 1\]"):
        cs.cache_prefetch(state, lo, 0, torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="need 0 <= num_slots=17 <= num_experts=16"):
        cs.CacheLayout(16, 17, 5, 1)
    with pytest.raises(ValueError, match="num_slots must be an int >= 0, got -1"):
        cs.CacheLayout(16, -1, 5, 1)
    small = cs.CacheLayout(16, 1, 2, 1)
    with pytest.raises(ValueError, match=r"capacity 1 must be in \[top_k=2, num_slots=1\] with"):
        cs.reset_layer(cs.new_state(1, small, "cpu"), small, 0, 1, [], {}, [])
    with pytest.raises(ValueError, match=r"capacity 1 must be in \[top_k=2, num_slots=4\]"):
        cs.reset_layer(state, lo, 0, 1, [], {}, [])
