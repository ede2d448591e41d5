"""The host-driven decode step and the speculative verify block.

Per MoE layer and decode token: route with the logical cache as a host-built mask, `use`
the ids on the host `LogicalCache` (each miss a store copy), predict and `prefetch` into
later layers (each insertion a store copy), then run the experts from the slab after the
store's `acquire` waited for this layer's slots. The host reads the ids (a device sync
per layer), so this path is the fallback: decode="host", the timing-dependent
`cache-prior-async` strawman, steering variants beyond the spec, and trace recording;
and on CUDA, experts_on cpu / hybrid for expert kinds the CPU kernels do not compute: the
misses `use` did not insert are computed on the CPU from the host rows (the placement's
`host_experts`, a synchronous hand-off; the device step hands off in stream order where it
can).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

import psr_kernels as pk
from psr.runtime.layer import MoELayer
from psr.runtime.step import Routed, Step, non_finite
from psr.runtime.verify import union

if TYPE_CHECKING:
    from psr.runtime.context import StepContext


class HostDecode(Step):
    name = "host"

    def __init__(self, runtime: StepContext) -> None:
        super().__init__(runtime)
        # MoE layer -> (routed ids as the host saw them, the ids tensor the router returned)
        self.pending: dict[int, tuple[list[int], torch.Tensor]] = {}
        # MoE layer -> the routed misses `use` did not insert (experts_on cpu / hybrid)
        self.cpu: dict[int, list[int]] = {}

    def reset(self) -> None:
        """The sequence ends: no route pending, no CPU experts waiting."""
        self.pending.clear()
        self.cpu.clear()

    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        rt = self.rt
        if x.shape[0] != 1:
            raise ValueError(f"decode steps take one token at a time, got {x.shape[0]}")
        if layer.index == 0:
            rt.acct.open_token()
        logits = self.logits(layer, x)
        lam = rt.steering.lam(layer)
        mask = rt.book.mask(layer, rt.policy, x.device) if lam > 0 else None
        try:
            w, ids, sub = rt.ops.route_counted(
                logits, rt.spec.route_spec(lam), mask=mask, bias=layer.bias
            )
        except pk.NonFiniteError as e:
            raise non_finite([layer.index], "found while decoding") from e
        # One host read of the ids and the substituted count together.
        *routed, substituted = torch.cat([ids[0], sub.to(ids.dtype)]).tolist()
        cpu = rt.book.use(layer, routed, True, -1, substituted, rt.max_inserts(layer))
        if cpu:
            self.cpu[layer.index] = cpu
        self.pending[layer.index] = (routed, ids)
        try:
            predictions = rt.steering.predictions(layer, layer.need_residual())
        except pk.NonFiniteError as e:  # the next layer's router input
            raise non_finite([layer.index + 1], "found while predicting it") from e
        for target, n, pred in predictions:
            rt.book.prefetch(rt.layers[target], pred[0], n, physical=True)
        return self.out(logits, w, ids)

    def take(self, layer: MoELayer, ids: torch.Tensor) -> list[int]:
        """The routed ids of this layer's step; the model hands the router's ids tensor
        straight to its experts (identity: no sync)."""
        routed, want = self.pending.pop(layer.index, (None, None))
        if routed is None or ids is not want:
            raise RuntimeError(f"MoE layer {layer.index}: experts called without a matching route")
        return routed

    def slot_ids(
        self, layer: MoELayer, ids: torch.Tensor, routed: Sequence[int], slots: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the expert kernel reads: one slot per routed id (and no slot table)."""
        return torch.tensor([slots], device=ids.device), None

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        routed = self.take(layer, ids)
        cpu = set(self.cpu.pop(layer.index, ()))
        return self.rt.placement.host_experts(self, layer, x, ids, weights, routed, cpu)

    def slab_experts(
        self,
        layer: MoELayer,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        routed: list[int],
    ) -> torch.Tensor:
        """Every routed expert from its slab slot, once the store's copies into them landed."""
        rt = self.rt
        slots = layer.slots.slots(routed)  # the experts this step reads: its routed ids or set
        if rt.acct.recorder is not None:
            rt.acct.recorder.read(layer.index, slots)
        if not slots:  # a verify block whose experts all run on the CPU
            return torch.zeros_like(x)
        st, table = self.slot_ids(layer, ids, routed, slots)
        with rt.store.reading(layer.index, slots, routed) as slab:
            return rt.computes[layer.index].slab(
                x, slab, st, weights.float(), table, bias=layer.biases(ids),
                skip_absent=table is not None,
            )  # fmt: skip


class VerifyBlock(HostDecode):
    """Speculative verification of a block of tokens in one forward: each MoE layer routes
    the block as the runtime's verify rule says (runtime/verify.py: one budgeted set, or each
    token's top-k with CPU experts), `use`s the experts its tokens route to as one routing
    (capped by the rule), and prefetches the next layer's `n` experts of largest summed
    score over the block's rows."""

    name = "verify"

    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        rt = self.rt
        if layer.index == 0:
            rt.acct.open_token()
        logits = self.logits(layer, x)
        w, ids = self.route_block(layer, logits, physical=True)
        predicted = self.predict_block(layer, layer.need_residual())
        if predicted is not None:
            rt.book.prefetch(rt.layers[layer.index + 1], predicted, rt.policy.n, physical=True)
        return self.out(logits, w, ids)

    def route_block(
        self, layer: MoELayer, logits: torch.Tensor, physical: bool, trace_token: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route a block's tokens by the verify rule, biased toward the logical cache; the
        experts they route to are `use`d as one routing (their misses copy now when
        physical, up to the rule's cap; the others are left to the CPU, in `self.cpu`).
        `self.pending` gets the members read from the slab."""
        rt = self.rt
        rule = rt.verify
        assert rule is not None
        lam = rt.steering.lam(layer)
        mask = rt.book.mask(layer, rt.policy, logits.device) if lam > 0 else None
        w, ids = rule.select(rt, layer, logits, mask)
        routed = union(ids)
        # Not counted as substituted: the `routed` count of a verify step is the block's
        # union, not the tokens' top-k slots the count compares.
        cpu = rt.book.use(layer, routed, physical, trace_token, 0, rule.max_inserts(layer))
        if cpu:
            self.cpu[layer.index] = cpu
            if rt.acct.recorder is not None:  # the CPU's token rows, for the latency model
                on_cpu = torch.isin(ids, torch.tensor(cpu, device=ids.device))
                rt.acct.recorder.cpu_rows(layer.index, int(on_cpu.sum()))
            routed = [e for e in routed if e not in set(cpu)]
        self.pending[layer.index] = (routed, ids)
        return w, ids

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The block's members from their slab slots, plus (verify='cpu') the union's other
        experts from the host rows on the CPU, each once over its tokens; summed in that
        order."""
        members = self.take(layer, ids)
        cpu = self.cpu.pop(layer.index, [])
        y = self.slab_experts(layer, x, ids, weights, members)
        if not cpu:
            return y
        rt = self.rt
        comp, host = rt.computes[layer.index], rt.store.host(layer.index)
        only = torch.zeros(rt.spec.num_experts, dtype=torch.bool)
        only[torch.tensor(cpu, dtype=torch.long)] = True
        part = comp.grouped_host(x.cpu(), ids.cpu(), weights.float().cpu(), host, only=only)
        return y + part.to(y.device)

    def predict_block(self, layer: MoELayer, residual: torch.Tensor) -> list[int] | None:
        """The next MoE layer's `n` experts of largest summed score over a block's rows
        (its router, unbiased, on this layer's MoE input normed as it norms it)."""
        rt = self.rt
        n = rt.policy.n
        if n == 0 or layer.index + 1 >= len(rt.layers):
            return None
        nxt = rt.layers[layer.index + 1]
        h = pk.rms_norm_ref(residual, nxt.norm_weight, nxt.norm_eps)
        logits = h @ nxt.gate_weight.float().t()
        if nxt.gate_bias is not None:
            logits = logits + nxt.gate_bias.float()
        score = pk.block_scores_ref(logits, rt.spec.scoring, nxt.bias)
        # Ties to the lower id, as everywhere.
        return torch.sort(score, descending=True, stable=True).indices[:n].tolist()

    def slot_ids(
        self, layer: MoELayer, ids: torch.Tensor, routed: Sequence[int], slots: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each token's expert ids and the members' slot table on the device (-1: an expert
        outside the members, computed on the CPU)."""
        table = torch.full((self.rt.spec.num_experts,), -1, dtype=torch.long)
        table[torch.tensor(list(routed), dtype=torch.long)] = torch.tensor(slots)
        return ids, table.to(ids.device)
