"""One MoE layer's decode step on the device-resident caches, in one kernel launch.

At batch 1 each MoE layer `l` of a decode token does, with no host read:
  program 0: route the token from the layer's router logits, biased toward the layer's
             logical cache (its device membership is the mask), write the gate weights
             (in the model's logits dtype) and ids, then the spec's `use` of the ids on
             layer l's cache: the miss copy list for the gather;
  program 1: (n > 0 and a next MoE layer) predict the next layer's first n experts from
             the hidden state entering this layer's MoE block (RMS-normed as that layer
             norms it, its router, unbiased) and `prefetch` them into its cache: the
             prefetch copy list for the side-stream gather.
The two programs touch different cache rows (l and l + 1) and run concurrently. Router
inputs that are not finite set the rows' `FLAG` (psr_kernels.cache_state) instead of
raising: the caller checks it once, when it reads the counters. Program 0 also counts the
substituted ids (routed, but not in the same scores' exact top-k) into the row's
`substituted` counter when the routing is biased.

`decode_step` launches the kernel; `decode_step_ref` is its plain-torch reference (the
routing and cache references composed), with no host read either, so the CPU runs the
same sync-free step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import torch
import triton
import triton.language as tl

from psr_kernels._common import check_float, check_launchable, pow2
from psr_kernels.cache_state import (
    COUNTS,
    FLAG,
    H_FLAG,
    H_SUBSTITUTED,
    SUBSTITUTED,
    CacheLayout,
    cache_prefetch_step,
    cache_use_step,
    check_state,
)
from psr_kernels.cache_state_ref import cache_prefetch_ref, cache_use_ref
from psr_kernels.routing import RouteSpec, require_spec, router_logits, select_experts
from psr_kernels.routing_ref import predict_next_ref, route_counted_ref


class CacheUse(Protocol):
    """`decode_step_ref`'s `use`: `_flag` of `logits` and `cache_use_ref` of `ids` on
    `layer`'s row, bit for bit."""

    def __call__(
        self,
        state: torch.Tensor,
        layout: CacheLayout,
        layer: int,
        ids: torch.Tensor,
        *,
        capped: bool,
        logits: torch.Tensor | None,
    ) -> None: ...


class CachePrefetch(Protocol):
    """`decode_step_ref`'s `prefetch`: `cache_prefetch_ref` of the first n `predicted` ids
    on `layer`'s row, bit for bit."""

    def __call__(
        self, state: torch.Tensor, layout: CacheLayout, layer: int, predicted: torch.Tensor, n: int
    ) -> None: ...


@triton.jit
def _not_finite(x, valid):
    """1 if any valid element of the tile is NaN or inf, else 0 (int32 scalar)."""
    bad = ((x != x) | (tl.abs(x) == float("inf"))) & valid
    return tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0)


@triton.jit
def _decode_kernel(
    logits_ptr,  # [1, E] router logits of this layer
    stride_le,
    bias_ptr,  # e_score_correction_bias of this layer (HAS_BIAS)
    weights_ptr,  # [1, K] out: gate weights, in its own dtype
    ids_ptr,  # [1, K] out: int64 expert ids
    res_ptr,  # [1, H] hidden state entering this layer's MoE block (N > 0)
    stride_rh,
    norm_ptr,  # next layer's post-attention RMS-norm weight [H]
    eps,
    gate_ptr,  # next layer's router weight [E, H]
    stride_ge,
    stride_gh,
    next_bias_ptr,  # next layer's e_score_correction_bias (HAS_NEXT_BIAS)
    next_gbias_ptr,  # next layer's router bias (HAS_NEXT_GATE_BIAS: gpt-oss)
    state_ptr,  # [layers, W] int32 device caches
    layer,
    H,
    lam,
    scaling,
    norm_min,
    mixer_eps,
    N: tl.constexpr,  # experts to predict into layer + 1 (0: program 1 does nothing)
    K: tl.constexpr,
    IS_SOFTMAX: tl.constexpr,
    IS_TOPK_SOFTMAX: tl.constexpr,
    IS_SIGMOID: tl.constexpr,
    IS_SPARSEMIXER: tl.constexpr,
    IS_TOPK_SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_MAX: tl.constexpr,
    NG_P2: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NEXT_BIAS: tl.constexpr,
    HAS_NEXT_GATE_BIAS: tl.constexpr,
    CAPPED: tl.constexpr,  # the row's miss-copy cap may be below K (cache_use_step)
    E: tl.constexpr,
    S: tl.constexpr,
    W: tl.constexpr,
    OFF_MEMBER: tl.constexpr,
    OFF_PENDING: tl.constexpr,
    OFF_SLOT_OF: tl.constexpr,
    OFF_SLOT_EXPERT: tl.constexpr,
    OFF_HEADER: tl.constexpr,
    OFF_MISS: tl.constexpr,
    OFF_PF: tl.constexpr,
    PF_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    if tl.program_id(0) == 0:
        _route_use(
            logits_ptr, stride_le, bias_ptr, weights_ptr, ids_ptr, state_ptr + layer * W, lam,
            scaling, norm_min, mixer_eps, K, IS_SOFTMAX, IS_TOPK_SOFTMAX, IS_SIGMOID,
            IS_SPARSEMIXER, IS_TOPK_SIGMOID, RENORM, N_GROUP, TOPK_GROUP, GROUP_MAX, NG_P2,
            HAS_MASK, HAS_BIAS, CAPPED, E, S, OFF_MEMBER, OFF_PENDING, OFF_SLOT_OF,
            OFF_SLOT_EXPERT, OFF_HEADER, OFF_MISS, BLOCK_E, BLOCK_S, BLOCK_K,
        )  # fmt: skip
    elif N > 0:
        _predict_prefetch(
            res_ptr, stride_rh, norm_ptr, eps, gate_ptr, stride_ge, stride_gh, next_bias_ptr,
            next_gbias_ptr, state_ptr + (layer + 1) * W, H, N, IS_SOFTMAX, IS_TOPK_SOFTMAX,
            IS_SIGMOID, IS_SPARSEMIXER, IS_TOPK_SIGMOID, N_GROUP, TOPK_GROUP, GROUP_MAX, NG_P2,
            HAS_NEXT_BIAS, HAS_NEXT_GATE_BIAS, E, S, OFF_MEMBER, OFF_PENDING, OFF_SLOT_OF,
            OFF_SLOT_EXPERT, OFF_HEADER, OFF_PF, PF_ROWS, BLOCK_E, BLOCK_S, BLOCK_N, BLOCK_H,
        )  # fmt: skip


@triton.jit
def _route_use(
    logits_ptr, stride_le, bias_ptr, weights_ptr, ids_ptr, row_ptr, lam, scaling, norm_min,
    mixer_eps, K: tl.constexpr, IS_SOFTMAX: tl.constexpr, IS_TOPK_SOFTMAX: tl.constexpr,
    IS_SIGMOID: tl.constexpr, IS_SPARSEMIXER: tl.constexpr, IS_TOPK_SIGMOID: tl.constexpr,
    RENORM: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_MAX: tl.constexpr,
    NG_P2: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, CAPPED: tl.constexpr,
    E: tl.constexpr, S: tl.constexpr, OFF_MEMBER: tl.constexpr, OFF_PENDING: tl.constexpr,
    OFF_SLOT_OF: tl.constexpr, OFF_SLOT_EXPERT: tl.constexpr, OFF_HEADER: tl.constexpr,
    OFF_MISS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program 0: route the token on this layer's cache, write weights and ids, `use`."""
    rows = tl.arange(0, 2)  # one token; row 1 is masked padding (tiles need >= 2 rows)
    cols = tl.arange(0, BLOCK_E)
    valid = (rows < 1)[:, None] & (cols < E)[None, :]
    x = router_logits(
        logits_ptr, 0, stride_le, logits_ptr, 0, 0, logits_ptr, 0.0, logits_ptr, rows, cols, 1, E,
        0, False, False, False, 2, BLOCK_E, 16,
    )  # fmt: skip
    mk = tl.zeros([2, BLOCK_E], dtype=tl.float32)
    if HAS_MASK:
        member = tl.load(row_ptr + OFF_MEMBER + cols, mask=cols < E, other=0)
        mk = tl.where(valid, member.to(tl.float32)[None, :], 0.0)
    ids, w, _, chosen, nsub = select_experts(
        x, mk, bias_ptr, lam, scaling, norm_min, mixer_eps, cols, E, K, IS_SOFTMAX, IS_TOPK_SOFTMAX,
        IS_SIGMOID, IS_SPARSEMIXER, IS_TOPK_SIGMOID, RENORM, HAS_MASK, HAS_BIAS, False, True,
        N_GROUP, TOPK_GROUP, GROUP_MAX, NG_P2, 2, BLOCK_E, BLOCK_K,
    )  # fmt: skip
    kar = tl.arange(0, BLOCK_K)
    om = (rows < 1)[:, None] & (kar < K)[None, :]
    tl.store(weights_ptr + rows[:, None] * K + kar[None, :], w, mask=om)
    tl.store(ids_ptr + rows[:, None] * K + kar[None, :], ids.to(tl.int64), mask=om)
    flag = row_ptr + OFF_HEADER + H_FLAG
    tl.store(flag, tl.maximum(tl.load(flag), _not_finite(x, valid)))
    if HAS_MASK:  # without the bias the routing is exact: nothing substituted
        sub = row_ptr + OFF_HEADER + H_SUBSTITUTED
        tl.store(sub, tl.load(sub) + tl.sum(tl.where(rows < 1, nsub, 0), axis=0))
    routed = tl.max(tl.where(valid, chosen.to(tl.int32), 0), axis=0) != 0
    cache_use_step(
        row_ptr, routed, E, S, K, OFF_MEMBER, OFF_PENDING, OFF_SLOT_OF, OFF_SLOT_EXPERT, OFF_HEADER,
        OFF_MISS, BLOCK_E, BLOCK_S, BLOCK_K, CAPPED,
    )  # fmt: skip


@triton.jit
def _predict_prefetch(
    res_ptr, stride_rh, norm_ptr, eps, gate_ptr, stride_ge, stride_gh, next_bias_ptr,
    next_gbias_ptr, row_ptr, H, N: tl.constexpr, IS_SOFTMAX: tl.constexpr,
    IS_TOPK_SOFTMAX: tl.constexpr, IS_SIGMOID: tl.constexpr, IS_SPARSEMIXER: tl.constexpr,
    IS_TOPK_SIGMOID: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_MAX: tl.constexpr, NG_P2: tl.constexpr, HAS_NEXT_BIAS: tl.constexpr,
    HAS_NEXT_GATE_BIAS: tl.constexpr, E: tl.constexpr, S: tl.constexpr, OFF_MEMBER: tl.constexpr,
    OFF_PENDING: tl.constexpr, OFF_SLOT_OF: tl.constexpr, OFF_SLOT_EXPERT: tl.constexpr,
    OFF_HEADER: tl.constexpr, OFF_PF: tl.constexpr, PF_ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program 1: predict the next layer's first N experts, `prefetch` them into its row."""
    rows = tl.arange(0, 2)
    cols = tl.arange(0, BLOCK_E)
    valid = (rows < 1)[:, None] & (cols < E)[None, :]
    x = router_logits(
        res_ptr, 0, stride_rh, gate_ptr, stride_ge, stride_gh, norm_ptr, eps, next_gbias_ptr, rows,
        cols, 1, E, H, True, True, HAS_NEXT_GATE_BIAS, 2, BLOCK_E, BLOCK_H,
    )  # fmt: skip
    mk = tl.zeros([2, BLOCK_E], dtype=tl.float32)
    ids, _, _, _, _ = select_experts(
        x, mk, next_bias_ptr, 0.0, 1.0, 0.0, 0.0, cols, E, N, IS_SOFTMAX, IS_TOPK_SOFTMAX,
        IS_SIGMOID, IS_SPARSEMIXER, IS_TOPK_SIGMOID, False, False, HAS_NEXT_BIAS, False, False,
        N_GROUP, TOPK_GROUP, GROUP_MAX, NG_P2, 2, BLOCK_E, BLOCK_N,
    )  # fmt: skip
    flag = row_ptr + OFF_HEADER + H_FLAG
    tl.store(flag, tl.maximum(tl.load(flag), _not_finite(x, valid)))
    pred = tl.sum(tl.where((rows < 1)[:, None], ids, 0), axis=0)
    cache_prefetch_step(
        row_ptr, pred, N, E, S, OFF_MEMBER, OFF_PENDING, OFF_SLOT_OF, OFF_SLOT_EXPERT, OFF_HEADER,
        OFF_PF, PF_ROWS, BLOCK_E, BLOCK_S, BLOCK_N,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def decode_config(
    spec: RouteSpec,
    layout: CacheLayout,
    hidden_size: int,
    *,
    n: int,
    has_mask: bool,
    has_bias: bool,
    has_next_bias: bool,
    has_next_gate_bias: bool = False,
    capped: bool = True,
) -> Mapping[str, int | bool]:
    """Every compile-time argument of one decode-step launch, and `num_warps` (cached:
    a read-only mapping, computed once per model and policy)."""
    lo = layout.constexprs()
    cfg: dict[str, int | bool] = {k: v for k, v in spec.constexprs().items() if k not in ("K",)}
    cfg |= {k: lo[k] for k in ("E", "S", "W", "PF_ROWS", "BLOCK_E", "BLOCK_S", "BLOCK_K")}
    cfg |= {k: lo[k] for k in lo if k.startswith("OFF_")}
    cfg |= dict(
        N=n,
        K=spec.top_k,
        BLOCK_N=lo["BLOCK_N"],
        BLOCK_H=max(16, min(pow2(hidden_size), 4096 // (2 * lo["BLOCK_E"]))),
        HAS_MASK=has_mask,
        HAS_BIAS=has_bias,
        HAS_NEXT_BIAS=has_next_bias,
        HAS_NEXT_GATE_BIAS=has_next_gate_bias,
        CAPPED=capped,
        num_warps=4,
    )
    return MappingProxyType(cfg)


def _check(
    op: str,
    logits: torch.Tensor,
    spec: RouteSpec,
    state: torch.Tensor,
    layout: CacheLayout,
    layer: int,
    n: int,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
) -> None:
    require_spec(op, spec)
    check_state(op, state, layout, layer)
    check_float(op, "logits", logits, 2)
    E = layout.num_experts
    if tuple(logits.shape) != (1, E):
        raise ValueError(f"{op}: logits must be [1, {E}] (one token), got {list(logits.shape)}")
    if spec.top_k != layout.top_k:
        raise ValueError(f"{op}: spec.top_k={spec.top_k} but the cache layout's is {layout.top_k}")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= layout.max_prefetch:
        raise ValueError(f"{op}: n={n!r} must be an int in [0, {layout.max_prefetch}]")
    if n == 0:
        return
    if layer + 1 >= state.shape[0]:
        raise ValueError(f"{op}: layer {layer} is the last: there is no next layer to predict")
    if residual is None or norm_weight is None or gate_weight is None:
        raise ValueError(f"{op}: n > 0 needs residual, norm_weight and gate_weight")
    check_float(op, "residual", residual, 2)
    H = residual.shape[1]
    if residual.shape[0] != 1 or tuple(gate_weight.shape) != (E, H):
        raise ValueError(
            f"{op}: residual must be [1, H] and gate_weight [{E}, H], got "
            f"{list(residual.shape)} and {list(gate_weight.shape)}"
        )
    if tuple(norm_weight.shape) != (H,):
        raise ValueError(f"{op}: norm_weight must be [{H}], got {list(norm_weight.shape)}")


def decode_step(
    logits: torch.Tensor,
    spec: RouteSpec,
    state: torch.Tensor,
    layout: CacheLayout,
    layer: int,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    n: int = 0,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    next_bias: torch.Tensor | None = None,
    checked: bool = False,
    next_gate_bias: torch.Tensor | None = None,
    capped: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token's routing and cache updates for MoE layer `layer` (module
    docstring), in one launch.

    Args:
        logits: `[1, E]` router logits; spec: the routing (`spec.lam` > 0 biases toward
            the layer's cache); bias: this layer's e_score_correction_bias.
        state, layout: the device caches (`psr_kernels.cache_state`).
        out_dtype: dtype of the returned gate weights (the model's logits dtype where it
            casts them back).
        n: experts to predict and prefetch into layer + 1 (0: none), from `residual`
            `[1, H]` normed with `norm_weight` / `eps` and scored by `gate_weight` `[E, H]`
            (and `next_bias`; `next_gate_bias`: that router's own bias), as
            `predict_next` does.
        checked: the caller checked arguments of these shapes, dtypes and devices on an
            earlier call (the runtime's first per layer) and passes the same again: skip
            the checks, ~15 µs of host time per call (a decode step's arguments are fixed
            per model; the checks run once, not per token).
        capped: the row's miss-copy cap (`INSERTS`) may be below top_k (experts_on cpu /
            hybrid). False (experts_on gpu, whose cap is top_k): `use` neither reads the
            cap nor writes the CPU list, its count or the cpu experts counter (they stay
            -1, 0, 0), the same state otherwise; a row with a lower cap must pass True.
    Returns `(weights [1, k] out_dtype, ids [1, k] int64)`; the miss and prefetch copy
    lists are in the state rows.
    """
    op = "decode_step"
    if not checked:
        _check(op, logits, spec, state, layout, layer, n, residual, norm_weight, gate_weight)
        check_launchable(
            op, logits, state, bias, residual, norm_weight, gate_weight, next_bias, next_gate_bias
        )
    k = spec.top_k
    weights = torch.empty(1, k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(1, k, dtype=torch.int64, device=logits.device)
    H = stride_rh = stride_ge = stride_gh = 0  # no prediction: unused by the kernel
    if n:
        assert residual is not None and gate_weight is not None  # _check: n > 0 needs them
        H, stride_rh = residual.shape[1], residual.stride(1)
        stride_ge, stride_gh = gate_weight.stride(0), gate_weight.stride(1)
    cfg = decode_config(
        spec,
        layout,
        H if n else 16,
        n=n,
        has_mask=spec.lam > 0,
        has_bias=bias is not None,
        has_next_bias=next_bias is not None,
        has_next_gate_bias=next_gate_bias is not None,
        capped=bool(capped),
    )
    dummy = logits
    _decode_kernel[(2 if n else 1,)](
        logits_ptr=logits,
        stride_le=logits.stride(1),
        bias_ptr=bias if bias is not None else dummy,
        weights_ptr=weights,
        ids_ptr=ids,
        res_ptr=residual if n else dummy,
        stride_rh=stride_rh,
        norm_ptr=norm_weight if n else dummy,
        eps=float(eps),
        gate_ptr=gate_weight if n else dummy,
        stride_ge=stride_ge,
        stride_gh=stride_gh,
        next_bias_ptr=next_bias if next_bias is not None else dummy,
        next_gbias_ptr=next_gate_bias if next_gate_bias is not None else dummy,
        state_ptr=state,
        layer=layer,
        H=H,
        lam=float(spec.lam),
        scaling=float(spec.scaling),
        norm_min=float(spec.norm_min),
        mixer_eps=float(spec.mixer_eps),
        **cfg,
    )
    return weights, ids


def decode_step_ref(
    logits: torch.Tensor,
    spec: RouteSpec,
    state: torch.Tensor,
    layout: CacheLayout,
    layer: int,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    n: int = 0,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    next_bias: torch.Tensor | None = None,
    checked: bool = False,
    next_gate_bias: torch.Tensor | None = None,
    capped: bool = True,
    use: CacheUse | None = None,
    prefetch: CachePrefetch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `decode_step` (same arguments and results): the routing
    and cache references in the kernel's order, with no host read (`capped=False`: 9 aten
    ops fewer per call). `use`: a function that does what `_flag` of the logits and
    `cache_use_ref` do to the row, bit for bit, in fewer ops (`psr.store.cpu_router`'s
    `cpu_cache_use`: one extension call on the CPU); `prefetch` the same for
    `cache_prefetch_ref` (`cpu_cache_prefetch`); neither while torch.compile traces."""
    op = "decode_step_ref"
    if not checked:
        _check(op, logits, spec, state, layout, layer, n, residual, norm_weight, gate_weight)
    lo, E = layout, layout.num_experts
    mask = state[layer, lo.member : lo.member + E] != 0 if spec.lam > 0 else None
    w, ids, sub = route_counted_ref(
        logits, spec, mask=mask, bias=bias, check_finite=False, checked=checked
    )
    with _no_autograd():  # no tensor made in here leaves this function
        if mask is not None:  # the kernel's count: substituted ids, beside `use`'s counts
            at = lo.header + COUNTS + SUBSTITUTED
            state[layer, at : at + 1].add_(sub)
        if use is None or torch.compiler.is_compiling():
            _flag(state, lo, layer, logits)
            cache_use_ref(state, lo, layer, ids, capped=capped)
        else:
            use(state, lo, layer, ids, capped=capped, logits=logits)
        if n:
            assert residual is not None and norm_weight is not None and gate_weight is not None
            pred, _ = predict_next_ref(
                residual, norm_weight, gate_weight, n, spec, eps=eps, bias=next_bias,
                check_finite=False, gate_bias=next_gate_bias,
            )  # fmt: skip
            _flag(state, lo, layer + 1, residual)
            if prefetch is None or torch.compiler.is_compiling():
                cache_prefetch_ref(state, lo, layer + 1, pred, n)
            else:
                prefetch(state, lo, layer + 1, pred, n)
    return w.to(out_dtype), ids


def _no_autograd() -> contextlib.AbstractContextManager[None]:
    """Inference mode in eager code: it spares the reference's many small ops autograd's
    per-op bookkeeping (about 15% of their time on the CPU). Not under torch.compile,
    whose inductor cannot take inference tensors (psr.runtime.graphs compiles the step)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else torch.inference_mode()


def _flag(state: torch.Tensor, layout: CacheLayout, layer: int, x: torch.Tensor) -> None:
    """The row's non-finite flag |= any(not finite(x)), as tensor ops: x - x is 0 where
    x is finite and NaN elsewhere, so its sum is NaN (unequal to itself) exactly when some
    x is not finite (three cheap ops; `isfinite` alone is four)."""
    s = (x - x).sum()
    at = layout.header + FLAG
    state[layer, at : at + 1].bitwise_or_(s != s)
