"""torch.library registrations of the psr kernels, and a vLLM routing hook.

`torch.ops.psr.route`, `route_hidden`, `predict_next` and `expert_ffn` (float or
quantized slab rows: its `fmt`) dispatch through
`psr_kernels.dispatch.kernel_ops("auto", device)`: the Triton kernel on CUDA tensors,
the torch reference elsewhere, unless the process default `PSR_COMPUTE`
(auto|triton|torch) says otherwise (`PSR_COMPUTE=triton` runs the kernels on CPU
tensors under TRITON_INTERPRET=1). One call site serves GPU and CPU.

The ops keep primitive schemas (other runtimes call them): the routing ops take the
fields of a `RouteSpec` as arguments, and build the spec in one helper, `_route_args`.
Each op has a fake (meta) implementation whose outputs match the real ones in shape,
dtype and strides (all outputs are fresh contiguous tensors), so they trace under
`torch.compile` (inductor included) and pass `torch.library.opcheck`. The ops skip
the NaN check (a host sync); validate inputs upstream if they may be non-finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from psr_kernels.dispatch import kernel_ops
from psr_kernels.routing import SCORINGS, RouteSpec

# The routing arguments of psr::route and psr::route_hidden after their tensors, in
# schema order. The ops and their fakes take them as `*args` and turn them into
# (RouteSpec, mask, bias) with `_route_args`, whose signature is this list again
# (a test checks the two agree).
_ROUTE_ARGS = (
    "int top_k, Tensor? mask=None, float lam=0.0, str scoring='softmax', "
    "bool renormalize=False, Tensor? bias=None, int n_group=1, int topk_group=1, "
    "float scaling=1.0, str group_score='top2', float norm_min=0.0, float mixer_eps=0.0"
)


def _route_args(
    top_k: int,
    mask: Tensor | None = None,
    lam: float = 0.0,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
    group_score: str = "top2",
    norm_min: float = 0.0,
    mixer_eps: float = 0.0,
) -> tuple[RouteSpec, Tensor | None, Tensor | None]:
    """`(spec, mask, bias)` of the route ops' primitive arguments (`_ROUTE_ARGS`)."""
    spec = RouteSpec(
        top_k,
        lam,
        scoring,
        renormalize,
        n_group,
        topk_group,
        scaling,
        group_score,
        norm_min,
        mixer_eps,
    )
    return spec, mask, bias


@torch.library.custom_op(
    "psr::route", mutates_args=(), schema=f"(Tensor logits, {_ROUTE_ARGS}) -> (Tensor, Tensor)"
)
def route_op(logits: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    spec, mask, bias = _route_args(*args, **kwargs)
    return kernel_ops("auto", logits.device).route(
        logits, spec, mask=mask, bias=bias, check_finite=False
    )


@route_op.register_fake
def _(logits: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    spec, _, _ = _route_args(*args, **kwargs)
    T = logits.shape[0]
    return (
        logits.new_empty(T, spec.top_k, dtype=torch.float32),
        logits.new_empty(T, spec.top_k, dtype=torch.int64),
    )


@torch.library.custom_op(
    "psr::route_hidden",
    mutates_args=(),
    schema=f"(Tensor hidden, Tensor gate_weight, {_ROUTE_ARGS}) -> (Tensor, Tensor, Tensor)",
)
def route_hidden_op(
    hidden: Tensor, gate_weight: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor, Tensor]:
    spec, mask, bias = _route_args(*args, **kwargs)
    return kernel_ops("auto", hidden.device).route_hidden(
        hidden, gate_weight, spec, mask=mask, bias=bias, check_finite=False
    )


@route_hidden_op.register_fake
def _(hidden: Tensor, gate_weight: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
    spec, _, _ = _route_args(*args, **kwargs)
    T, E = hidden.shape[0], gate_weight.shape[0]
    return (
        hidden.new_empty(T, spec.top_k, dtype=torch.float32),
        hidden.new_empty(T, spec.top_k, dtype=torch.int64),
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
    # The next layer's router; predict_next takes its scoring and group limit only.
    spec = RouteSpec(n, scoring=scoring, n_group=n_group, topk_group=topk_group)
    return kernel_ops("auto", residual.device).predict_next(
        residual,
        norm_weight,
        gate_weight,
        n,
        spec,
        eps=eps,
        mask=mask,
        bias=bias,
        check_finite=False,
    )


@predict_next_op.register_fake
def _(
    residual: Tensor, norm_weight: Tensor, gate_weight: Tensor, n: int, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor]:
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
    fmt: str | None = None,
    group_size: int = 128,
) -> Tensor:
    return kernel_ops("auto", x.device).expert_ffn(
        x,
        slab,
        slots,
        weights,
        hidden_size,
        ffn_size,
        fmt=fmt,
        group_size=group_size,
        out_dtype=out_dtype,
        check_slots=False,
    )


@expert_ffn_op.register_fake
def _(
    x: Tensor,
    slab: Tensor,
    slots: Tensor,
    weights: Tensor,
    hidden_size: int,
    ffn_size: int,
    out_dtype: torch.dtype | None = None,
    fmt: str | None = None,
    group_size: int = 128,
) -> Tensor:
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


MaskSource = Tensor | Callable[[], Tensor | None] | None
VllmRoutingFunction = Callable[..., tuple[Tensor, Tensor]]
_VLLM_SCORINGS = ("softmax", "topk_softmax")


def make_vllm_routing_function(
    mask: MaskSource = None,
    lam: float = 0.0,
    *,
    scoring: str = "softmax",
    scaling: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
) -> VllmRoutingFunction:
    """A cache-biased `custom_routing_function` for vLLM's FusedMoE (softmax routers).

    vLLM calls it by keyword, `fn(hidden_states=..., gating_output=..., topk=...,
    renormalize=...)`, and expects `(topk_weights float32 [T, k], topk_ids int32
    [T, k])`; both are returned contiguous. `mask` is the layer's cache mask (bool
    `[E]` or `[T, E]`), a callable returning it at call time (e.g. the layer's current
    logical cache), or None for exact routing; `lam` is the bias strength.

    Softmax routers only (`scoring` 'softmax' or 'topk_softmax': OLMoE, Qwen-MoE,
    Mixtral). vLLM does not let a custom routing function serve grouped top-k:
    FusedMoE takes its own grouped path when `use_grouped_topk` is set (DeepSeek-V3,
    Moonlight: sigmoid scores, `n_group` / `topk_group`, e_score_correction_bias)
    and never calls the hook. Asking for grouped or sigmoid routing here raises
    ValueError rather than building a hook vLLM would silently bypass.
    """
    if n_group != 1 or topk_group != 1:
        raise ValueError(
            "make_vllm_routing_function: vLLM does not use a custom routing function with "
            f"grouped top-k (use_grouped_topk; got n_group={n_group}, "
            f"topk_group={topk_group}): its FusedMoE routes DeepSeek-V3-style models "
            "itself, so this hook supports softmax routers only"
        )
    if scoring not in _VLLM_SCORINGS:
        known = scoring in SCORINGS
        raise ValueError(
            f"make_vllm_routing_function: scoring {scoring!r} is "
            f"{'not supported' if known else 'unknown'}; the hook supports softmax "
            f"routers only ({', '.join(map(repr, _VLLM_SCORINGS))}), since vLLM routes "
            "sigmoid/grouped (DeepSeek-V3) models with its own grouped top-k"
        )

    def routing(
        hidden_states: Tensor, gating_output: Tensor, topk: int, renormalize: bool
    ) -> tuple[Tensor, Tensor]:
        m = mask() if callable(mask) else mask
        w, ids = torch.ops.psr.route(
            gating_output,
            topk,
            mask=m,
            lam=lam,
            scoring=scoring,
            renormalize=renormalize,
            scaling=scaling,
        )
        return w.contiguous(), ids.to(torch.int32).contiguous()

    return routing
