"""Drop-in modules for a transformers MoE block: its router and its experts."""

from __future__ import annotations

import torch
from torch import nn

from psr.runtime.engine import OffloadRuntime
from psr.runtime.layer import MoELayer


class PSRRouter(nn.Module):
    """Drop-in for a model's router module: returns (logits, weights, ids) like it."""

    def __init__(self, runtime: OffloadRuntime, layer: MoELayer) -> None:
        super().__init__()
        self.runtime = runtime
        self.layer = layer
        self.inner = layer.router  # keeps the router's parameters registered

    def forward(
        self, hidden_states: torch.Tensor, *extra: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # `extra`: what some blocks pass their router besides the hidden state (MiniMax-M2
        # its correction bias); psr's routing reads the layer's own (MoELayer.bias).
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self.runtime.route(self.layer, x)


class OffloadedExperts(nn.Module):
    """Drop-in for a model's experts module; weights live in the expert store."""

    def __init__(self, runtime: OffloadRuntime, layer: MoELayer) -> None:
        super().__init__()
        self.runtime = runtime
        self.layer = layer

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.runtime.experts(self.layer, hidden_states, top_k_index, top_k_weights)
