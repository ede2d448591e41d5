"""torch.library registrations of the psr kernels, and a vLLM routing hook.

`torch.ops.psr.route`, `route_hidden`, `predict_next` and `expert_ffn` run the
Triton kernel on CUDA tensors (or anywhere under TRITON_INTERPRET=1) and the
torch reference otherwise, so one call site serves GPU and CPU. Each has a fake
(meta) implementation, so they trace under `torch.compile`. The ops skip the
NaN check (a host sync); validate inputs upstream if they may be non-finite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from psr_kernels._common import interpreting
from psr_kernels.expert_ffn import expert_ffn, expert_ffn_ref
from psr_kernels.routing import (
    predict_next,
    predict_next_ref,
    route,
    route_hidden,
    route_hidden_ref,
    route_ref,
)


def _use_triton(t: Tensor) -> bool:
    return t.is_cuda or interpreting()


@torch.library.custom_op("psr::route", mutates_args=())
def route_op(
    logits: Tensor,
    top_k: int,
    mask: Tensor | None = None,
    lam: float = 0.0,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
) -> tuple[Tensor, Tensor]:
    fn = route if _use_triton(logits) else route_ref
    return fn(
        logits,
        top_k,
        mask=mask,
        lam=lam,
        scoring=scoring,
        renormalize=renormalize,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        scaling=scaling,
        check_finite=False,
    )


@route_op.register_fake
def _(
    logits,
    top_k,
    mask=None,
    lam=0.0,
    scoring="softmax",
    renormalize=False,
    bias=None,
    n_group=1,
    topk_group=1,
    scaling=1.0,
):
    T = logits.shape[0]
    return (
        logits.new_empty(T, top_k, dtype=torch.float32),
        logits.new_empty(T, top_k, dtype=torch.int64),
    )


@torch.library.custom_op("psr::route_hidden", mutates_args=())
def route_hidden_op(
    hidden: Tensor,
    gate_weight: Tensor,
    top_k: int,
    mask: Tensor | None = None,
    lam: float = 0.0,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    fn = route_hidden if _use_triton(hidden) else route_hidden_ref
    return fn(
        hidden,
        gate_weight,
        top_k,
        mask=mask,
        lam=lam,
        scoring=scoring,
        renormalize=renormalize,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        scaling=scaling,
        check_finite=False,
    )


@route_hidden_op.register_fake
def _(
    hidden,
    gate_weight,
    top_k,
    mask=None,
    lam=0.0,
    scoring="softmax",
    renormalize=False,
    bias=None,
    n_group=1,
    topk_group=1,
    scaling=1.0,
):
    T, E = hidden.shape[0], gate_weight.shape[0]
    return (
        hidden.new_empty(T, top_k, dtype=torch.float32),
        hidden.new_empty(T, top_k, dtype=torch.int64),
        hidden.new_empty(T, E, dtype=torch.float32),
    )


@torch.library.custom_op("psr::predict_next", mutates_args=())
def predict_next_op(
    residual: Tensor,
    norm_weight: Tensor,
    gate_weight: Tensor,
    n: int,
    mask: Tensor | None = None,
    eps: float = 1e-6,
    scoring: str = "softmax",
    bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[Tensor, Tensor]:
    fn = predict_next if _use_triton(residual) else predict_next_ref
    return fn(
        residual,
        norm_weight,
        gate_weight,
        n,
        mask=mask,
        eps=eps,
        scoring=scoring,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        check_finite=False,
    )


@predict_next_op.register_fake
def _(
    residual,
    norm_weight,
    gate_weight,
    n,
    mask=None,
    eps=1e-6,
    scoring="softmax",
    bias=None,
    n_group=1,
    topk_group=1,
):
    T = residual.shape[0]
    return (residual.new_empty(T, n, dtype=torch.int64), residual.new_empty(T, n, dtype=torch.bool))


@torch.library.custom_op("psr::expert_ffn", mutates_args=())
def expert_ffn_op(
    x: Tensor,
    slab: Tensor,
    slots: Tensor,
    weights: Tensor,
    hidden_size: int,
    ffn_size: int,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    fn = expert_ffn if _use_triton(x) else expert_ffn_ref
    return fn(
        x, slab, slots, weights, hidden_size, ffn_size, out_dtype=out_dtype, check_slots=False
    )


@expert_ffn_op.register_fake
def _(x, slab, slots, weights, hidden_size, ffn_size, out_dtype=None):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


MaskSource = Tensor | Callable[[], Tensor | None] | None


def make_vllm_routing_function(
    mask: MaskSource = None,
    lam: float = 0.0,
    *,
    scoring: str = "softmax",
    scaling: float = 1.0,
) -> Callable[[Tensor, Tensor, int, bool], tuple[Tensor, Tensor]]:
    """A `custom_routing_function` for vLLM's FusedMoE.

    vLLM calls `fn(hidden_states, gating_output, topk, renormalize)` and expects
    `(topk_weights fp32 [T, k], topk_ids int32 [T, k])`. `mask` is the layer's
    cache mask, or a callable returning it at call time (e.g. the current logical
    cache of this layer), or None for exact routing.
    """

    def routing(
        hidden_states: Tensor, gating_output: Tensor, topk: int, renormalize: bool
    ) -> tuple[Tensor, Tensor]:
        m = mask() if callable(mask) else mask
        w, ids = route_op(gating_output, topk, m, lam, scoring, renormalize, None, 1, 1, scaling)
        return w, ids.to(torch.int32)

    return routing
