"""What the runtime needs to know about a model's MoE layers, and the slot-count rule.

Family-agnostic: `psr.models.families` maps each supported architecture onto a
`MoESpec`; the runtime never looks at a model family.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from numbers import Real

from psr.policy import Policy
from psr_kernels import Activation, RouteSpec


@dataclass(frozen=True)
class MoESpec:
    """Routing semantics and expert shapes of a model's MoE layers (all layers alike)."""

    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int
    scoring: str = "softmax"  # 'softmax' | 'topk_softmax' | 'sigmoid' (psr_kernels.SCORINGS)
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    group_score: str = "top2"  # 'top2' | 'max' (psr_kernels.GROUP_SCORES)
    norm_min: float = 0.0  # floor of the renormalising sum (ERNIE's moe_norm_min)
    mixer_eps: float = 0.0  # PhiMoE's sparsemixer threshold (router_jitter_noise)
    # Router GEMV in fp32 (DeepSeek-V3 casts hidden and weight to fp32).
    logits_fp32: bool = False
    # OLMoE / Qwen cast the top-k weights back to the logits dtype.
    weights_in_logits_dtype: bool = True
    family: str = ""
    # The expert kind: its gated activation ('silu' | 'clamped': psr_kernels.Activation,
    # with `act_alpha` / `act_limit`) and whether each expert has biases (gpt-oss; they
    # stay on the device, [E, 2F + H] per layer); whether the router has a bias.
    activation: str = "silu"
    act_alpha: float = 1.0
    act_limit: float = math.inf
    expert_bias: bool = False
    router_bias: bool = False
    # The gate weight scales each expert's input, not its output (Llama 4).
    input_scaled: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "ffn_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.family or 'model'}: {name} must be an int >= 1, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"{self.family or 'model'}: top_k={self.top_k} experts per token exceeds "
                f"num_experts={self.num_experts}"
            )

    @functools.cached_property
    def act(self) -> Activation:
        """The experts' activation as the kernels take it (made once: every routed layer
        of every decode token asks)."""
        return Activation(self.activation, self.act_alpha, self.act_limit)

    @property
    def expert_numel(self) -> int:
        """Elements of one packed expert: gate [F, H], up [F, H], down [H, F]."""
        return 3 * self.hidden_size * self.ffn_size

    def route_spec(self, lam: float = 0.0) -> RouteSpec:
        """This router as psr_kernels' routing ops take it, biased toward the cache by
        `lam` (0: the model's exact routing); made once per lam (its checks cost ~4 µs,
        and every routed layer asks)."""
        return _route_spec(self, float(lam))


@functools.lru_cache(maxsize=256)
def _route_spec(spec: MoESpec, lam: float) -> RouteSpec:
    return RouteSpec(
        top_k=spec.top_k,
        lam=lam,
        scoring=spec.scoring,
        renormalize=spec.renormalize,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        scaling=spec.scaling,
        group_score=spec.group_score,
        norm_min=spec.norm_min,
        mixer_eps=spec.mixer_eps,
    )


def resolve_capacity(
    spec: MoESpec,
    policy: Policy,
    residency: float | None,
    slots: int | None,
    max_slots: int | None = None,
    experts_on: str = "gpu",
) -> int:
    """Slots per layer: C = floor(residency * E + 0.5), or `slots`; k <= C <= E with
    experts_on 'gpu' (every routed expert runs from the slab), 0 <= C <= E with 'cpu' /
    'hybrid' (the routed experts past the slab computed on the CPU: docs/design.md, "A slab
    smaller than top-k"); at most `max_slots` (a store's size) and n <= C, else a
    ValueError naming the rule."""
    E, k = spec.num_experts, spec.top_k
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, int):
            raise TypeError(f"slots must be an int, got {slots!r}")
        if slots < 0:
            raise ValueError(f"slots must be an int >= 0, got {slots}")
        C, how = slots, f"slots={slots}"
    else:
        if (
            isinstance(residency, bool)
            or not isinstance(residency, Real)
            or not (0 < residency <= 1)
        ):
            zero = " (no slots at all: slots=0 with experts_on='cpu')" if residency == 0 else ""
            raise ValueError(f"residency must be a number in (0, 1], got {residency!r}{zero}")
        C, how = math.floor(residency * E + 0.5), f"residency {residency:g} of {E} experts"
    if C < k and experts_on == "gpu":
        raise ValueError(
            f"{how} gives {C} expert slots per layer, fewer than top_k={k}: "
            f"need residency >= {k / E:.4g} (or slots >= {k}), or experts_on='cpu' / "
            "'hybrid' to compute the rest on the CPU"
        )
    if C > E:
        raise ValueError(f"{how} gives {C} slots, more than the {E} experts per layer")
    if max_slots is not None and C > max_slots:
        raise ValueError(
            f"{how} gives {C} slots per layer, more than the store's {max_slots} "
            "(reload with a higher residency to use more)"
        )
    if policy.n > C:
        raise ValueError(f"n={policy.n} prefetches exceed the {C} slots per layer")
    return C


def resolve_slab_slots(spec: MoESpec, capacity: int, batch_slots: int | None) -> int:
    """The store's slots per layer: the solo `capacity`, or `batch_slots` (LoadConfig) for
    batched decode, between the capacity and the experts per layer, else a ValueError."""
    if batch_slots is None:
        return capacity
    E = spec.num_experts
    if batch_slots < capacity:
        raise ValueError(
            f"batch_slots={batch_slots} is fewer than the {capacity} solo slots per layer: "
            "a batch's slab holds at least one sequence's cache"
        )
    if batch_slots > E:
        raise ValueError(f"batch_slots={batch_slots} exceeds the {E} experts per layer")
    return batch_slots
