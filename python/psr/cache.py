"""The deterministic logical expert cache (spec: docs/PSR.md, "Logical cache").

Pure bookkeeping over expert ids: it never looks at the physical store, so the
routing it steers is a function of the tokens alone. The physical side mirrors
each insertion/eviction it reports.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class Insertion:
    """One logical insertion: `expert` enters, `evicted` (or None: a free place) leaves."""

    expert: int
    evicted: int | None


@dataclass
class UseResult:
    hits: int
    misses: list[Insertion]  # the misses inserted (each a copy)
    prefetch_used: int
    # Misses not inserted under a capped `use` (`max_inserts`): computed where they live
    # (the CPU, from the host rows), never members, no copy; ascending.
    cpu: list[int] = field(default_factory=list)


@dataclass
class LogicalCache:
    """Ordered set of at most `capacity` expert ids, least recent first."""

    capacity: int
    num_experts: int
    _order: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # Prefetched experts not yet routed (for "prefetches used before eviction").
    _pending_prefetch: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not 0 <= self.capacity <= self.num_experts:
            raise ValueError(
                f"cache capacity {self.capacity} must be in [0, num_experts={self.num_experts}]"
            )

    # --- queries ---------------------------------------------------------------
    def __contains__(self, expert: int) -> bool:
        return expert in self._order

    def __len__(self) -> int:
        return len(self._order)

    def order(self) -> list[int]:
        """Ids from least to most recent."""
        return list(self._order)

    def mask(self) -> list[bool]:
        m = [False] * self.num_experts
        for e in self._order:
            m[e] = True
        return m

    # --- updates ---------------------------------------------------------------
    def _evict_lru(self, protected: set[int]) -> int | None:
        if len(self._order) < self.capacity:
            return None
        for e in self._order:  # least recent first
            if e not in protected:
                del self._order[e]
                self._pending_prefetch.discard(e)
                return e
        # `use` inserts at most capacity - hits ids, so a victim always exists.
        raise RuntimeError("logical cache: every resident id is protected")

    def use(self, routed: Sequence[int], max_inserts: int | None = None) -> UseResult:
        """Spec `use`: insert missing ids (ascending), evicting the least recent id not
        routed now; then routed ids become most recent, a lower id more recent.

        `max_inserts` (None: unlimited, the spec's `use`) caps the insertions: the
        min(`max_inserts`, capacity - hits) lowest missing ids are inserted as the spec
        inserts them (capacity - hits: the free places plus the members not routed now, so
        a capacity below the routed count never evicts a routed id; at capacity >= k it
        never binds), the other misses are returned in `cpu` (not inserted, not members:
        computed on the CPU); recency then moves the members among `routed` only."""
        routed_set = set(routed)
        if len(routed_set) != len(routed):
            raise ValueError(f"routed ids must be distinct, got {list(routed)}")
        if max_inserts is None and len(routed_set) > self.capacity:
            raise ValueError(
                f"{len(routed_set)} routed ids exceed the capacity {self.capacity} "
                "(an uncapped use inserts them all)"
            )
        if max_inserts is not None and (
            isinstance(max_inserts, bool) or not isinstance(max_inserts, int) or max_inserts < 0
        ):
            raise ValueError(f"max_inserts must be None or an int >= 0, got {max_inserts!r}")
        hits = sum(e in self._order for e in routed_set)
        used = len(routed_set & self._pending_prefetch)
        self._pending_prefetch -= routed_set
        missing = sorted(routed_set - self._order.keys())
        cut = len(missing) if max_inserts is None else min(max_inserts, self.capacity - hits)
        misses = []
        for e in missing[:cut]:
            misses.append(Insertion(e, self._evict_lru(routed_set)))
            self._order[e] = None
        cpu = missing[cut:]
        for e in sorted(routed_set.difference(cpu), reverse=True):  # lowest id ends most recent
            self._order.move_to_end(e)
        return UseResult(hits, misses, used, cpu)

    def prefetch(self, predicted: Sequence[int], n: int) -> list[Insertion]:
        """Spec `prefetch`: the first n predicted ids, in order, become most recent;
        those not present are inserted (a copy each), evicting the least recent id."""
        out = []
        for e in list(predicted)[:n]:
            if e in self._order:
                self._order.move_to_end(e)
                continue
            out.append(Insertion(e, self._evict_lru(set())))
            self._order[e] = None
            self._pending_prefetch.add(e)
        return out

    def reset(self, order: Iterable[int] = (), pending: Iterable[int] = ()) -> None:
        """Set the contents, least recent first, and the prefetched members not routed
        since (`pending`: a state handed over from another implementation)."""
        order = list(order)
        if len(order) > self.capacity or len(set(order)) != len(order):
            raise ValueError(f"invalid cache contents {order} for capacity {self.capacity}")
        pending = set(pending)
        if not pending <= set(order):
            raise ValueError(f"pending prefetches {sorted(pending)} are not all in {order}")
        self._order = OrderedDict((e, None) for e in order)
        self._pending_prefetch = pending

    def pending(self) -> list[int]:
        """Prefetched members not routed since they were inserted, ascending."""
        return sorted(self._pending_prefetch)


def prefill_state(routed_per_token: Sequence[Sequence[int]], capacity: int) -> list[int]:
    """Initial cache after an exactly-routed prefill, least recent first.

    The `capacity` ids prefill used most recently, ties (same last token) broken by
    higher use count, then by lower id; most recent is last.
    """
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    for t, ids in enumerate(routed_per_token):
        for e in ids:
            last[e] = t
            count[e] = count.get(e, 0) + 1
    ranked = sorted(last, key=lambda e: (-last[e], -count[e], e))[:capacity]  # most recent first
    return ranked[::-1]
