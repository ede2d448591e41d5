"""The steering seam: per MoE layer, how strongly routing leans toward the logical cache
(`lam`) and which experts are inserted into later layers' caches (`predictions`).

`Steering` is the spec's rule: the policy's lam in every layer, and the next MoE layer's
router applied to this layer's MoE input (normed as that layer norms it), its first `n`
ids. The device decode step implements exactly this rule; research variants that change
it (bench/variants.py) subclass `Steering` and set `spec_rule = False`, which makes
decoding take the host-driven step, where any rule can run.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

import psr_kernels as pk
from psr.runtime.context import Prediction

if TYPE_CHECKING:
    from psr.runtime.context import RoutingContext
    from psr.runtime.layer import MoELayer

__all__ = ["Prediction", "Steering"]


class Steering:
    spec_rule = True  # False in subclasses: they run the host-driven decode step

    def __init__(self, runtime: RoutingContext) -> None:
        # A weak proxy: the runtime holds its steps (and steering), so a strong reference
        # back would be a cycle that keeps a dropped model's store alive until the GC runs.
        self.rt: RoutingContext = weakref.proxy(runtime)

    def lam(self, layer: MoELayer) -> float:
        """The bias strength of a layer's routing."""
        return self.rt.policy.lam

    def predict(
        self, layer: MoELayer, residual: torch.Tensor, ahead: int, n: int, rows: bool = False
    ) -> list[list[int]] | None:
        """Per `residual` row of `layer`, the `n` ids the router of MoE layer
        `layer.index + ahead` predicts on it, normed as that layer norms its input (None:
        nothing to predict). A host read of the ids. `rows`: the rows are a batch's
        sequences, each predicted as if alone (the torch path in one call,
        `predict_next_ref(rows=True)`; the kernels once per row)."""
        layers, ops = self.rt.layers, self.rt.ops
        if n == 0 or layer.index + ahead >= len(layers):
            return None
        nxt = layers[layer.index + ahead]
        args = (nxt.norm_weight, nxt.gate_weight, n, self.rt.spec.route_spec())
        kw: dict[str, Any] = dict(eps=nxt.norm_eps, bias=nxt.bias, gate_bias=nxt.gate_bias)
        if not rows or residual.shape[0] == 1:
            ids, _ = ops.predict_next(residual, *args, **kw)
        elif ops.path == "torch":
            ids, _ = pk.predict_next_ref(residual, *args, rows=True, **kw)
        else:
            T = residual.shape[0]
            ids = torch.cat([ops.predict_next(residual[r : r + 1].clone(), *args, **kw)[0]
                             for r in range(T)])  # fmt: skip
        return ids.tolist()

    def predictions(self, layer: MoELayer, residual: torch.Tensor) -> list[Prediction]:
        """`layer`'s prefetch predictions per `residual` row, in the order they are
        inserted."""
        ids = self.predict(layer, residual, 1, self.rt.policy.n)
        return [] if ids is None else [(layer.index + 1, self.rt.policy.n, ids)]

    def predictions_rows(self, layer: MoELayer, residual: torch.Tensor) -> list[Prediction]:
        """`predictions` of a batch's rows (`residual [b, H]`, one sequence each), each
        row's ids as its own call of `predictions` gives them."""
        ids = self.predict(layer, residual, 1, self.rt.policy.n, rows=True)
        return [] if ids is None else [(layer.index + 1, self.rt.policy.n, ids)]
