"""What a forward does at each MoE layer, per mode: `route` (the router module's forward:
logits, top-k weights, top-k ids) then `experts` (the experts module's forward). The
engine picks one step object per forward: prefill, the device (sync-free) or host-driven
decode step, a teacher-forced scoring window, or a speculative verify block."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from psr.runtime.dense import row_aligned, rows_linear
from psr.runtime.layer import MoELayer

if TYPE_CHECKING:
    from psr.runtime.context import StepContext

Routed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (logits, weights, ids)
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def non_finite(layers: list[int], when: str) -> ValueError:
    """The one error for router inputs with NaN or inf, whichever step found them."""
    return ValueError(
        f"MoE layer {layers[0]}: router logits contain NaN or inf ({when}; layers {layers})"
    )


def _rows_logits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Router logits by `rows_linear`, rows aligned (a sigmoid router's transcendentals then
    round each row alike: dense.row_aligned)."""
    return row_aligned(rows_linear(x, w, b))


class Step:
    name = "step"

    def __init__(self, runtime: StepContext) -> None:
        # A weak proxy: the runtime holds its steps (and steering), so a strong reference
        # back would be a cycle that keeps a dropped model's store alive until the GC runs.
        self.rt: StepContext = weakref.proxy(runtime)

    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        raise NotImplementedError

    def reset(self) -> None:
        """The sequence ends (the engine calls it): drop what this step holds of it."""

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    # --- shared by the modes -------------------------------------------------------
    def logits(self, layer: MoELayer, x: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
        """The router's logits, computed as the model computes them (by `linear`: batched
        decode passes its batch-invariant one; a row-invariant CPU forward takes
        `rows_linear`, which is both)."""
        w, b = layer.gate_weight, layer.gate_bias
        if self.rt.computes[layer.index].row_invariant and x.device.type == "cpu":
            linear = _rows_logits
        # fp32 where the model computes it so (DeepSeek casts; a router kept in fp32).
        if self.rt.spec.logits_fp32 or w.dtype == torch.float32:
            return linear(x.float(), w.float(), None if b is None else b.float())
        return linear(x, w, b)

    def out(self, logits: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> Routed:
        """What the router returns: weights cast back to the logits' dtype where the model
        does so."""
        if self.rt.spec.weights_in_logits_dtype:
            w = w.to(logits.dtype)
        return logits, w, ids
