"""Prefill through the slab: exact experts for every prompt token, then the cache seed.

Prefill routes exactly. Its experts run grouped by expert, each staged through a
slot (the experts the cache will not keep first, so the ones it keeps end resident),
and each layer's logical cache is seeded by the spec's rule (`prefill_state`).
`plan_prefill` decides the slots (updating the slot map); `run_prefill` issues the
copies and computes. Teacher-forced scoring runs the same plan with `physical=False`:
the slot map evolves as in decoding, no copies are issued, and the experts are read
from the host copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from psr.cache import prefill_state
from psr.runtime.context import StepContext
from psr.runtime.layer import MoELayer
from psr.runtime.slots import SlotMap
from psr.runtime.step import Routed, Step, non_finite
from psr.store import CopyReason, ExpertStore
from psr_kernels import NonFiniteError

# One expert's weighted FFN over some tokens: (its row, the tokens' x, its expert id, their
# gate weights) -> its contribution to y.
RowFFN = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


@dataclass
class PrefillPlan:
    reads: list[tuple[int, int, bool]]  # (expert, slot, copy it first?) in compute order
    seed: list[tuple[int, int]]  # (slot, expert): cache members prefill did not compute with
    init: list[int]  # the layer's initial logical cache, least recent first


def _stage_slot(slots: SlotMap, keep: set[int], here: dict[int, int]) -> int:
    """A slot to load a prefill expert into: empty, else not holding a `keep` expert
    (a duplicate copy of one counts as free), else any."""
    preds: tuple[Callable[[int, int], bool], ...] = (
        lambda s, e: e < 0,
        lambda s, e: e not in keep or here.get(e) != s,
        lambda s, e: True,
    )
    for pred in preds:
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


def plan_prefill(
    slots: SlotMap, history: Sequence[Sequence[int]], used: Sequence[int]
) -> PrefillPlan:
    """Stage the prefill's `used` experts and seed the cache from `history` (the routed
    ids of each prompt token); `slots` ends mapping exactly the seeded experts."""
    init = prefill_state(history, slots.capacity)
    keep = set(init)
    used = sorted(set(used))
    order = [e for e in used if e not in keep] + [e for e in used if e in keep]
    here = {e: s for s, e in enumerate(slots.slot_expert) if e >= 0}
    reads = []
    for e in order:
        fresh = e not in here
        if fresh:
            _put(slots, keep, here, e)
        reads.append((e, here[e], fresh))
    seed = [(_put(slots, keep, here, e), e) for e in init if e not in here]
    slots.slot_of = {e: here[e] for e in init}
    return PrefillPlan(reads, seed, init)


def row_ffn(rt: StepContext, layer: MoELayer) -> RowFFN:
    """`layer`'s experts one at a time from their rows, with their biases where they have
    them (prefill and scored windows)."""
    table, compute = layer.expert_bias, rt.computes[layer.index]
    return lambda row, x, e, w: compute.weighted_row(row, x, w, None if table is None else table[e])


def run_prefill(
    store: ExpertStore,
    layer: int,
    plan: PrefillPlan,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ffn: RowFFN,
    physical: bool = True,
) -> torch.Tensor:
    """Exact experts of `x [T, H]` routed to `ids [T, k]` with `weights [T, k]`, by the
    plan: copies into the slab then reads from it, or (`physical=False`) host reads."""
    host = None if physical else store.host(layer)
    out = torch.zeros_like(x)
    for e, slot, fresh in plan.reads:
        if fresh and physical:
            store.enqueue_copies(layer, [slot], [e], reason=CopyReason.PREFILL)
        tok, pos = torch.where(ids == e)
        if host is not None:
            y = ffn(host[e].to(x.device), x[tok], e, weights[tok, pos])
        else:
            with store.reading(layer, [slot], [e]) as slab:
                y = ffn(slab[slot], x[tok], e, weights[tok, pos])
        out.index_add_(0, tok, y.to(out.dtype))
    if plan.seed and physical:
        store.enqueue_copies(
            layer,
            [s for s, _ in plan.seed],
            [e for _, e in plan.seed],
            reason=CopyReason.PREFILL,
        )
    return out


class PrefillStep(Step):
    """A sequence's first forward: exact routing, the prompt's experts staged through the
    slab, and each layer's logical cache seeded (spec: the experts prefill used most
    recently)."""

    name = "prefill"

    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        rt = self.rt
        logits = self.logits(layer, x)
        try:
            w, ids = rt.ops.route(logits, rt.spec.route_spec(), bias=layer.bias)
        except NonFiniteError as e:
            raise non_finite([layer.index], "found in prefill") from e
        layer.history.extend(ids.tolist())
        return self.out(logits, w, ids)

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        rt = self.rt
        plan = plan_prefill(layer.slots, layer.history, ids.flatten().tolist())
        out = run_prefill(rt.store, layer.index, plan, x, ids, weights, row_ffn(rt, layer))
        layer.cache.reset(plan.init)
        layer.seeded = True
        if rt.decoding:
            rt.acct.end_prefill()
        return out
