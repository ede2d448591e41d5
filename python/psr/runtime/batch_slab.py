"""The shared slab of a batch (runtime/batch.py): one physical slab for b sequences whose
logical caches are their own.

The slab is the first `size` slots of each layer's store slab: the store's slots
(LoadConfig.batch_slots sizes them) can exceed each sequence's logical capacity C (its
solo slots), so the slab holds the union of what b sequences need (up to b x C) while each
sequence routes on its own C-slot cache, as alone. Solo calls use the first C slots.

Per MoE layer, `refs[e]` counts the live sequences whose logical cache holds expert e: the
union of what they need. What a slot holds is the store's word (`slot_experts`, read at
each use, so a solo call in between leaves nothing stale). An expert some sequence inserts
is copied once, whichever and however many sequences insert it; a copy goes into, in this
order, an empty slot or a second copy of an expert (a newcomer's solo prefill stages in the
first C slots), a slot whose expert no live cache holds (refs 0), and only when the union
of the live caches exceeds the slab (b x C > size) a slot of a held expert (it is copied
back when next read: latency only). A slot that this step reads is never chosen.
Prefetches take free or refs-0 slots only (none free: the copy is skipped, its expert
copied when read). Nothing here feeds back into routing: the logical caches never read it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from psr.store import CopyReason, ExpertStore


class SharedSlab:
    def __init__(self, store: ExpertStore, num_layers: int, size: int | None = None) -> None:
        # None: every slot of the store's slab.
        self.store = store
        self.size = store.layers[0].num_slots if size is None else size
        self.refs: list[Counter[int]] = [Counter() for _ in range(num_layers)]
        self.counts: Counter[str] = Counter()  # copies, shared, spilled, skipped_prefetches
        # (layer, slot, expert, reason) of each copy issued, in order, while a list
        # (BatchDecoder.record_trace); None: not kept.
        self.log: list[tuple[int, int, int, CopyReason]] | None = None
        # (layer, experts, slots) of each run of rows read, while a list (idem).
        self.reads: list[tuple[int, list[int], list[int]]] | None = None

    def slots(self, layer: int) -> int:
        return self.size

    def held(self, layer: int) -> list[int]:
        """The expert each of the slab's slots holds or loads (-1: empty), as the store says."""
        return self.store.slot_experts(layer)[: self.size]

    def hold(self, layer: int, experts: Iterable[int]) -> None:
        """A sequence's logical cache took these experts."""
        self.refs[layer].update(experts)

    def drop(self, layer: int, experts: Iterable[int]) -> None:
        """A sequence's logical cache let these experts go (evicted, or it left)."""
        refs = self.refs[layer]
        for e in experts:
            refs[e] -= 1
            if refs[e] <= 0:
                del refs[e]

    def where(self, layer: int) -> dict[int, int]:
        """Expert -> the slot holding (or loading) it, as the store says (the first of two)."""
        return _where(self.held(layer))

    def ensure(
        self, layer: int, experts: Sequence[int], reason: CopyReason, spill: bool = True
    ) -> dict[int, int]:
        """Copy each of `experts` not in a slot into one (module docstring); the others'
        slots are protected. Returns expert -> slot for those that have one."""
        held = self.held(layer)
        where = _where(held)
        want = list(dict.fromkeys(experts))
        missing = [e for e in want if e not in where]
        if not missing:
            self.counts["shared"] += len(want)
            return where
        protect = set(want)
        refs = self.refs[layer]
        # Victims: empty or a second copy, then experts no live cache holds, then (spill)
        # the least held.
        free = {s for s, e in enumerate(held) if e < 0 or where[e] != s}
        order = sorted(
            (s for s, e in enumerate(held) if s in free or e not in protect),
            key=lambda s: (s not in free, refs.get(held[s], 0), s),
        )
        if not spill:
            order = [s for s in order if s in free or refs.get(held[s], 0) == 0]
        if len(order) < len(missing) and spill:
            raise RuntimeError(
                f"MoE layer {layer}: {len(want)} experts read at once exceed the slab's "
                f"{len(held)} slots"
            )
        slots, copied = [], []
        for s, e in zip(order, missing, strict=False):
            if s not in free and refs.get(held[s], 0) > 0:
                self.counts["spilled"] += 1
            if s not in free:
                del where[held[s]]
            where[e] = s
            slots.append(s)
            copied.append(e)
        self.counts["skipped_prefetches"] += len(missing) - len(copied)
        self.counts["copies"] += len(copied)
        self.counts["shared"] += len(want) - len(missing)
        if slots:
            self.store.enqueue_copies(layer, slots, copied, reason=reason)
            if self.log is not None:
                self.log.extend((layer, s, e, reason) for s, e in zip(slots, copied, strict=True))
        return where

    def groups(self, layer: int, needs: Sequence[Sequence[int]]) -> list[list[int]]:
        """Rows (sequences) in runs whose union of slab experts fits the slab: a layer step
        reads one run at a time when the batch's union does not fit at once."""
        limit = self.slots(layer)
        out: list[list[int]] = []
        union: set[int] = set()
        for i, need in enumerate(needs):
            if not out or len(union | set(need)) > limit:
                out.append([])
                union = set()
            out[-1].append(i)
            union |= set(need)
        return out


def _where(held: Sequence[int]) -> dict[int, int]:
    """Expert -> its first slot in `held`."""
    where: dict[int, int] = {}
    for s, e in enumerate(held):
        if e >= 0:
            where.setdefault(e, s)
    return where


def slab_size(capacity: int, store_slots: int, max_batch: int, asked: int | None) -> int:
    """A batch's slab slots per layer: `asked`, else the union of `max_batch` solo caches as
    far as the store's slots go; between the solo `capacity` and the store's slots, else a
    one-line ValueError."""
    if asked is None:
        return min(store_slots, max_batch * capacity)
    if isinstance(asked, bool) or not isinstance(asked, int):
        raise ValueError(f"slab_slots must be an int (slots per layer), got {asked!r}")
    if not capacity <= asked <= store_slots:
        raise ValueError(
            f"slab_slots={asked} is outside [{capacity}, {store_slots}]: at least the solo "
            f"slots, at most the store's (batch_slots at load)"
        )
    return asked
