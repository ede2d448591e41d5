"""Cache-biased top-k MoE routing, and next-layer expert prediction.

One Triton kernel, `_route_kernel`, serves three ops. Per token row it
  1. gets router logits: loaded (`route`), or computed in-kernel from the hidden
     state and the router weight, the batch-1 GEMV (`FROM_HIDDEN`: `route_hidden`),
     after an RMS norm (`HAS_NORM`: `predict_next`);
  2. forms the model's selection scores z (`IS_SOFTMAX` / `IS_TOPK_SOFTMAX`: the
     logits; `IS_SIGMOID`: sigmoid(logits) + e_score_correction_bias, `HAS_BIAS`);
  3. biases them toward cached experts (`HAS_MASK`): z' = z + lam * D * m,
     D = max(z) - min(z) over the row;
  4. applies the group limit (DeepSeek-V3, `N_GROUP > 1`: keep the `TOPK_GROUP`
     groups with the largest sum of their top-2 scores), then takes the top-k of
     z', ties to the lower expert id;
  5. computes gate weights from the *unbiased* scores, normalised as the model does
     (`RENORM`; softmax over the chosen logits for `IS_TOPK_SOFTMAX`), and stores the
     cache membership of each choice (`STORE_INCACHE`) and the logits (`STORE_LOGITS`).

The flags are `tl.constexpr`, so each combination compiles to its own specialised
kernel. Wrappers describe the routing with a `RouteSpec` (no tensors) and launch
through `_launch` by keyword; `route_kernel_config` gives every compile-time argument
of a launch (the spec's flags, the tensors' flags, and the block sizes of
`route_launch_config`).

`lam = 0` is the model's own routing. Every `*_ref` function is the plain-torch
reference the kernel is tested against, and the CPU path of `kernel_ops` and the
torch ops. References return contiguous tensors, like the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from psr_kernels._common import check_finite as _require_finite
from psr_kernels._common import check_float, check_launchable, pow2

SCORINGS = ("softmax", "topk_softmax", "sigmoid")
_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- kernel


@triton.jit
def _gemv_rows(
    x_ptr,
    stride_xt,
    stride_xh,
    w_ptr,
    stride_we,
    stride_wh,
    rows,
    cols,
    T,
    E,
    H,
    inv_rms,
    norm_ptr,
    HAS_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """[BLOCK_T, BLOCK_E] fp32 logits = (x * inv_rms * norm_w) @ W^T, H in BLOCK_H chunks."""
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hm = hs < H
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + hs[None, :] * stride_xh,
            mask=(rows[:, None] < T) & hm[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_NORM:
            nw = tl.load(norm_ptr + hs, mask=hm, other=0.0).to(tl.float32)
            x = x * inv_rms[:, None] * nw[None, :]
        w = tl.load(
            w_ptr + cols[:, None] * stride_we + hs[None, :] * stride_wh,
            mask=(cols[:, None] < E) & hm[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _route_kernel(
    # inputs
    x_ptr,  # router logits [T, E], or the hidden state [T, H] (FROM_HIDDEN)
    stride_xt,
    stride_xh,
    gate_ptr,  # router weight [E, H] (FROM_HIDDEN)
    stride_ge,
    stride_gh,
    norm_ptr,  # RMS-norm weight [H] (HAS_NORM)
    eps,
    mask_ptr,  # cache mask [T or 1, E] viewed as uint8 (HAS_MASK)
    stride_mt,  # 0 for a mask broadcast over tokens
    stride_me,
    bias_ptr,  # e_score_correction_bias [E] (HAS_BIAS)
    # outputs
    weights_ptr,  # [T, K] fp32
    ids_ptr,  # [T, K] int32 or int64
    stride_ot,
    logits_ptr,  # [T, E] fp32, contiguous (STORE_LOGITS)
    incache_ptr,  # [T, K] uint8 (STORE_INCACHE)
    # sizes and scalars
    T,
    E,
    H,
    lam,
    scaling,
    K: tl.constexpr,
    FROM_HIDDEN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    IS_SOFTMAX: tl.constexpr,
    IS_TOPK_SOFTMAX: tl.constexpr,
    IS_SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    STORE_INCACHE: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NG_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tl.static_assert(IS_SOFTMAX + IS_TOPK_SOFTMAX + IS_SIGMOID == 1, "one scoring")
    tl.static_assert(FROM_HIDDEN or not (HAS_NORM or STORE_LOGITS), "norm/logits need hidden")
    tl.static_assert(HAS_MASK or not STORE_INCACHE, "in-cache flags need a mask")
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
    neg_inf = float("-inf")

    # 1. router logits, fp32
    if FROM_HIDDEN:
        inv_rms = tl.zeros([BLOCK_T], dtype=tl.float32)
        if HAS_NORM:
            ss = tl.zeros([BLOCK_T], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                hs = h0 + tl.arange(0, BLOCK_H)
                xv = tl.load(
                    x_ptr + rows[:, None] * stride_xt + hs[None, :] * stride_xh,
                    mask=rmask[:, None] & (hs[None, :] < H),
                    other=0.0,
                ).to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
            inv_rms = 1.0 / tl.sqrt(ss / H + eps)
        x = _gemv_rows(
            x_ptr,
            stride_xt,
            stride_xh,
            gate_ptr,
            stride_ge,
            stride_gh,
            rows,
            cols,
            T,
            E,
            H,
            inv_rms,
            norm_ptr,
            HAS_NORM,
            BLOCK_T,
            BLOCK_E,
            BLOCK_H,
        )
        if STORE_LOGITS:
            tl.store(logits_ptr + rows[:, None] * E + cols[None, :], x, mask=m2)
    else:
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh, mask=m2, other=0.0
        ).to(tl.float32)

    # 2. selection scores z and the weight source
    if IS_SIGMOID:
        src = 1.0 / (1.0 + tl.exp(-x))
        z = src
        if HAS_BIAS:
            z = z + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    else:
        z = x
        if IS_SOFTMAX:
            xm = tl.where(cmask[None, :], x, neg_inf)
            ex = tl.exp(xm - tl.max(xm, axis=1)[:, None])
            src = ex / tl.sum(ex, axis=1)[:, None]
        else:
            src = x

    # 3. bias toward the cache: z' = z + lam * D * m
    if HAS_MASK:
        mk = tl.load(
            mask_ptr + rows[:, None] * stride_mt + cols[None, :] * stride_me, mask=m2, other=0
        ).to(tl.float32)
        spread = tl.max(tl.where(cmask[None, :], z, neg_inf), axis=1) - tl.min(
            tl.where(cmask[None, :], z, float("inf")), axis=1
        )
        z = z + lam * spread[:, None] * mk
    sel = tl.where(cmask[None, :], z, neg_inf)

    # 4a. group limit: keep the TOPK_GROUP groups with the largest top-2 sums
    if N_GROUP > 1:
        gsize = E // N_GROUP
        gid = cols // gsize
        gar = tl.arange(0, NG_P2)
        gscore = tl.full([BLOCK_T, NG_P2], neg_inf, dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            v = tl.where((gid == g)[None, :], sel, neg_inf)
            a1 = tl.max(v, axis=1)
            i1 = tl.min(tl.where(v == a1[:, None], cols[None, :], BLOCK_E), axis=1)
            a2 = tl.max(tl.where(cols[None, :] == i1[:, None], neg_inf, v), axis=1)
            gscore = tl.where(gar[None, :] == g, (a1 + a2)[:, None], gscore)
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            gm = tl.max(gscore, axis=1)
            gi = tl.min(tl.where(gscore == gm[:, None], gar[None, :], NG_P2), axis=1)
            keep = keep | (gid[None, :] == gi[:, None])
            gscore = tl.where(gar[None, :] == gi[:, None], neg_inf, gscore)
        sel = tl.where(keep, sel, neg_inf)

    # 4b. top-k, ties to the lower id; gather weight source and cache flags
    kar = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    val = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    inc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        ids = tl.where(kar[None, :] == j, idx[:, None], ids)
        val = tl.where(kar[None, :] == j, tl.sum(tl.where(hit, src, 0.0), axis=1)[:, None], val)
        if STORE_INCACHE:
            inc = tl.where(kar[None, :] == j, tl.sum(tl.where(hit, mk, 0.0), axis=1)[:, None], inc)
        sel = tl.where(hit, neg_inf, sel)

    # 5. gate weights from the unbiased scores
    kvalid = kar[None, :] < K
    if IS_TOPK_SOFTMAX:
        vm = tl.where(kvalid, val, neg_inf)
        ev = tl.exp(vm - tl.max(vm, axis=1)[:, None])
        w = ev / tl.sum(ev, axis=1)[:, None]
    else:
        w = tl.where(kvalid, val, 0.0)
        if RENORM:
            denom = tl.sum(w, axis=1)
            if IS_SIGMOID:
                denom = denom + 1e-20
            w = w / denom[:, None]
    w = w * scaling

    om = rmask[:, None] & kvalid
    tl.store(weights_ptr + rows[:, None] * stride_ot + kar[None, :], w, mask=om)
    tl.store(ids_ptr + rows[:, None] * stride_ot + kar[None, :], ids, mask=om)
    if STORE_INCACHE:
        tl.store(incache_ptr + rows[:, None] * stride_ot + kar[None, :], inc.to(tl.uint8), mask=om)


# --------------------------------------------------------------------------- spec and checks


@dataclass(frozen=True)
class RouteSpec:
    """How to route, without the tensors: the router's semantics and the cache bias.

    `top_k` experts per token (for `predict_next`: the `n` predictions), `lam` the bias
    strength, `scoring` one of `SCORINGS`, `renormalize` (`norm_topk_prob`), the group
    limit `n_group` / `topk_group` (DeepSeek-V3; `n_group = 1` is none) and `scaling`
    (`routed_scaling_factor`). `check` validates it against a problem; `constexprs`
    gives the kernel's compile-time flags that follow from it.
    """

    top_k: int
    lam: float = 0.0
    scoring: str = "softmax"
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0

    def check(
        self,
        op: str,
        *,
        num_experts: int,
        num_tokens: int,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        k_name: str = "top_k",
    ) -> None:
        """Raise TypeError/ValueError, naming `op`, unless the spec fits the problem."""
        E, T, top_k = num_experts, num_tokens, self.top_k
        if self.scoring not in SCORINGS:
            raise ValueError(f"{op}: unknown scoring {self.scoring!r}; expected one of {SCORINGS}")
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"{op}: {k_name} must be an int, got {type(top_k).__name__}")
        if not 1 <= top_k <= E:
            raise ValueError(f"{op}: {k_name}={top_k} must be in [1, num_experts={E}]")
        lam = self.lam
        if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
            raise ValueError(f"{op}: lam must be a finite number >= 0, got {lam!r}")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise TypeError(f"{op}: mask must be a bool tensor, got {got}")
            if tuple(mask.shape) not in ((E,), (T, E), (1, E)):
                raise ValueError(
                    f"{op}: mask must have shape [{E}] or [{T}, {E}], got {list(mask.shape)}"
                )
        if bias is not None:
            if self.scoring != "sigmoid":
                raise ValueError(f"{op}: bias (e_score_correction_bias) needs scoring='sigmoid'")
            check_float(op, "bias", bias, 1)
            if bias.shape[0] != E:
                raise ValueError(f"{op}: bias must have shape [{E}], got {list(bias.shape)}")
        n_group, topk_group = self.n_group, self.topk_group
        if n_group < 1 or E % n_group:
            raise ValueError(f"{op}: n_group={n_group} must divide num_experts={E}")
        if n_group > 1:
            if E // n_group < 2:
                raise ValueError(f"{op}: groups need at least 2 experts (E={E}, n_group={n_group})")
            if not 1 <= topk_group <= n_group:
                raise ValueError(f"{op}: topk_group={topk_group} must be in [1, n_group={n_group}]")
            if top_k > topk_group * (E // n_group):
                raise ValueError(
                    f"{op}: {k_name}={top_k} exceeds the {topk_group * (E // n_group)} "
                    f"experts of the {topk_group} selected groups"
                )

    def constexprs(self) -> dict[str, int | bool]:
        """The kernel's compile-time flags that follow from the spec alone."""
        n_group = max(1, self.n_group)
        return dict(
            K=self.top_k,
            IS_SOFTMAX=self.scoring == "softmax",
            IS_TOPK_SOFTMAX=self.scoring == "topk_softmax",
            IS_SIGMOID=self.scoring == "sigmoid",
            RENORM=bool(self.renormalize),
            N_GROUP=n_group,
            TOPK_GROUP=self.topk_group if n_group > 1 else 1,
            NG_P2=pow2(n_group, 2),
        )


def _mask_2d(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else (mask if mask.dim() == 2 else mask[None, :])


def _check_gemv(op: str, hidden: torch.Tensor, gate_weight: torch.Tensor) -> tuple[int, int, int]:
    check_float(op, "hidden", hidden, 2)
    check_float(op, "gate_weight", gate_weight, 2)
    T, H = hidden.shape
    E, Hg = gate_weight.shape
    if Hg != H:
        raise ValueError(f"{op}: gate_weight is [{E}, {Hg}] but hidden size is {H}")
    return T, H, E


def _check_predict(
    op: str,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    n: int,
    *,
    mask: torch.Tensor | None,
    scoring: str,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    check_finite: bool,
) -> tuple[int, RouteSpec]:
    """Shared argument checks of predict_next and its reference; returns (T, spec).

    The spec is unbiased (lam 0), unnormalised, and has `top_k = max(n, 1)`.
    """
    T, H, E = _check_gemv(op, residual, gate_weight)
    check_float(op, "norm_weight", norm_weight, 1)
    if norm_weight.shape[0] != H:
        raise ValueError(
            f"{op}: norm_weight has {norm_weight.shape[0]} elements, hidden size is {H}"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{op}: n must be an int >= 0, got {n!r}")
    spec = RouteSpec(top_k=max(n, 1), scoring=scoring, n_group=n_group, topk_group=topk_group)
    spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias, k_name="n")
    if check_finite and n > 0:
        _require_finite(op, "residual", residual)
    return T, spec


# --------------------------------------------------------------------------- launch


def route_launch_config(
    num_tokens: int, num_experts: int, top_k: int, *, hidden_size: int | None = None
) -> dict[str, int]:
    """Block sizes and warps of `_route_kernel` for a problem.

    `hidden_size` is given when the kernel computes the logits (`FROM_HIDDEN`). No
    autotuning: the same choice under the interpreter and on a GPU.
    """
    BLOCK_E = pow2(num_experts, 16)
    BLOCK_T = min(pow2(num_tokens), 16)
    BLOCK_H = 0
    if hidden_size is not None:
        # Keep the [BLOCK_T, BLOCK_E, BLOCK_H] product tile near 8K elements.
        BLOCK_T = min(BLOCK_T, 4)
        BLOCK_H = max(16, min(pow2(hidden_size), 8192 // (BLOCK_T * BLOCK_E)))
    return dict(
        BLOCK_T=BLOCK_T,
        BLOCK_E=BLOCK_E,
        BLOCK_H=BLOCK_H,
        BLOCK_K=pow2(top_k, 2),
        num_warps=4 if BLOCK_E * BLOCK_T <= 1024 else 8,
    )


def route_kernel_config(
    spec: RouteSpec,
    *,
    num_tokens: int,
    num_experts: int,
    hidden_size: int | None = None,
    has_norm: bool = False,
    has_mask: bool = False,
    has_bias: bool = False,
    store_logits: bool = False,
    store_incache: bool = False,
) -> dict[str, int | bool]:
    """Every compile-time argument of `_route_kernel` for one launch, and `num_warps`.

    `hidden_size` is given when the kernel computes the logits (`FROM_HIDDEN`). The
    wrappers launch with exactly this, and the GPU compile test compiles it.
    """
    return dict(
        FROM_HIDDEN=hidden_size is not None,
        HAS_NORM=has_norm,
        HAS_MASK=has_mask,
        HAS_BIAS=has_bias,
        STORE_LOGITS=store_logits,
        STORE_INCACHE=store_incache and has_mask,
        **spec.constexprs(),
        **route_launch_config(num_tokens, num_experts, spec.top_k, hidden_size=hidden_size),
    )


class _Routed(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32
    ids: torch.Tensor  # [T, k] ids_dtype
    logits: torch.Tensor  # [T, E] fp32 when store_logits, else [0, E]
    in_cache: torch.Tensor  # [T, k] bool (all False unless store_incache and a mask)


def _launch(
    spec: RouteSpec,
    x: torch.Tensor,
    *,
    num_experts: int,
    gate_weight: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    store_logits: bool = False,
    store_incache: bool = False,
) -> _Routed:
    """Run `_route_kernel` on checked arguments.

    `x` is the logits `[T, E]`, or the hidden state `[T, H]` when `gate_weight` is given
    (then `norm_weight` adds the RMS norm). Outputs are fresh contiguous tensors.
    """
    from_hidden = gate_weight is not None
    T, E = x.shape[0], num_experts
    H = x.shape[1] if from_hidden else 0
    dev = x.device
    weights = torch.empty(T, spec.top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, spec.top_k, dtype=ids_dtype, device=dev)
    logits = torch.empty(T if store_logits else 0, E, dtype=torch.float32, device=dev)
    incache = torch.zeros(T, spec.top_k, dtype=torch.uint8, device=dev)
    if T == 0:
        return _Routed(weights, ids, logits, incache.bool())
    m = _mask_2d(mask)
    cfg = route_kernel_config(
        spec,
        num_tokens=T,
        num_experts=E,
        hidden_size=H if from_hidden else None,
        has_norm=norm_weight is not None,
        has_mask=m is not None,
        has_bias=bias is not None,
        store_logits=store_logits,
        store_incache=store_incache,
    )
    dummy = weights  # stands in for absent tensors; never read (its flag is off)
    _route_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
        x_ptr=x,
        stride_xt=x.stride(0),
        stride_xh=x.stride(1),
        gate_ptr=gate_weight if from_hidden else dummy,
        stride_ge=gate_weight.stride(0) if from_hidden else 0,
        stride_gh=gate_weight.stride(1) if from_hidden else 0,
        norm_ptr=norm_weight if norm_weight is not None else dummy,
        eps=float(eps),
        mask_ptr=m.view(torch.uint8) if m is not None else incache,
        # A broadcast [1, E] mask uses row stride 0.
        stride_mt=0 if m is None or m.shape[0] == 1 else m.stride(0),
        stride_me=m.stride(1) if m is not None else 0,
        bias_ptr=bias if bias is not None else dummy,
        weights_ptr=weights,
        ids_ptr=ids,
        stride_ot=spec.top_k,
        logits_ptr=logits if store_logits else dummy,
        incache_ptr=incache,
        T=T,
        E=E,
        H=H,
        lam=float(spec.lam),
        scaling=float(spec.scaling),
        **cfg,
    )
    return _Routed(weights, ids, logits, incache.bool())


# --------------------------------------------------------------------------- ops


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    mask: torch.Tensor | None = None,
    lam: float = 0.0,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache-biased top-k routing from router logits.

    Args:
        logits: `[T, E]` router logits (fp32/bf16/fp16), any strides.
        top_k: experts per token, `1 <= top_k <= E`.
        mask: bool `[E]`, `[1, E]` or `[T, E]`: True where the expert is in the
            layer's cache.
        lam: bias strength; `0` is the model's exact routing.
        scoring: 'softmax' (OLMoE, Qwen-MoE, Mixtral), 'topk_softmax' (softmax over
            the chosen logits), 'sigmoid' (DeepSeek-V3 / Moonlight).
        renormalize: divide the k weights by their sum (`norm_topk_prob`; Mixtral: True).
        bias: `[E]` e_score_correction_bias (sigmoid scoring), added for selection only.
        n_group, topk_group: group-limited top-k (DeepSeek-V3).
        scaling: routed_scaling_factor applied to the final weights.
        ids_dtype: dtype of the returned ids (int64 or int32).
        check_finite: raise ValueError on NaN/inf logits (a host sync). Without it,
            NaN scores never compare greater, so the ids are unspecified garbage.

    Returns:
        `(weights [T, k] fp32, ids [T, k] ids_dtype)`, contiguous, ids ordered by
        biased score.
    """
    op = "route"
    check_float(op, "logits", logits, 2)
    T, E = logits.shape
    spec = RouteSpec(top_k, lam, scoring, renormalize, n_group, topk_group, scaling)
    spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias)
    check_launchable(op, logits, mask, bias)
    if check_finite:
        _require_finite(op, "logits", logits)
    out = _launch(spec, logits, num_experts=E, mask=mask, bias=bias, ids_dtype=ids_dtype)
    return out.weights, out.ids


def route_hidden(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    *,
    mask: torch.Tensor | None = None,
    lam: float = 0.0,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route` fused with the router GEMV: logits = hidden @ gate_weight^T in fp32.

    `hidden` is `[T, H]`, `gate_weight` the router weight `[E, H]`; the other arguments
    are `route`'s (`check_finite` checks `hidden`).

    Returns `(weights [T, k] fp32, ids [T, k], logits [T, E] fp32)`, contiguous.
    """
    op = "route_hidden"
    T, _, E = _check_gemv(op, hidden, gate_weight)
    spec = RouteSpec(top_k, lam, scoring, renormalize, n_group, topk_group, scaling)
    spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias)
    check_launchable(op, hidden, gate_weight, mask, bias)
    if check_finite:
        _require_finite(op, "hidden", hidden)
    out = _launch(
        spec,
        hidden,
        num_experts=E,
        gate_weight=gate_weight,
        mask=mask,
        bias=bias,
        ids_dtype=ids_dtype,
        store_logits=True,
    )
    return out.weights, out.ids, out.logits


def _no_prediction(
    T: int, ids_dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(T, 0, dtype=ids_dtype, device=device),
        torch.empty(T, 0, dtype=torch.bool, device=device),
    )


def predict_next(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    n: int,
    *,
    mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    scoring: str = "softmax",
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predict the next MoE layer's experts (the spec's `prefetch` rule), in one kernel.

    RMS-norms `residual` (the hidden state entering this layer's MoE block) with the
    next layer's norm weight, scores it with the next layer's router (unbiased) and
    returns the first `n` ids of that layer's exact routing order (group-limited
    where the model is; ties to the lower id), and whether `mask` (the next
    layer's logical cache) holds each.

    Returns `(ids [T, n], in_cache [T, n] bool)`, contiguous; in_cache is all False
    without a mask.
    """
    op = "predict_next"
    T, spec = _check_predict(
        op,
        residual,
        norm_weight,
        gate_weight,
        n,
        mask=mask,
        scoring=scoring,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        check_finite=check_finite,
    )
    dev = check_launchable(op, residual, norm_weight, gate_weight, mask, bias)
    if n == 0:
        return _no_prediction(T, ids_dtype, dev)
    out = _launch(
        spec,
        residual,
        num_experts=gate_weight.shape[0],
        gate_weight=gate_weight,
        norm_weight=norm_weight,
        eps=eps,
        mask=mask,
        bias=bias,
        ids_dtype=ids_dtype,
        store_incache=True,
    )
    return out.ids, out.in_cache


# --------------------------------------------------------------------------- references


def _scores_ref(
    logits: torch.Tensor, scoring: str, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(selection scores z, weight source) in fp32."""
    x = logits.float()
    if scoring == "sigmoid":
        s = torch.sigmoid(x)
        return (s + bias.float() if bias is not None else s), s
    if scoring == "softmax":
        return x, torch.softmax(x, dim=-1)
    return x, x


def _group_limit_ref(sel: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    if n_group <= 1:
        return sel
    T, E = sel.shape
    top2 = sel.view(T, n_group, E // n_group).sort(dim=-1, descending=True).values[..., :2]
    gscore = top2.sum(-1)
    order = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=sel.device)
    keep.scatter_(1, order, True)
    return sel.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), _NEG_INF)


def _topk_ref(sel: torch.Tensor, k: int) -> torch.Tensor:
    # Stable descending sort: equal scores keep ascending id order (ties to the lower id).
    # The slice is a strided view; the ops' outputs are contiguous (their fakes say so).
    return torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def gate_weights_ref(
    src: torch.Tensor, ids: torch.Tensor, scoring: str, renormalize: bool, scaling: float
) -> torch.Tensor:
    """Gate weights of chosen `ids` from the unbiased weight source, normalised as the
    model does (top-k softmax, `norm_topk_prob`, `routed_scaling_factor`)."""
    val = src.gather(1, ids)
    if scoring == "topk_softmax":
        w = torch.softmax(val, dim=-1)
    else:
        w = val
        if renormalize:
            denom = w.sum(-1, keepdim=True)
            w = w / (denom + 1e-20 if scoring == "sigmoid" else denom)
    return (w * scaling).contiguous()


def biased_scores_ref(z: torch.Tensor, mask: torch.Tensor | None, lam: float) -> torch.Tensor:
    """z' = z + lam * D * m with D the per-row spread of z."""
    if mask is None:
        return z
    spread = z.max(dim=-1).values - z.min(dim=-1).values
    return z + lam * spread[:, None] * _mask_2d(mask).float()


def route_ref(
    logits: torch.Tensor,
    top_k: int,
    *,
    mask: torch.Tensor | None = None,
    lam: float = 0.0,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `route` (same arguments, same results)."""
    op = "route_ref"
    check_float(op, "logits", logits, 2)
    T, E = logits.shape
    spec = RouteSpec(top_k, lam, scoring, renormalize, n_group, topk_group, scaling)
    spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias)
    if check_finite:
        _require_finite(op, "logits", logits)
    z, src = _scores_ref(logits, scoring, bias)
    sel = _group_limit_ref(biased_scores_ref(z, mask, lam), n_group, topk_group)
    ids = _topk_ref(sel, top_k)
    w = gate_weights_ref(src, ids, scoring, renormalize, scaling)
    return w, ids.to(ids_dtype).contiguous()


def route_hidden_ref(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    *,
    mask: torch.Tensor | None = None,
    lam: float = 0.0,
    scoring: str = "softmax",
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `route_hidden` (`check_finite` checks the logits)."""
    _check_gemv("route_hidden_ref", hidden, gate_weight)
    logits = hidden.float() @ gate_weight.float().t()
    w, ids = route_ref(
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
        ids_dtype=ids_dtype,
        check_finite=check_finite,
    )
    return w, ids, logits.contiguous()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMS norm over the last dim: x * rsqrt(mean(x^2) + eps) * weight."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def predict_next_ref(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    n: int,
    *,
    mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    scoring: str = "softmax",
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `predict_next`."""
    op = "predict_next_ref"
    T, _ = _check_predict(
        op,
        residual,
        norm_weight,
        gate_weight,
        n,
        mask=mask,
        scoring=scoring,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        check_finite=check_finite,
    )
    if n == 0:
        return _no_prediction(T, ids_dtype, residual.device)
    E = gate_weight.shape[0]
    logits = rms_norm_ref(residual, norm_weight, eps) @ gate_weight.float().t()
    z, _ = _scores_ref(logits, scoring, bias)
    ids = _topk_ref(_group_limit_ref(z, n_group, topk_group), n)
    if mask is None:
        incache = torch.zeros_like(ids, dtype=torch.bool)
    else:
        incache = _mask_2d(mask).expand(T, E).gather(1, ids)
    return ids.to(ids_dtype).contiguous(), incache.contiguous()
