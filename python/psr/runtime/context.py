"""What the steps (prefill, device and host decode, verify, window) and the steering read
of the engine, as protocols: the step modules depend on these, never on `engine.py`, so
the runtime imports one way (engine -> steps -> context -> the parts below)."""

from __future__ import annotations

from typing import Protocol

import torch

import psr_kernels as pk
from psr.machine import PrefillSplit
from psr.policy import Policy
from psr.runtime.accounting import Accounting
from psr.runtime.bookkeeping import HostCaches
from psr.runtime.compute import ExpertCompute
from psr.runtime.expert_placement import ExpertPlacement
from psr.runtime.layer import MoELayer
from psr.runtime.spec import MoESpec
from psr.runtime.verify import VerifyRule
from psr.store import ExpertStore

# A prediction of the steering: (MoE layer it is for, experts per token, ids per token).
Prediction = tuple[int, int, list[list[int]]]


class RoutingContext(Protocol):
    """What the steering reads: the routing semantics, the layers, the kernels, the policy
    (read-only: a step never reconfigures the engine)."""

    @property
    def spec(self) -> MoESpec: ...
    @property
    def layers(self) -> list[MoELayer]: ...
    @property
    def ops(self) -> pk.KernelOps: ...
    @property
    def policy(self) -> Policy: ...


class SteeringRule(Protocol):
    """The steering seam as the steps call it (`psr.runtime.steering.Steering`)."""

    @property
    def spec_rule(self) -> bool: ...

    def lam(self, layer: MoELayer) -> float: ...

    def predictions(self, layer: MoELayer, residual: torch.Tensor) -> list[Prediction]: ...

    def predictions_rows(self, layer: MoELayer, residual: torch.Tensor) -> list[Prediction]: ...


class StepContext(RoutingContext, Protocol):
    """What a step reads of the engine (`psr.runtime.engine.OffloadRuntime` is one)."""

    @property
    def store(self) -> ExpertStore: ...
    @property
    def computes(self) -> list[ExpertCompute]: ...  # per MoE layer (its expert format)
    @property
    def acct(self) -> Accounting: ...
    @property
    def book(self) -> HostCaches: ...
    @property
    def steering(self) -> SteeringRule: ...
    @property
    def capacity(self) -> int: ...
    @property
    def max_capacity(self) -> int: ...
    @property
    def verify(self) -> VerifyRule | None: ...
    @property
    def placement(self) -> ExpertPlacement: ...

    @property
    def prefill_more(self) -> bool: ...  # more chunks of this prompt follow this forward
    @property
    def prefill_reads(self) -> str: ...  # "host" | "slab" (prefill.py)
    @property
    def prefill_split(self) -> PrefillSplit: ...  # slab path: experts computed on the CPU

    def max_inserts(self, layer: MoELayer) -> int | None: ...

    @property
    def decoding(self) -> bool: ...
