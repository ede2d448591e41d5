"""The logical cache follows the spec's rules exactly (hand-worked cases + an independent model)."""

from __future__ import annotations

import random

import pytest

from psr.cache import LogicalCache, prefill_state


def test_use_inserts_ascending_evicting_lru_not_routed() -> None:
    c = LogicalCache(capacity=4, num_experts=10)
    c.reset([5, 1, 7, 3])  # LRU ... MRU
    r = c.use([3, 9, 0])
    assert r.hits == 1
    # 0 inserted first evicts 5 (LRU, not routed); 9 then evicts 1.
    assert [(m.expert, m.evicted) for m in r.misses] == [(0, 5), (9, 1)]
    # Routed become most recent, lower id more recent: ... 9, 3, 0
    assert c.order() == [7, 9, 3, 0]


def test_use_never_evicts_a_routed_id() -> None:
    c = LogicalCache(capacity=3, num_experts=8)
    c.reset([2, 4, 6])  # 2 is LRU but routed now
    r = c.use([2, 7])
    assert [(m.expert, m.evicted) for m in r.misses] == [(7, 4)]
    assert c.order() == [6, 7, 2]


def test_use_fills_free_places_first() -> None:
    c = LogicalCache(capacity=4, num_experts=8)
    c.reset([1])
    r = c.use([3, 5])
    assert [(m.expert, m.evicted) for m in r.misses] == [(3, None), (5, None)]
    assert c.order() == [1, 5, 3]


def test_prefetch_moves_or_inserts_in_prediction_order() -> None:
    c = LogicalCache(capacity=3, num_experts=8)
    c.reset([1, 2, 3])
    ins = c.prefetch([2, 6, 7], n=2)  # 7 is beyond n
    assert [(i.expert, i.evicted) for i in ins] == [(6, 1)]
    assert c.order() == [3, 2, 6]
    # A prefetched id counts as used once routed, before eviction.
    r = c.use([6])
    assert r.hits == 1 and r.prefetch_used == 1
    ins = c.prefetch([5], n=1)
    assert [(i.expert, i.evicted) for i in ins] == [(5, 3)]
    c.prefetch([4], n=1)  # evicts 2
    c.prefetch([0], n=1)  # evicts 6 (already used) then ...
    r = c.use([5, 4])
    assert r.prefetch_used == 2
    assert c.prefetch([1], n=0) == []


def test_prefetch_evicted_before_use_is_not_counted() -> None:
    c = LogicalCache(capacity=2, num_experts=8)
    c.reset([0, 1])
    c.prefetch([5], 1)  # evicts 0
    c.prefetch([6], 1)  # evicts 1
    c.prefetch([7], 1)  # evicts 5 unused
    r = c.use([5, 6])
    assert r.prefetch_used == 1 and r.hits == 1


def test_prefill_state_recency_then_count_then_id() -> None:
    routed = [[0, 1], [2, 3], [1, 4], [5, 1], [6, 7]]
    # last use: 0@0 2@1 3@1 4@2 1@3 5@3 6@4 7@4; counts: 1 -> 3
    assert prefill_state(routed, 4)[::-1] == [6, 7, 1, 5]
    assert prefill_state(routed, 5)[::-1] == [6, 7, 1, 5, 4]
    assert prefill_state(routed, 20)[::-1] == [6, 7, 1, 5, 4, 2, 3, 0]
    assert prefill_state([], 3) == []


def test_bad_capacity_and_routing() -> None:
    with pytest.raises(ValueError, match=r"capacity -1 must be in \[0, num_experts=4\]"):
        LogicalCache(capacity=-1, num_experts=4)
    with pytest.raises(ValueError, match="capacity 5"):
        LogicalCache(capacity=5, num_experts=4)
    c = LogicalCache(capacity=2, num_experts=4)
    with pytest.raises(ValueError, match="exceed the capacity 2"):
        c.use([0, 1, 2])
    with pytest.raises(ValueError, match="distinct"):
        c.use([1, 1])


class _ListModel:
    """Independent re-statement of the spec with a plain list (MRU first)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.l = cap, []

    def use(self, routed):
        misses = []
        for e in sorted(set(routed) - set(self.l)):
            if len(self.l) == self.cap:
                victim = next(x for x in reversed(self.l) if x not in routed)
                self.l.remove(victim)
            else:
                victim = None
            misses.append((e, victim))
            self.l.insert(0, e)
        self.l = sorted(routed) + [x for x in self.l if x not in routed]
        return misses

    def prefetch(self, pred, n):
        ins = []
        for e in pred[:n]:
            if e in self.l:
                self.l.remove(e)
            else:
                victim = self.l.pop() if len(self.l) == self.cap else None
                ins.append((e, victim))
            self.l.insert(0, e)
        return ins


@pytest.mark.parametrize("seed", range(5))
def test_agrees_with_an_independent_model_on_every_hit_and_miss(seed: int) -> None:
    rng = random.Random(seed)
    E, k, C, n = 16, 3, 7, 2
    c, ref = LogicalCache(C, E), _ListModel(C)
    for _ in range(300):
        routed = rng.sample(range(E), k)
        assert [(m.expert, m.evicted) for m in c.use(routed).misses] == ref.use(routed)
        pred = rng.sample(range(E), 3)
        assert [(i.expert, i.evicted) for i in c.prefetch(pred, n)] == ref.prefetch(pred, n)
        assert c.order() == ref.l[::-1]


# --- the capped use (experts_on cpu / hybrid) ----------------------------------------


def test_capped_use_inserts_the_lowest_misses_and_leaves_the_rest_to_the_cpu() -> None:
    c = LogicalCache(capacity=4, num_experts=10)
    c.reset([5, 1, 7, 3])
    r = c.use([9, 3, 0, 6], max_inserts=1)
    assert r.hits == 1
    assert [(m.expert, m.evicted) for m in r.misses] == [(0, 5)]  # the lowest miss only
    assert r.cpu == [6, 9]  # ascending, not members
    assert c.order() == [1, 7, 3, 0]  # the routed members most recent, lower id more recent
    r = c.use([6, 9], max_inserts=0)  # cpu: nothing inserted, nothing moves
    assert (r.hits, r.misses, r.cpu) == (0, [], [6, 9])
    assert c.order() == [1, 7, 3, 0]


def _capped_use_model(
    order: list[int], capacity: int, routed: list[int], m: int
) -> tuple[list[int], list[tuple[int, int | None]], list[int]]:
    """An independent formulation on a plain list (least recent first)."""
    order = list(order)
    missing = sorted(e for e in routed if e not in order)
    inserted = []
    for e in missing[:m]:
        victim = None
        if len(order) == capacity:
            victim = next(x for x in order if x not in routed)
            order.remove(victim)
        order.append(e)
        inserted.append((e, victim))
    members = [e for e in routed if e in order]
    order = [x for x in order if x not in members] + sorted(members, reverse=True)
    return order, inserted, missing[m:]


@pytest.mark.parametrize("m", [0, 1, 2, 3])
def test_capped_use_matches_an_independent_model_on_random_streams(m: int) -> None:
    rng = random.Random(m)
    E, C, k = 24, 6, 4
    c, order = LogicalCache(C, E), rng.sample(range(E), 3)
    c.reset(order)
    for _ in range(400):
        routed = rng.sample(range(E), k)
        want_order, want_ins, want_cpu = _capped_use_model(order, C, routed, m)
        r = c.use(routed, max_inserts=m)
        assert [(i.expert, i.evicted) for i in r.misses] == want_ins
        assert r.cpu == want_cpu and c.order() == want_order
        order = want_order
        if rng.random() < 0.3:  # prefetches interleave: the cap is for misses only
            c.prefetch(rng.sample(range(E), 2), 2)
            order = c.order()


def test_an_unreached_cap_is_the_spec_use() -> None:
    rng = random.Random(7)
    a, b = LogicalCache(5, 16), LogicalCache(5, 16)
    for _ in range(200):
        routed = rng.sample(range(16), 3)
        ra, rb = a.use(routed), b.use(routed, max_inserts=3)
        assert [(i.expert, i.evicted) for i in ra.misses] == [
            (i.expert, i.evicted) for i in rb.misses
        ]
        assert rb.cpu == [] and a.order() == b.order()


@pytest.mark.parametrize("bad", [-1, True, 1.0, "2"])
def test_a_bad_cap_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_inserts"):
        LogicalCache(4, 8).use([1, 2], max_inserts=bad)  # type: ignore[arg-type]
