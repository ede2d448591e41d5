"""The CPU decode step's cache `use` and `prefetch`, each in one extension call
(psr.store.cpu_router, csrc/cpu/router.cpp), against the references they replace: `_flag`
of the router logits, `cache_use_ref` and `cache_prefetch_ref`, row for row, over random
decode steps (uses and prefetches interleaved, so rows hold pending ids, members are
predicted again and full caches evict), odd shapes, capped and uncapped, slabs smaller than
top-k; and the decode step with and without them."""

from __future__ import annotations

import random

import pytest
import torch

from psr.store.cpu_router import cpu_cache_prefetch, cpu_cache_use
from psr_kernels import cache_state as cs
from psr_kernels.cache_state_ref import cache_prefetch_ref, cache_use_ref
from psr_kernels.decode import _flag, decode_step_ref
from psr_kernels.routing import RouteSpec

# (experts, slots, top_k, max_prefetch, capacity, inserts, capped)
SHAPES = [
    (8, 8, 2, 2, 8, None, True),
    (7, 5, 3, 1, 4, None, True),  # odd sizes, capacity below the slots
    (13, 6, 4, 0, 6, 2, True),  # a miss-copy cap: the CPU list
    (9, 2, 4, 0, 2, 0, True),  # a slab smaller than top_k (experts_on cpu)
    (9, 3, 5, 2, 3, 1, True),
    (16, 12, 4, 3, 10, None, False),  # experts_on gpu: uncapped
    (64, 64, 8, 0, 64, None, True),  # OLMoE's shape at residency 1.0
]


def _fresh(lo: cs.CacheLayout, capacity: int, inserts: int | None, rnd: random.Random):
    """A state of 2 layers whose layer 1 holds a random cache (some members, some pending)."""
    state = cs.new_state(2, lo, "cpu")
    members = rnd.sample(range(lo.num_experts), rnd.randint(0, capacity))
    slots = rnd.sample(range(capacity), len(members))
    slot_expert = [-1] * lo.num_slots
    for e, s in zip(members, slots, strict=True):
        slot_expert[s] = e
    pending = [e for e in members if rnd.random() < 0.3]
    slot_of = dict(zip(members, slots, strict=True))
    cs.reset_layer(state, lo, 1, capacity, members, slot_of, slot_expert, pending, inserts)
    return state


def _logits(E: int, rnd: random.Random) -> torch.Tensor:
    x = torch.randn(1, E, generator=torch.Generator().manual_seed(rnd.randrange(1 << 30)))
    r = rnd.random()
    if r < 0.1:
        x[0, rnd.randrange(E)] = float("nan")
    elif r < 0.2:
        x[0, rnd.randrange(E)] = float("-inf") if r < 0.15 else float("inf")
    return x


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-S{}-K{}-n{}-C{}-m{}-{}".format(*s))
def test_cpu_cache_use_matches_the_references(shape: tuple) -> None:
    E, S, K, n, C, inserts, capped = shape
    lo = cs.CacheLayout(E, S, K, n)
    rnd = random.Random(hash(shape) & 0xFFFF)
    for _trial in range(4):
        ref = _fresh(lo, C, inserts, rnd)
        got = ref.clone()
        for _step in range(40):
            k = rnd.randint(1, K)
            ids = torch.tensor([rnd.sample(range(E), k)])
            logits = _logits(E, rnd)
            if rnd.random() < 0.3:
                logits = logits.bfloat16()  # any float dtype: flagged after a cast
            _flag(ref, lo, 1, logits)
            cache_use_ref(ref, lo, 1, ids, capped=capped)
            cpu_cache_use(got, lo, 1, ids, capped=capped, logits=logits)
            assert torch.equal(got, ref), (shape, ids.tolist())
            if n and rnd.random() < 0.5:  # prefetches leave pending ids for later steps
                pred = torch.tensor(rnd.sample(range(E), n))
                cache_prefetch_ref(ref, lo, 1, pred, n)
                cache_prefetch_ref(got, lo, 1, pred, n)
            if rnd.random() < 0.2:  # the flag cleared, as the decode step's drain does
                ref[1, lo.header + cs.FLAG] = 0
                got[1, lo.header + cs.FLAG] = 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-S{}-K{}-n{}-C{}-m{}-{}".format(*s))
def test_cpu_cache_prefetch_matches_the_reference(shape: tuple) -> None:
    E, S, K, n, C, inserts, capped = shape
    n = max(n, 1)  # every shape prefetches here (its layout allows up to max(n, 1))
    lo = cs.CacheLayout(E, S, K, n)
    rnd = random.Random((hash(shape) + 1) & 0xFFFF)
    for _trial in range(4):
        ref = _fresh(lo, C, inserts, rnd)
        got = ref.clone()
        for _step in range(40):
            m = rnd.randint(0, n)
            # Repeats and members among the predictions: a member is made most recent.
            pred = torch.tensor([[rnd.randrange(E) for _ in range(n)]], dtype=torch.int32)
            cache_prefetch_ref(ref, lo, 1, pred, m)
            cpu_cache_prefetch(got, lo, 1, pred, m)
            assert torch.equal(got, ref), (shape, pred.tolist(), m)
            if rnd.random() < 0.5:  # uses between them: hits, misses, evictions
                ids = torch.tensor([rnd.sample(range(E), rnd.randint(1, K))])
                cache_use_ref(ref, lo, 1, ids, capped=capped)
                cache_use_ref(got, lo, 1, ids, capped=capped)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.tensor([1, 2]), 3), "n=3 must be an int in \\[0, 2\\]"),
        ((torch.tensor([1]), 2), "1 predicted ids, fewer than n=2"),
        ((torch.tensor([1.0, 2.0]), 2), "integer CPU tensor"),
        ((torch.tensor([1, 8]), 2), "predicted id 8 outside \\[0, 8\\)"),
    ],
)
def test_cpu_cache_prefetch_bad_input(args: tuple, message: str) -> None:
    lo = cs.CacheLayout(8, 8, 2, 2)
    state = _fresh(lo, 8, None, random.Random(5))
    before = state.clone()
    with pytest.raises(ValueError, match=message):
        cpu_cache_prefetch(state, lo, 1, *args)
    assert torch.equal(state, before)  # nothing written
    with pytest.raises(ValueError, match="contiguous int32"):
        cpu_cache_prefetch(state.long(), lo, 1, torch.tensor([1, 2]), 2)


def test_cpu_cache_use_without_logits_leaves_the_flag() -> None:
    lo = cs.CacheLayout(8, 8, 2, 0)
    ref = _fresh(lo, 8, None, random.Random(3))
    got = ref.clone()
    ids = torch.tensor([[5, 1]])
    cache_use_ref(ref, lo, 1, ids)
    cpu_cache_use(got, lo, 1, ids)
    assert torch.equal(got, ref)
    assert int(got[1, lo.header + cs.FLAG]) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s, i: (s.long(), i), "contiguous int32"),
        (lambda s, i: (s[:, :-1], i), "contiguous int32"),
        (lambda s, i: (s, i.float()), "integer CPU tensor"),
        (lambda s, i: (s, torch.tensor([[1, 2, 3]])), "need 1 to top_k=2"),
        (lambda s, i: (s, torch.tensor([[1, 8]])), "outside \\[0, 8\\)"),
        (lambda s, i: (s, torch.tensor([[3, 3]])), "distinct"),
    ],
)
def test_cpu_cache_use_bad_input(change, message: str) -> None:
    lo = cs.CacheLayout(8, 8, 2, 0)
    state = _fresh(lo, 8, None, random.Random(4))
    s, i = change(state, torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=message):
        cpu_cache_use(s, lo, 1, i)
    with pytest.raises(ValueError, match="layer 2 outside"):
        cpu_cache_use(state, lo, 2, torch.tensor([[1, 2]]))


@pytest.mark.parametrize("lam", [0.0, 0.5])
@pytest.mark.parametrize("capped", [True, False])
@pytest.mark.parametrize("n", [0, 2])
def test_decode_step_ref_with_the_cpu_use_is_the_same(lam: float, capped: bool, n: int) -> None:
    """decode_step_ref with `use=cpu_cache_use` and `prefetch=cpu_cache_prefetch` (the CPU
    decode step's) returns the same weights and ids and leaves the same state as with the
    references, step after step (checked calls skip the argument checks, as the runtime's
    later calls do); with n, layer 0's step prefetches its predictions into layer 1."""
    E, K, d = 12, 3, 16
    lo = cs.CacheLayout(E, 6, K, 2)
    spec = RouteSpec(top_k=K, scoring="softmax", renormalize=True, lam=lam)
    rnd = random.Random(7)
    ref = _fresh(lo, 6, None if not capped else 2, rnd)
    if n:  # layer 0 routes: an empty cache of the same capacity
        cs.reset_layer(ref, lo, 0, 6, [], {}, [-1] * 6, [], None if not capped else 2)
    got = ref.clone()
    g = torch.Generator().manual_seed(8)
    nxt = dict(norm_weight=torch.randn(d, generator=g), gate_weight=torch.randn(E, d, generator=g))
    for step in range(30):
        logits = _logits(E, rnd)
        if not torch.isfinite(logits).all():
            logits = torch.nan_to_num(logits)  # the routing of a NaN row is not compared
            logits[0, 0] = float("inf") if step % 2 else logits[0, 0]
        kw: dict = dict(layer=1 - bool(n), checked=step > 0, capped=capped)
        if n:
            kw.update(n=n, residual=torch.randn(1, d, generator=g), **nxt)
        w0, i0 = decode_step_ref(logits, spec, ref, lo, **kw)
        w1, i1 = decode_step_ref(
            logits, spec, got, lo, use=cpu_cache_use, prefetch=cpu_cache_prefetch, **kw
        )
        assert torch.equal(i0, i1) and torch.equal(w0.view(torch.int32), w1.view(torch.int32))
        assert torch.equal(got, ref)
    if n:  # the predictions were inserted into layer 1
        assert int(ref[1, lo.header + cs.COUNTS + cs.PREFETCHES]) > 0
