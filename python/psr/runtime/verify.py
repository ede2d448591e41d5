"""How a speculative verify block bounds the experts its tokens need (issue 41 item 2): one
class per rule, `make_verify` the factory (as `expert_placement` has one per placement).

For a block of T = B + 1 tokens each MoE layer needs the union of the tokens' experts;
unbounded, that union multiplies the copies by up to T. Two bounds:

  budget  one set S of at most `block_k` experts per layer for the block (the PSR paper's
          block-level selection; MoE-Spec's cap): block scores biased toward the logical
          cache as PSR biases (psr_kernels.block_routing), each token's exact top-k inside
          S. The experts some token routes to are `use`d (S's members no token picked are
          not: they would be copies nobody reads). Quality: whatever S cut off.
  cpu     every token keeps its own top-k (exact, or biased toward the cache as the policy
          biases an autoregressive token); the union is `use`d with at most `copies[l]`
          insertions per layer (`LogicalCache.use`'s cap), the misses not inserted are
          computed on the CPU from the host rows, each expert once over the tokens routed
          to it. No quality cost beyond the policy's own.

Both read only the logical caches and the block's tokens, and `use` once per block and
layer, so the caches stay a function of the accepted tokens: copy timing changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

import psr_kernels as pk
from psr.policy import DEFAULT_VERIFY, default_block_k, default_verify_copies
from psr.vocab import parse_verify

if TYPE_CHECKING:
    from psr.runtime.context import StepContext
    from psr.runtime.expert_placement import ExpertPlacement
    from psr.runtime.layer import MoELayer


def union(ids: torch.Tensor) -> list[int]:
    """The experts some token of a block routes to, ascending (one host read)."""
    return sorted(set(ids.reshape(-1).tolist()))


class VerifyRule:
    """How a verify block routes each MoE layer (a subclass per rule)."""

    name: ClassVar[str]
    # Computes experts from the host rows in place: every expert must be held in memory.
    reads_host_rows: ClassVar[bool] = False
    block_k: int | None = None  # budget's set size (None: no set)

    def check(self, top_k: int, capacity: int, placement: ExpertPlacement) -> None:
        """Raise a one-line ValueError where this rule cannot run with these slots and this
        placement."""

    def select(
        self, rt: StepContext, layer: MoELayer, logits: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], ids [T, k]) of the block's tokens; `mask`: the layer's logical
        cache (None at lam 0)."""
        raise NotImplementedError

    def max_inserts(self, layer: MoELayer) -> int | None:
        """At most how many misses of the union `use` inserts (None: all)."""
        return None

    def describe(self) -> str:
        return self.name


class BudgetSet(VerifyRule):
    """One set of at most `block_k` experts per layer and block, each token's top-k inside."""

    name = "budget"

    def __init__(self, block_k: int) -> None:
        if isinstance(block_k, bool) or not isinstance(block_k, int):
            raise ValueError(f"block_k={block_k!r} must be an int")
        self.block_k = block_k

    def check(self, top_k: int, capacity: int, placement: ExpertPlacement) -> None:
        if self.block_k is None or not top_k <= self.block_k <= capacity:
            raise ValueError(
                f"block_k={self.block_k!r} must be an int in [top_k={top_k}, slots per "
                f"layer={capacity}]"
            )
        if placement.capped:
            raise ValueError(
                f"verify='budget' needs experts_on='gpu', not {placement.name!r} "
                "(verify='cpu' computes a block's misses on the CPU)"
            )

    def select(
        self, rt: StepContext, layer: MoELayer, logits: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.block_k is not None
        spec = rt.spec.route_spec(rt.steering.lam(layer))
        _, w, ids = pk.route_block(logits, spec, self.block_k, mask=mask, bias=layer.bias)
        return w, ids

    def describe(self) -> str:
        return f"budget(K_b={self.block_k})"


class CpuVerify(VerifyRule):
    """Each token's own top-k; at most `copies[l]` misses copied per layer and block, the
    union's other misses computed on the CPU."""

    name = "cpu"
    reads_host_rows = True

    def __init__(self, copies: Sequence[int]) -> None:
        self.copies = list(copies)  # per MoE layer

    def check(self, top_k: int, capacity: int, placement: ExpertPlacement) -> None:
        if len(self.copies) != len(placement.caps):
            raise ValueError(f"{len(self.copies)} copy budgets for {len(placement.caps)} layers")

    def select(
        self, rt: StepContext, layer: MoELayer, logits: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec = rt.spec.route_spec(rt.steering.lam(layer))
        w, ids = rt.ops.route(logits, spec, mask=mask, bias=layer.bias)
        return w, ids

    def max_inserts(self, layer: MoELayer) -> int | None:
        return self.copies[layer.index]

    def describe(self) -> str:
        m = set(self.copies)
        return f"cpu(M={m.pop()})" if len(m) == 1 else f"cpu(M={','.join(map(str, self.copies))})"


VERIFY_RULES: dict[str, type[VerifyRule]] = {cls.name: cls for cls in (BudgetSet, CpuVerify)}


def verify_class(verify: str | None) -> type[VerifyRule]:
    """The rule class `verify` names ('budget', 'cpu', 'cpu:M'; None: DEFAULT_VERIFY;
    ValueError naming them)."""
    return VERIFY_RULES[parse_verify(verify or DEFAULT_VERIFY)[0]]


def make_verify(
    verify: str | None,
    block_k: int | None,
    top_k: int,
    capacity: int,
    placement: ExpertPlacement,
) -> VerifyRule:
    """The rule `verify` names ('budget', 'cpu', 'cpu:M'; None: DEFAULT_VERIFY), checked
    against the slots and the placement. `block_k`: budget's set size (None:
    psr.policy.default_block_k); cpu's M defaults per layer to
    psr.policy.default_verify_copies."""
    verify = verify or DEFAULT_VERIFY
    cls, (_, m) = verify_class(verify), parse_verify(verify)
    rule: VerifyRule
    if cls is BudgetSet:
        rule = BudgetSet(default_block_k(top_k, capacity) if block_k is None else block_k)
    else:
        if block_k is not None:
            raise ValueError("block_k is verify='budget''s set size; verify='cpu' takes none")
        caps = placement.caps if placement.capped else [None] * len(placement.caps)
        rule = CpuVerify([default_verify_copies(top_k, c) if m is None else m for c in caps])
    rule.check(top_k, capacity, placement)
    return rule
