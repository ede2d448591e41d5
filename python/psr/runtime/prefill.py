"""Prefill through the slab: exact experts for every prompt token, then the cache seed.

Prefill routes exactly. Its experts run grouped by expert, each staged through a
slot (the experts the cache will not keep first, so the ones it keeps end resident),
and each layer's logical cache is seeded by the spec's rule (`prefill_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from psr.cache import prefill_state
from psr.runtime.slots import SlotMap
from psr.store import ExpertStore

# (slab row [3HF], x [T, H]) -> y [T, H]
RowFFN = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _stage_slot(slots: SlotMap, keep: set[int], here: dict[int, int]) -> int:
    """A slot to load a prefill expert into: empty, else not holding a `keep` expert
    (a duplicate copy of one counts as free), else any."""
    for pred in (
        lambda s, e: e < 0,
        lambda s, e: e not in keep or here.get(e) != s,
        lambda s, e: True,
    ):
        for s in range(slots.capacity):
            if pred(s, slots.slot_expert[s]):
                return s
    raise AssertionError("unreachable")


def _put(slots: SlotMap, keep: set[int], here: dict[int, int], e: int) -> int:
    s = _stage_slot(slots, keep, here)
    if here.get(slots.slot_expert[s]) == s:
        del here[slots.slot_expert[s]]
    slots.slot_expert[s] = e
    here[e] = s
    return s


def prefill_experts(
    store: ExpertStore,
    layer: int,
    slots: SlotMap,
    history: Sequence[Sequence[int]],
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ffn: RowFFN,
) -> tuple[torch.Tensor, list[int]]:
    """Exact experts of `x [T, H]` routed to `ids [T, k]` with `weights [T, k]`.

    Returns the output and the layer's initial logical cache (least recent first);
    `slots` ends mapping exactly those experts.
    """
    init = prefill_state(history, slots.capacity)
    keep = set(init)
    used = sorted(set(ids.flatten().tolist()))
    order = [e for e in used if e not in keep] + [e for e in used if e in keep]
    here = {e: s for s, e in enumerate(slots.slot_expert) if e >= 0}
    out = torch.zeros_like(x)
    for e in order:
        if e not in here:
            store.enqueue_copies(layer, [_put(slots, keep, here, e)], [e])
        tok, pos = torch.where(ids == e)
        with store.reading(layer, [here[e]], [e]) as slab:
            y = ffn(slab[here[e]], x[tok]) * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    missing = [e for e in init if e not in here]
    for e in missing:
        _put(slots, keep, here, e)
    if missing:
        store.enqueue_copies(layer, [here[e] for e in missing], missing)
    slots.slot_of = {e: here[e] for e in init}
    return out, init
