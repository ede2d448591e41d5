"""One MoE layer as the runtime keeps it: the model's router, the norm its predictions use,
its logical cache and slot map, and the prefill history that seeds them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from psr.cache import LogicalCache
from psr.runtime.slots import SlotMap


@dataclass(frozen=True)
class Wiring:
    """One MoE layer as the family entry finds it in the model: what the runtime builds its
    `MoELayer` from."""

    decoder_index: int
    router: nn.Module
    norm: nn.Module  # the post-attention RMSNorm (its weight and eps serve predictions)
    gate_weight: torch.Tensor
    correction_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    expert_bias: torch.Tensor | None = None


@dataclass
class MoELayer:
    """Runtime state of one MoE layer (the host-side caches; the device-side ones live in
    `psr.runtime.device_decode`)."""

    decoder_index: int  # index among the model's decoder layers
    index: int  # index among MoE layers (= store layer)
    router: nn.Module  # the model's router module (kept for state dicts and restore)
    gate_weight: torch.Tensor  # the router's weight [E, H], wherever the family keeps it
    correction_bias: torch.Tensor | None  # e_score_correction_bias [E], if the router has one
    # This layer's post-attention RMSNorm, for predictions into it: its weight and eps,
    # not the module (the module's residual hook refers to the runtime: no cycle).
    norm_weight: torch.Tensor
    norm_eps: float
    cache: LogicalCache
    slots: SlotMap
    history: list[list[int]] = field(default_factory=list)  # prefill's routed ids per token
    seeded: bool = False
    residual: torch.Tensor | None = None  # the state entering the MoE block, this forward
    gate_bias: torch.Tensor | None = None  # the router's own bias [E] (gpt-oss)
    # Every expert's biases [E, 2F + H] fp32 on the device (gate, up, down; gpt-oss): the
    # copies move the matrices, the FFN gathers these by the routed ids.
    expert_bias: torch.Tensor | None = None

    def biases(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The routed experts' biases `[..., 2F + H]` (None for experts without)."""
        if self.expert_bias is None:
            return None
        return self.expert_bias[ids.to(self.expert_bias.device).long()].contiguous()

    @property
    def bias(self) -> torch.Tensor | None:
        return self.correction_bias

    def need_residual(self) -> torch.Tensor:
        if self.residual is None:
            raise RuntimeError(f"no residual captured for MoE layer {self.index}")
        return self.residual


def weight_of(module: nn.Module) -> torch.Tensor:
    """`module.weight` (a router's, a norm's) as the tensor it is: nn.Module's attribute
    lookup is typed `Tensor | Module`."""
    w = module.weight
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is a {type(w).__name__}, not a tensor")
    return w


def norm_eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise TypeError(f"cannot find the epsilon of {type(norm).__name__}")
