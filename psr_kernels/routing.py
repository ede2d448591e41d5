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
kernel. A `RouteSpec` (no tensors, frozen) says how to route: the ops take one, and
launch through `_launch` by keyword; `route_kernel_config` gives every compile-time
argument of a launch (the spec's flags, the tensors' flags, and the block sizes of
`route_launch_config`), computed once per shape and cached.

`lam = 0` is the model's own routing. The plain-torch references the kernel is tested
against, and the CPU path of `kernel_ops` and the torch ops, are in `routing_ref`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, overload

import torch
import triton
import triton.language as tl

from psr_kernels._common import check_finite as _require_finite
from psr_kernels._common import check_float, check_launchable, pow2

SCORINGS = ("softmax", "topk_softmax", "sigmoid", "sparsemixer", "topk_sigmoid")
# How a group-limited router scores a group: the sum of its top two scores (DeepSeek-V3,
# GLM-4.5, dots1) or its maximum (DeepSeek-V2's `group_limited_greedy`).
GROUP_SCORES = ("top2", "max")
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
def router_logits(
    x_ptr,
    stride_xt,
    stride_xh,
    gate_ptr,
    stride_ge,
    stride_gh,
    norm_ptr,
    eps,
    gbias_ptr,
    rows,
    cols,
    T,
    E,
    H,
    FROM_HIDDEN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Stage 1: the [BLOCK_T, BLOCK_E] fp32 router logits of `rows`: loaded (x is the
    logits), or the GEMV of the hidden state x with the router weight (`FROM_HIDDEN`),
    after an RMS norm (`HAS_NORM`), plus the router's own bias (`HAS_GATE_BIAS`: gpt-oss)."""
    rmask = rows < T
    cmask = cols < E
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
        if HAS_GATE_BIAS:
            x += tl.load(gbias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    else:
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh,
            mask=rmask[:, None] & cmask[None, :],
            other=0.0,
        ).to(tl.float32)
    return x


@triton.jit
def _group_limit(
    sel,
    cols,
    E,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_MAX: tl.constexpr,
    NG_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """`sel` outside the TOPK_GROUP groups with the largest top-2 sums (DeepSeek-V3) or,
    GROUP_MAX, the largest maxima (DeepSeek-V2's group_limited_greedy) set to -inf."""
    neg_inf = float("-inf")
    gsize = E // N_GROUP
    gid = cols // gsize
    gar = tl.arange(0, NG_P2)
    gscore = tl.full([BLOCK_T, NG_P2], neg_inf, dtype=tl.float32)
    for g in tl.static_range(N_GROUP):
        v = tl.where((gid == g)[None, :], sel, neg_inf)
        a1 = tl.max(v, axis=1)
        if GROUP_MAX:
            gs = a1
        else:
            i1 = tl.min(tl.where(v == a1[:, None], cols[None, :], BLOCK_E), axis=1)
            gs = a1 + tl.max(tl.where(cols[None, :] == i1[:, None], neg_inf, v), axis=1)
        gscore = tl.where(gar[None, :] == g, gs[:, None], gscore)
    keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        gm = tl.max(gscore, axis=1)
        gi = tl.min(tl.where(gscore == gm[:, None], gar[None, :], NG_P2), axis=1)
        keep = keep | (gid[None, :] == gi[:, None])
        gscore = tl.where(gar[None, :] == gi[:, None], neg_inf, gscore)
    return tl.where(keep, sel, neg_inf)


@triton.jit
def _sparsemixer_weights(
    x,
    ids,
    val,
    cols,
    cmask,
    kar,
    eps,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """PhiMoE's sparsemixer weights (eval): for the j-th chosen expert, of logit c, the
    softmax at c over the experts not masked by (c - x) / max(|x|, c) > 2 eps, the earlier
    choices excluded."""
    neg_inf = float("-inf")
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        c = tl.sum(tl.where(kar[None, :] == j, val, 0.0), axis=1)
        factor = tl.maximum(tl.abs(x), c[:, None])
        allowed = cmask[None, :] & (((c[:, None] - x) / factor > 2.0 * eps) == 0)
        for i in tl.static_range(j):
            prev = tl.sum(tl.where(kar[None, :] == i, ids, 0), axis=1)
            allowed = allowed & (cols[None, :] != prev[:, None])
        mx = tl.max(tl.where(allowed, x, neg_inf), axis=1)
        den = tl.sum(tl.where(allowed, tl.exp(x - mx[:, None]), 0.0), axis=1)
        w = tl.where(kar[None, :] == j, (tl.exp(c - mx) / den)[:, None], w)
    return w


@triton.jit
def _gate_weights(
    x, ids, val, cols, cmask, kar, scaling, norm_min, mixer_eps, K: tl.constexpr,
    IS_TOPK_SOFTMAX: tl.constexpr, IS_SIGMOID: tl.constexpr, IS_SPARSEMIXER: tl.constexpr,
    IS_TOPK_SIGMOID: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Stage 5: the chosen experts' gate weights from their unbiased scores `val`, as the
    model normalises them."""
    neg_inf = float("-inf")
    kvalid = kar[None, :] < K
    if IS_SPARSEMIXER:
        w = _sparsemixer_weights(x, ids, val, cols, cmask, kar, mixer_eps, K, BLOCK_T, BLOCK_K)
    elif IS_TOPK_SIGMOID:  # Llama 4: top-k of the logits, each weight sigmoid(its logit)
        w = tl.where(kvalid, 1.0 / (1.0 + tl.exp(-val)), 0.0)
    elif IS_TOPK_SOFTMAX:
        vm = tl.where(kvalid, val, neg_inf)
        ev = tl.exp(vm - tl.max(vm, axis=1)[:, None])
        w = ev / tl.sum(ev, axis=1)[:, None]
    else:
        w = tl.where(kvalid, val, 0.0)
        if RENORM:
            denom = tl.sum(w, axis=1)
            if IS_SIGMOID:
                denom = denom + 1e-20
            # ERNIE's moe_norm_min (0 elsewhere: a no-op on the positive sums)
            denom = tl.maximum(denom, norm_min)
            w = w / denom[:, None]
    w = w * scaling
    return w


@triton.jit
def _overlap_exact(
    z0, chosen, cols, cmask, E, K: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, GROUP_MAX: tl.constexpr, NG_P2: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Per row, how many `chosen` ids are in the exact top-K of the unbiased scores `z0`
    (the same group limit and tie rule as the biased top-K)."""
    neg_inf = float("-inf")
    sel = tl.where(cmask[None, :], z0, neg_inf)
    if N_GROUP > 1:
        sel = _group_limit(sel, cols, E, N_GROUP, TOPK_GROUP, GROUP_MAX, NG_P2, BLOCK_T, BLOCK_E)
    exact = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
    for _ in tl.static_range(K):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        exact = exact | hit
        sel = tl.where(hit, neg_inf, sel)
    return tl.sum((exact & chosen).to(tl.int32), axis=1)


@triton.jit
def select_experts(
    x,  # [BLOCK_T, BLOCK_E] fp32 router logits
    mk,  # [BLOCK_T, BLOCK_E] fp32 cache membership (1.0 / 0.0), read when HAS_MASK
    bias_ptr,
    lam,
    scaling,
    norm_min,
    mixer_eps,
    cols,
    E,
    K: tl.constexpr,
    IS_SOFTMAX: tl.constexpr,
    IS_TOPK_SOFTMAX: tl.constexpr,
    IS_SIGMOID: tl.constexpr,
    IS_SPARSEMIXER: tl.constexpr,
    IS_TOPK_SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WITH_INCACHE: tl.constexpr,
    WITH_SUBST: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_MAX: tl.constexpr,
    NG_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Stages 2-5 on a logits tile: selection scores, the cache bias, the group limit,
    top-K (ties to the lower id) and the gate weights from the unbiased scores.
    Returns (ids [BLOCK_T, BLOCK_K] int32, weights [BLOCK_T, BLOCK_K] fp32, in-cache
    flags of the choices (WITH_INCACHE), chosen [BLOCK_T, BLOCK_E] int1, substituted
    [BLOCK_T] int32: how many chosen ids are not in the exact top-K of the same scores
    without the cache bias (WITH_SUBST with HAS_MASK; 0 otherwise, as without a bias
    nothing is substituted))."""
    cmask = cols < E
    neg_inf = float("-inf")
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
            if HAS_BIAS:  # ERNIE: selection on the probabilities plus the correction bias
                z = src + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        else:
            src = x

    # 3. bias toward the cache: z' = z + lam * D * m
    z0 = z  # the unbiased scores: the exact top-k, for the substitution count
    if HAS_MASK:
        spread = tl.max(tl.where(cmask[None, :], z, neg_inf), axis=1) - tl.min(
            tl.where(cmask[None, :], z, float("inf")), axis=1
        )
        z = z + lam * spread[:, None] * mk
    sel = tl.where(cmask[None, :], z, neg_inf)

    # 4a. group limit (DeepSeek-style routers)
    if N_GROUP > 1:
        sel = _group_limit(sel, cols, E, N_GROUP, TOPK_GROUP, GROUP_MAX, NG_P2, BLOCK_T, BLOCK_E)

    # 4b. top-k, ties to the lower id; gather weight source and cache flags
    kar = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    val = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    inc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    chosen = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
    for j in tl.static_range(K):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        chosen = chosen | hit
        ids = tl.where(kar[None, :] == j, idx[:, None], ids)
        val = tl.where(kar[None, :] == j, tl.sum(tl.where(hit, src, 0.0), axis=1)[:, None], val)
        if WITH_INCACHE:
            inc = tl.where(kar[None, :] == j, tl.sum(tl.where(hit, mk, 0.0), axis=1)[:, None], inc)
        sel = tl.where(hit, neg_inf, sel)
    nsub = tl.zeros([BLOCK_T], dtype=tl.int32)
    if WITH_SUBST and HAS_MASK:
        nsub = K - _overlap_exact(z0, chosen, cols, cmask, E, K, N_GROUP, TOPK_GROUP, GROUP_MAX,
                                  NG_P2, BLOCK_T, BLOCK_E)  # fmt: skip

    # 5. gate weights from the unbiased scores
    w = _gate_weights(
        x, ids, val, cols, cmask, kar, scaling, norm_min, mixer_eps, K, IS_TOPK_SOFTMAX,
        IS_SIGMOID, IS_SPARSEMIXER, IS_TOPK_SIGMOID, RENORM, BLOCK_T, BLOCK_K,
    )  # fmt: skip
    return ids, w, inc, chosen, nsub


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
    gbias_ptr,  # the router's bias [E] (HAS_GATE_BIAS)
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
    subst_ptr,  # [T] int32: substituted ids per row (STORE_SUBST)
    # sizes and scalars
    T,
    E,
    H,
    lam,
    scaling,
    norm_min,
    mixer_eps,
    K: tl.constexpr,
    FROM_HIDDEN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    IS_SOFTMAX: tl.constexpr,
    IS_TOPK_SOFTMAX: tl.constexpr,
    IS_SIGMOID: tl.constexpr,
    IS_SPARSEMIXER: tl.constexpr,
    IS_TOPK_SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    STORE_INCACHE: tl.constexpr,
    STORE_SUBST: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_MAX: tl.constexpr,
    NG_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tl.static_assert(
        IS_SOFTMAX + IS_TOPK_SOFTMAX + IS_SIGMOID + IS_SPARSEMIXER + IS_TOPK_SIGMOID == 1,
        "one scoring",
    )
    tl.static_assert(FROM_HIDDEN or not (HAS_NORM or STORE_LOGITS), "norm/logits need hidden")
    tl.static_assert(HAS_MASK or not STORE_INCACHE, "in-cache flags need a mask")
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    m2 = rmask[:, None] & (cols < E)[None, :]

    # 1. router logits, fp32
    x = router_logits(
        x_ptr,
        stride_xt,
        stride_xh,
        gate_ptr,
        stride_ge,
        stride_gh,
        norm_ptr,
        eps,
        gbias_ptr,
        rows,
        cols,
        T,
        E,
        H,
        FROM_HIDDEN,
        HAS_NORM,
        HAS_GATE_BIAS,
        BLOCK_T,
        BLOCK_E,
        BLOCK_H,
    )
    if STORE_LOGITS:
        tl.store(logits_ptr + rows[:, None] * E + cols[None, :], x, mask=m2)
    mk = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_MASK:
        mk = tl.load(
            mask_ptr + rows[:, None] * stride_mt + cols[None, :] * stride_me, mask=m2, other=0
        ).to(tl.float32)

    # 2-5. scores, cache bias, group limit, top-k, gate weights
    ids, w, inc, _, nsub = select_experts(
        x,
        mk,
        bias_ptr,
        lam,
        scaling,
        norm_min,
        mixer_eps,
        cols,
        E,
        K,
        IS_SOFTMAX,
        IS_TOPK_SOFTMAX,
        IS_SIGMOID,
        IS_SPARSEMIXER,
        IS_TOPK_SIGMOID,
        RENORM,
        HAS_MASK,
        HAS_BIAS,
        STORE_INCACHE,
        STORE_SUBST,
        N_GROUP,
        TOPK_GROUP,
        GROUP_MAX,
        NG_P2,
        BLOCK_T,
        BLOCK_E,
        BLOCK_K,
    )

    kar = tl.arange(0, BLOCK_K)
    om = rmask[:, None] & (kar[None, :] < K)
    tl.store(weights_ptr + rows[:, None] * stride_ot + kar[None, :], w, mask=om)
    tl.store(ids_ptr + rows[:, None] * stride_ot + kar[None, :], ids, mask=om)
    if STORE_INCACHE:
        tl.store(incache_ptr + rows[:, None] * stride_ot + kar[None, :], inc.to(tl.uint8), mask=om)
    if STORE_SUBST:
        tl.store(subst_ptr + rows, nsub, mask=rmask)


# --------------------------------------------------------------------------- spec and checks


@dataclass(frozen=True)
class RouteSpec:
    """How to route, without the tensors: the router's semantics and the cache bias.

    `top_k` experts per token, `lam` the bias strength (0: the model's exact routing),
    `scoring` one of `SCORINGS`, `renormalize` (`norm_topk_prob`), the group limit
    `n_group` / `topk_group` (DeepSeek-V3; `n_group = 1` is none) with `group_score`
    (one of `GROUP_SCORES`), `scaling` (`routed_scaling_factor`) and `norm_min`, the
    floor of the renormalising sum (ERNIE's `moe_norm_min`; 0: none). A correction bias
    (`bias=`) is added to the selection scores of sigmoid routers and, for softmax
    routers (ERNIE), to the probabilities. Frozen, so hashable: launch configurations are cached
    on it. `check` validates it against a problem; `constexprs` gives the kernel's
    compile-time flags that follow from it.
    """

    top_k: int
    lam: float = 0.0
    scoring: str = "softmax"
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    group_score: str = "top2"
    norm_min: float = 0.0
    mixer_eps: float = 0.0  # PhiMoE's sparsemixer threshold (router_jitter_noise)

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
        self._check_normalisation(op)
        if bias is not None:
            if self.scoring in ("topk_softmax", "sparsemixer", "topk_sigmoid"):
                raise ValueError(
                    f"{op}: bias (e_score_correction_bias) needs scoring 'sigmoid' or 'softmax'"
                )
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

    def _check_normalisation(self, op: str) -> None:
        if self.group_score not in GROUP_SCORES:
            raise ValueError(
                f"{op}: unknown group_score {self.group_score!r}; expected one of {GROUP_SCORES}"
            )
        for name in ("norm_min", "mixer_eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{op}: {name} must be a finite number >= 0, got {v!r}")
        if self.scoring == "sparsemixer" and (self.top_k != 2 or self.n_group != 1):
            raise ValueError(
                f"{op}: the sparsemixer routes top-2 without groups (got top_k={self.top_k}, "
                f"n_group={self.n_group})"
            )

    def constexprs(self) -> dict[str, int | bool]:
        """The kernel's compile-time flags that follow from the spec alone."""
        n_group = max(1, self.n_group)
        return dict(
            K=self.top_k,
            IS_SOFTMAX=self.scoring == "softmax",
            IS_TOPK_SOFTMAX=self.scoring == "topk_softmax",
            IS_SIGMOID=self.scoring == "sigmoid",
            IS_SPARSEMIXER=self.scoring == "sparsemixer",
            IS_TOPK_SIGMOID=self.scoring == "topk_sigmoid",
            RENORM=bool(self.renormalize),
            N_GROUP=n_group,
            TOPK_GROUP=self.topk_group if n_group > 1 else 1,
            GROUP_MAX=n_group > 1 and self.group_score == "max",
            NG_P2=pow2(n_group, 2),
        )


def require_spec(op: str, spec: object) -> None:
    """A TypeError naming `op` unless `spec` is a RouteSpec (e.g. a bare top_k)."""
    if not isinstance(spec, RouteSpec):
        raise TypeError(
            f"{op}: spec must be a psr_kernels.RouteSpec (e.g. RouteSpec(top_k=8)), "
            f"got {type(spec).__name__}"
        )


@overload
def mask_2d(mask: torch.Tensor) -> torch.Tensor: ...
@overload
def mask_2d(mask: None) -> None: ...
def mask_2d(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A cache mask `[E]` as `[1, E]`; `[T, E]` and `[1, E]` as they are."""
    return None if mask is None else (mask if mask.dim() == 2 else mask[None, :])


def check_gemv(
    op: str,
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
) -> tuple[int, int, int]:
    """`(T, H, E)` of a hidden state `[T, H]` and a router weight `[E, H]` (and bias `[E]`)
    that fit."""
    check_float(op, "hidden", hidden, 2)
    check_float(op, "gate_weight", gate_weight, 2)
    T, H = hidden.shape
    E, Hg = gate_weight.shape
    if Hg != H:
        raise ValueError(f"{op}: gate_weight is [{E}, {Hg}] but hidden size is {H}")
    if gate_bias is not None:
        check_float(op, "gate_bias", gate_bias, 1)
        if gate_bias.shape[0] != E:
            raise ValueError(f"{op}: gate_bias has {gate_bias.shape[0]} elements, expected {E}")
    return T, H, E


def check_predict(
    op: str,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    n: int,
    spec: RouteSpec,
    *,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    check_finite: bool,
    gate_bias: torch.Tensor | None = None,
) -> tuple[int, RouteSpec]:
    """Shared argument checks of predict_next and its reference; returns (T, the spec
    they route with): the router of `spec`, unbiased (lam 0), unnormalised, and with
    `top_k = max(n, 1)`."""
    require_spec(op, spec)
    T, H, E = check_gemv(op, residual, gate_weight, gate_bias)
    check_float(op, "norm_weight", norm_weight, 1)
    if norm_weight.shape[0] != H:
        raise ValueError(
            f"{op}: norm_weight has {norm_weight.shape[0]} elements, hidden size is {H}"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{op}: n must be an int >= 0, got {n!r}")
    unbiased = RouteSpec(
        top_k=max(n, 1),
        # The sparsemixer picks in logit order: as a top-k of the logits, any n long.
        scoring="topk_softmax" if spec.scoring in ("sparsemixer", "topk_sigmoid") else spec.scoring,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        group_score=spec.group_score,
    )
    unbiased.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias, k_name="n")
    if check_finite and n > 0:
        _require_finite(op, "residual", residual)
    return T, unbiased


def no_prediction(
    T: int, ids_dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`predict_next`'s answer for n = 0: `[T, 0]` ids and in-cache flags."""
    return (
        torch.empty(T, 0, dtype=ids_dtype, device=device),
        torch.empty(T, 0, dtype=torch.bool, device=device),
    )


# --------------------------------------------------------------------------- launch


@functools.lru_cache(maxsize=1024)
def route_launch_config(
    num_tokens: int, num_experts: int, top_k: int, *, hidden_size: int | None = None
) -> Mapping[str, int]:
    """Block sizes and warps of `_route_kernel` for a problem (cached per shape: a
    read-only mapping).

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
    return MappingProxyType(
        dict(
            BLOCK_T=BLOCK_T,
            BLOCK_E=BLOCK_E,
            BLOCK_H=BLOCK_H,
            BLOCK_K=pow2(top_k, 2),
            num_warps=4 if BLOCK_E * BLOCK_T <= 1024 else 8,
        )
    )


@functools.lru_cache(maxsize=1024)
def route_kernel_config(
    spec: RouteSpec,
    *,
    num_tokens: int,
    num_experts: int,
    hidden_size: int | None = None,
    has_norm: bool = False,
    has_gate_bias: bool = False,
    has_mask: bool = False,
    has_bias: bool = False,
    store_logits: bool = False,
    store_incache: bool = False,
    store_subst: bool = False,
) -> Mapping[str, int | bool]:
    """Every compile-time argument of `_route_kernel` for one launch, and `num_warps`
    (cached per shape and flags: a read-only mapping).

    `hidden_size` is given when the kernel computes the logits (`FROM_HIDDEN`). The
    wrappers launch with exactly this, and the GPU compile test compiles it.
    """
    return MappingProxyType(
        dict(
            FROM_HIDDEN=hidden_size is not None,
            HAS_NORM=has_norm,
            HAS_GATE_BIAS=has_gate_bias,
            HAS_MASK=has_mask,
            HAS_BIAS=has_bias,
            STORE_LOGITS=store_logits,
            STORE_INCACHE=store_incache and has_mask,
            STORE_SUBST=store_subst,
            **spec.constexprs(),
            **route_launch_config(num_tokens, num_experts, spec.top_k, hidden_size=hidden_size),
        )
    )


class _Routed(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32
    ids: torch.Tensor  # [T, k] ids_dtype
    logits: torch.Tensor | None  # [T, E] fp32 (store_logits)
    in_cache: torch.Tensor | None  # [T, k] bool (store_incache; all False without a mask)
    substituted: torch.Tensor | None  # [T] int32 (store_subst; all 0 without a mask)


def _launch(
    spec: RouteSpec,
    x: torch.Tensor,
    *,
    num_experts: int,
    gate_weight: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    gate_bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    store_logits: bool = False,
    store_incache: bool = False,
    store_subst: bool = False,
) -> _Routed:
    """Run `_route_kernel` on checked arguments.

    `x` is the logits `[T, E]`, or the hidden state `[T, H]` when `gate_weight` is given
    (then `norm_weight` adds the RMS norm). Outputs are fresh contiguous tensors, the
    logits and in-cache flags only where asked for.
    """
    from_hidden = gate_weight is not None
    T, E, k = x.shape[0], num_experts, spec.top_k
    H = x.shape[1] if from_hidden else 0
    dev = x.device
    m = mask_2d(mask)
    # The kernel writes every element of its outputs: `empty` is enough.
    weights = torch.empty(T, k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, k, dtype=ids_dtype, device=dev)
    logits = torch.empty(T, E, dtype=torch.float32, device=dev) if store_logits else None
    in_cache = None
    if store_incache:
        # Without a mask nothing is cached: no flags to compute.
        in_cache = (torch.empty if m is not None else torch.zeros)(
            T, k, dtype=torch.bool, device=dev
        )
    subst = torch.empty(T, dtype=torch.int32, device=dev) if store_subst else None
    if T == 0:
        return _Routed(weights, ids, logits, in_cache, subst)
    cfg = route_kernel_config(
        spec,
        num_tokens=T,
        num_experts=E,
        hidden_size=H if from_hidden else None,
        has_norm=norm_weight is not None,
        has_gate_bias=gate_bias is not None,
        has_mask=m is not None,
        has_bias=bias is not None,
        store_logits=store_logits,
        store_incache=store_incache,
        store_subst=store_subst,
    )
    dummy = weights  # stands in for absent tensors; never read (its flag is off)
    _route_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
        x_ptr=x,
        stride_xt=x.stride(0),
        stride_xh=x.stride(1),
        gate_ptr=gate_weight if from_hidden else dummy,
        stride_ge=gate_weight.stride(0) if gate_weight is not None else 0,
        stride_gh=gate_weight.stride(1) if gate_weight is not None else 0,
        norm_ptr=norm_weight if norm_weight is not None else dummy,
        eps=float(eps),
        gbias_ptr=gate_bias if gate_bias is not None else dummy,
        mask_ptr=m.view(torch.uint8) if m is not None else dummy,
        # A broadcast [1, E] mask uses row stride 0.
        stride_mt=0 if m is None or m.shape[0] == 1 else m.stride(0),
        stride_me=m.stride(1) if m is not None else 0,
        bias_ptr=bias if bias is not None else dummy,
        weights_ptr=weights,
        ids_ptr=ids,
        stride_ot=k,
        logits_ptr=logits if logits is not None else dummy,
        # The kernel stores 0 or 1 per choice: a bool tensor's bytes, viewed as uint8.
        incache_ptr=in_cache.view(torch.uint8) if in_cache is not None and m is not None else dummy,
        subst_ptr=subst if subst is not None else dummy,
        T=T,
        E=E,
        H=H,
        lam=float(spec.lam),
        scaling=float(spec.scaling),
        norm_min=float(spec.norm_min),
        mixer_eps=float(spec.mixer_eps),
        **cfg,
    )
    return _Routed(weights, ids, logits, in_cache, subst)


# --------------------------------------------------------------------------- ops


def route(
    logits: torch.Tensor,
    spec: RouteSpec,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache-biased top-k routing from router logits.

    Args:
        logits: `[T, E]` router logits (fp32/bf16/fp16), any strides.
        spec: how to route (`RouteSpec`): `top_k` (`1 <= top_k <= E`), the bias
            strength `lam` (`0` is the model's exact routing), `scoring` ('softmax':
            OLMoE, Qwen-MoE, Mixtral; 'topk_softmax': softmax over the chosen logits;
            'sigmoid': DeepSeek-V3 / Moonlight), `renormalize` (divide the k weights by
            their sum: `norm_topk_prob`), the group limit `n_group` / `topk_group`
            (DeepSeek-V3) and `scaling` (routed_scaling_factor on the final weights).
        mask: bool `[E]`, `[1, E]` or `[T, E]`: True where the expert is in the
            layer's cache.
        bias: `[E]` e_score_correction_bias (sigmoid scoring), added for selection only.
        ids_dtype: dtype of the returned ids (int64 or int32).
        check_finite: raise ValueError on NaN/inf logits (a host sync). Without it,
            NaN scores never compare greater, so the ids are unspecified garbage.

    Returns:
        `(weights [T, k] fp32, ids [T, k] ids_dtype)`, contiguous, ids ordered by
        biased score.
    """
    op = "route"
    require_spec(op, spec)
    check_float(op, "logits", logits, 2)
    T, E = logits.shape
    spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias)
    check_launchable(op, logits, mask, bias)
    if check_finite:
        _require_finite(op, "logits", logits)
    out = _launch(spec, logits, num_experts=E, mask=mask, bias=bias, ids_dtype=ids_dtype)
    return out.weights, out.ids


def route_counted(
    logits: torch.Tensor,
    spec: RouteSpec,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route` that also counts, per token, the substituted experts: the chosen ids that
    are not in the model's own exact top-k, taken in the same kernel from the same scores
    without the cache bias (same group limit and ties).

    Returns `(weights [T, k] fp32, ids [T, k] ids_dtype, substituted [T] int32)`; the
    count is 0 without a mask (nothing biases the routing).
    """
    op = "route_counted"
    require_spec(op, spec)
    check_float(op, "logits", logits, 2)
    T, E = logits.shape
    spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias)
    check_launchable(op, logits, mask, bias)
    if check_finite:
        _require_finite(op, "logits", logits)
    out = _launch(
        spec, logits, num_experts=E, mask=mask, bias=bias, ids_dtype=ids_dtype, store_subst=True
    )
    assert out.substituted is not None
    return out.weights, out.ids, out.substituted


def route_hidden(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    spec: RouteSpec,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
    gate_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route` fused with the router GEMV: logits = hidden @ gate_weight^T (+ gate_bias)
    in fp32.

    `hidden` is `[T, H]`, `gate_weight` the router weight `[E, H]`, `gate_bias` its bias
    `[E]` (gpt-oss's router has one); the other arguments are `route`'s (`check_finite`
    checks `hidden`).

    Returns `(weights [T, k] fp32, ids [T, k], logits [T, E] fp32)`, contiguous.
    """
    op = "route_hidden"
    require_spec(op, spec)
    T, _, E = check_gemv(op, hidden, gate_weight, gate_bias)
    spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias)
    check_launchable(op, hidden, gate_weight, mask, bias, gate_bias)
    if check_finite:
        _require_finite(op, "hidden", hidden)
    out = _launch(
        spec,
        hidden,
        num_experts=E,
        gate_weight=gate_weight,
        gate_bias=gate_bias,
        mask=mask,
        bias=bias,
        ids_dtype=ids_dtype,
        store_logits=True,
    )
    assert out.logits is not None
    return out.weights, out.ids, out.logits


def predict_next(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    n: int,
    spec: RouteSpec,
    *,
    eps: float = 1e-6,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
    gate_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predict the next MoE layer's experts (the spec's `prefetch` rule), in one kernel
    (`gate_bias`: the next router's own bias, where it has one).

    RMS-norms `residual` (the hidden state entering this layer's MoE block) with the
    next layer's norm weight (`eps` its epsilon), scores it with the next layer's
    router and returns the first `n` ids of that layer's exact routing order
    (group-limited where the model is; ties to the lower id), and whether `mask` (the
    next layer's logical cache) holds each.

    `spec` is the next layer's router: its `scoring` and group limit (`n_group`,
    `topk_group`) are used; its `top_k`, `lam`, `renormalize` and `scaling` are not (a
    prediction is the router's unbiased order, `n` long, and has no weights). `bias` is
    the next layer's e_score_correction_bias.

    Returns `(ids [T, n], in_cache [T, n] bool)`, contiguous; in_cache is all False
    without a mask.
    """
    op = "predict_next"
    T, unbiased = check_predict(
        op,
        residual,
        norm_weight,
        gate_weight,
        n,
        spec,
        mask=mask,
        bias=bias,
        check_finite=check_finite,
        gate_bias=gate_bias,
    )
    dev = check_launchable(op, residual, norm_weight, gate_weight, mask, bias, gate_bias)
    if n == 0:
        return no_prediction(T, ids_dtype, dev)
    out = _launch(
        unbiased,
        residual,
        num_experts=gate_weight.shape[0],
        gate_weight=gate_weight,
        norm_weight=norm_weight,
        eps=eps,
        gate_bias=gate_bias,
        mask=mask,
        bias=bias,
        ids_dtype=ids_dtype,
        store_incache=True,
    )
    assert out.in_cache is not None
    return out.ids, out.in_cache
