"""The host-driven side of the logical caches: `use` and `prefetch` on each layer's
`LogicalCache` (psr/cache.py), mirrored in its slot map and, when physical, by the
store's copies; counted and traced. The host decode step, scored windows and verify
blocks route through it; the device decode step replaces it with kernels."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psr.cache import Insertion
from psr.policy import Policy
from psr.runtime.accounting import Accounting
from psr.runtime.layer import MoELayer
from psr.store import CopyReason, ExpertStore


class HostCaches:
    def __init__(self, store: ExpertStore, acct: Accounting, num_experts: int) -> None:
        self.store = store
        self.acct = acct
        self.num_experts = num_experts
        # MoE layer -> per expert "pinned" | "pageable" (fixed at load; read once, for traces)
        self._tiers: dict[int, list[str]] = {}

    def mask(self, layer: MoELayer, policy: Policy, device: torch.device) -> torch.Tensor:
        """What routing is biased toward: the logical cache, or for the timing-dependent
        strawman the slots whose copies have finished."""
        if policy.mask == "physical":
            m = [False] * self.num_experts
            for slot, ok in enumerate(self.store.ready(layer.index)):
                e = layer.slots.slot_expert[slot]
                if ok and e >= 0:
                    m[e] = True
        else:
            m = layer.cache.mask()
        return torch.tensor(m, dtype=torch.bool, device=device)

    def copy(
        self,
        layer: MoELayer,
        inserts: list[Insertion],
        reason: CopyReason,
        physical: bool,
        at: tuple[int, int] | None = None,
    ) -> int:
        """Mirror logical insertions: slots from the slot map, the trace, and (physical)
        one batch of store copies. `at`: the trace step that issued them, when not the
        current one."""
        slots, experts = layer.slots.place(inserts)
        rec = self.acct.recorder
        if rec is not None:
            tiers = self.tiers(layer.index)
            for s, e in zip(slots, experts, strict=True):
                rec.copy(layer.index, s, e, reason.value, at, tiers[e])
        if slots and physical:
            self.store.enqueue_copies(layer.index, slots, experts, reason=reason)
        return len(slots)

    def tiers(self, layer: int) -> list[str]:
        """Each expert's row tier in `layer` as traces name it ("pinned" | "pageable")."""
        if layer not in self._tiers:
            held = self.store.tiers(layer)
            self._tiers[layer] = ["pinned" if t == "held" else "pageable" for t in held]
        return self._tiers[layer]

    def use(
        self,
        layer: MoELayer,
        routed: Sequence[int],
        physical: bool,
        trace_token: int = -1,
        substituted: int = 0,
        max_inserts: int | None = None,
    ) -> list[int]:
        """Spec `use` of `routed`; each inserted miss copied into its slot. `substituted`:
        how many of `routed` the router's own exact top-k does not hold (the routing op
        counted it; the logical cache does not know it). `max_inserts` caps the misses
        inserted (experts_on cpu / hybrid: `LogicalCache.use`); returns the misses not
        inserted, which the step computes on the CPU."""
        routed = list(routed)
        # gpu: the spec's `use`, called as before the cap existed
        r = layer.cache.use(routed) if max_inserts is None else layer.cache.use(routed, max_inserts)
        rec = self.acct.recorder
        if rec is not None:
            rec.routed(layer.index, routed, r.hits, trace_token, substituted, len(r.cpu))
        n = self.copy(layer, r.misses, CopyReason.MISS, physical)
        self.acct.count(
            routed=len(routed),
            hits=r.hits,
            misses=len(r.misses) + len(r.cpu),
            prefetch_used=r.prefetch_used,
            substituted=substituted,
            cpu_experts=len(r.cpu),
        )
        self.acct.count_copies(n, layer.index)
        return r.cpu

    def prefetch(
        self,
        layer: MoELayer,
        predicted: Sequence[int],
        n: int,
        physical: bool,
        at: tuple[int, int] | None = None,
    ) -> None:
        """Spec `prefetch` of at most `n` ids into `layer`'s cache, mirrored by copies."""
        k = self.copy(layer, layer.cache.prefetch(predicted, n), CopyReason.PREFETCH, physical, at)
        self.acct.count(prefetches=k)
        self.acct.count_copies(k, layer.index)
