"""The physical mirror of one layer's logical cache: which expert each slab slot holds.

Every logical insertion is copied into the slot of the expert it evicts, or into a
free slot; so the slot of each logical member is known without asking the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from psr.cache import Insertion


class SlotMap:
    """`slot_expert[s]`: the expert slot `s` holds or is loading (-1: empty);
    `slot_of[e]`: the slot of logical member `e` (only members of the logical cache)."""

    def __init__(self, slot_expert: Sequence[int]) -> None:
        self.reset(slot_expert)

    @property
    def capacity(self) -> int:
        return len(self.slot_expert)

    def reset(self, slot_expert: Sequence[int]) -> None:
        """Physical contents as the store reports them; no logical member yet."""
        self.slot_expert = list(slot_expert)
        self.slot_of: dict[int, int] = {}

    def place(self, inserts: Iterable[Insertion]) -> tuple[list[int], list[int]]:
        """Slots for logical insertions: the evicted expert's slot, else a slot no logical
        member maps to (empty, or a leftover). Returns the (slots, experts) to copy."""
        slots, experts = [], []
        for ins in inserts:
            if ins.evicted is not None:
                slot = self.slot_of.pop(ins.evicted)
            else:
                slot = next(
                    s for s in range(self.capacity) if self.slot_of.get(self.slot_expert[s]) != s
                )
            self.slot_expert[slot] = ins.expert
            self.slot_of[ins.expert] = slot
            slots.append(slot)
            experts.append(ins.expert)
        return slots, experts

    def slots(self, experts: Sequence[int]) -> list[int]:
        """Slots of logical members, in the given order."""
        return [self.slot_of[e] for e in experts]
