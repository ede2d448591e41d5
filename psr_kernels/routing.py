"""Cache-biased top-k MoE routing, and next-layer expert prediction.

One Triton kernel serves both ops. Per token row it
  1. gets router logits: loaded, or computed in-kernel from the hidden state
     and the gate weight (the batch-1 GEMV), optionally after an RMS norm;
  2. forms the model's selection scores z (softmax/top-k-softmax: the logits;
     sigmoid: sigmoid(logits) + e_score_correction_bias);
  3. biases them toward cached experts: z' = z + lam * D * m, D = max(z) - min(z);
  4. applies the group limit (DeepSeek-V3: keep the `topk_group` groups with the
     largest sum of their top-2 scores), then takes the top-k of z', ties to the
     lower expert id;
  5. computes gate weights from the *unbiased* scores, normalised as the model does.

`lam = 0` is the model's own routing. Every `*_ref` function is the plain-torch
reference the kernel is tested against, and the CPU path of the torch ops.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from psr_kernels._common import check_finite as _require_finite
from psr_kernels._common import check_float, check_launchable, pow2

SCORINGS = ("softmax", "topk_softmax", "sigmoid")
_SCORING_CODE = {name: i for i, name in enumerate(SCORINGS)}
_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- kernel


@triton.jit
def _gemv_rows(
    x_ptr,
    sxt,
    sxh,
    w_ptr,
    swe,
    swh,
    rows,
    cols,
    T,
    E,
    H,
    inv_rms,
    nw_ptr,
    NORM: tl.constexpr,
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
            x_ptr + rows[:, None] * sxt + hs[None, :] * sxh,
            mask=(rows[:, None] < T) & hm[None, :],
            other=0.0,
        ).to(tl.float32)
        if NORM:
            nw = tl.load(nw_ptr + hs, mask=hm, other=0.0).to(tl.float32)
            x = x * inv_rms[:, None] * nw[None, :]
        w = tl.load(
            w_ptr + cols[:, None] * swe + hs[None, :] * swh,
            mask=(cols[:, None] < E) & hm[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _route_kernel(
    in_ptr,
    s_it,
    s_ih,  # logits [T, E] (MODE 0) or hidden [T, H]
    gw_ptr,
    s_ge,
    s_gh,  # gate weight [E, H] (MODE > 0)
    nw_ptr,
    eps,  # RMS-norm weight [H] (MODE 2)
    mask_ptr,
    s_mt,
    s_me,  # cache mask [T|1, E] as uint8
    bias_ptr,  # e_score_correction_bias [E]
    w_out,
    ids_out,
    s_ot,  # [T, K]
    logits_out,
    incache_out,  # [T, E] fp32 (MODE > 0), [T, K] uint8
    T,
    E,
    H,
    lam,
    scaling,
    K: tl.constexpr,
    MODE: tl.constexpr,
    SCORING: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_INCACHE: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NG_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
    neg_inf = float("-inf")

    # 1. router logits, fp32
    if MODE == 0:
        x = tl.load(in_ptr + rows[:, None] * s_it + cols[None, :] * s_ih, mask=m2, other=0.0).to(
            tl.float32
        )
    else:
        inv_rms = tl.zeros([BLOCK_T], dtype=tl.float32)
        if MODE == 2:
            ss = tl.zeros([BLOCK_T], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                hs = h0 + tl.arange(0, BLOCK_H)
                xv = tl.load(
                    in_ptr + rows[:, None] * s_it + hs[None, :] * s_ih,
                    mask=rmask[:, None] & (hs[None, :] < H),
                    other=0.0,
                ).to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
            inv_rms = 1.0 / tl.sqrt(ss / H + eps)
        x = _gemv_rows(
            in_ptr,
            s_it,
            s_ih,
            gw_ptr,
            s_ge,
            s_gh,
            rows,
            cols,
            T,
            E,
            H,
            inv_rms,
            nw_ptr,
            MODE == 2,
            BLOCK_T,
            BLOCK_E,
            BLOCK_H,
        )
        tl.store(logits_out + rows[:, None] * E + cols[None, :], x, mask=m2)

    # 2. selection scores z and the weight source
    if SCORING == 2:
        src = 1.0 / (1.0 + tl.exp(-x))
        z = src
        if HAS_BIAS:
            z = z + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    else:
        z = x
        if SCORING == 0:
            xm = tl.where(cmask[None, :], x, neg_inf)
            ex = tl.exp(xm - tl.max(xm, axis=1)[:, None])
            src = ex / tl.sum(ex, axis=1)[:, None]
        else:
            src = x

    # 3. bias toward the cache: z' = z + lam * D * m
    if HAS_MASK:
        mk = tl.load(mask_ptr + rows[:, None] * s_mt + cols[None, :] * s_me, mask=m2, other=0).to(
            tl.float32
        )
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
        if HAS_MASK:
            inc = tl.where(kar[None, :] == j, tl.sum(tl.where(hit, mk, 0.0), axis=1)[:, None], inc)
        sel = tl.where(hit, neg_inf, sel)

    # 5. gate weights from the unbiased scores
    kvalid = kar[None, :] < K
    if SCORING == 1:
        vm = tl.where(kvalid, val, neg_inf)
        ev = tl.exp(vm - tl.max(vm, axis=1)[:, None])
        w = ev / tl.sum(ev, axis=1)[:, None]
    else:
        w = tl.where(kvalid, val, 0.0)
        if RENORM:
            denom = tl.sum(w, axis=1)
            if SCORING == 2:
                denom = denom + 1e-20
            w = w / denom[:, None]
    w = w * scaling

    om = rmask[:, None] & kvalid
    tl.store(w_out + rows[:, None] * s_ot + kar[None, :], w, mask=om)
    tl.store(ids_out + rows[:, None] * s_ot + kar[None, :], ids, mask=om)
    if STORE_INCACHE:
        tl.store(incache_out + rows[:, None] * s_ot + kar[None, :], inc.to(tl.uint8), mask=om)


# --------------------------------------------------------------------------- checks


def _check_routing_args(
    op: str,
    E: int,
    T: int,
    top_k: int,
    mask: torch.Tensor | None,
    lam: float,
    scoring: str,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    k_name: str = "top_k",
) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"{op}: unknown scoring {scoring!r}; expected one of {SCORINGS}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"{op}: {k_name} must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= E:
        raise ValueError(f"{op}: {k_name}={top_k} must be in [1, num_experts={E}]")
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
        if scoring != "sigmoid":
            raise ValueError(f"{op}: bias (e_score_correction_bias) needs scoring='sigmoid'")
        check_float(op, "bias", bias, 1)
        if bias.shape[0] != E:
            raise ValueError(f"{op}: bias must have shape [{E}], got {list(bias.shape)}")
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


def _mask_2d(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else (mask if mask.dim() == 2 else mask[None, :])


# --------------------------------------------------------------------------- launch


def route_launch_config(mode: int, T: int, E: int, H: int, top_k: int) -> dict[str, int]:
    """Block sizes and warps of `_route_kernel` for a problem (no autotuning: the same
    choice under the interpreter and on a GPU)."""
    BLOCK_E = pow2(E, 16)
    BLOCK_T = min(pow2(T), 16)
    BLOCK_H = 0
    if mode:
        # Keep the [BLOCK_T, BLOCK_E, BLOCK_H] product tile near 8K elements.
        BLOCK_T = min(BLOCK_T, 4)
        BLOCK_H = max(16, min(pow2(H), 8192 // (BLOCK_T * BLOCK_E)))
    return dict(
        BLOCK_T=BLOCK_T,
        BLOCK_E=BLOCK_E,
        BLOCK_H=BLOCK_H,
        BLOCK_K=pow2(top_k, 2),
        num_warps=4 if BLOCK_E * BLOCK_T <= 1024 else 8,
    )


def _launch(
    mode: int,
    inp: torch.Tensor,
    gate: torch.Tensor | None,
    norm_w: torch.Tensor | None,
    eps: float,
    E: int,
    top_k: int,
    mask: torch.Tensor | None,
    lam: float,
    scoring: str,
    renormalize: bool,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    scaling: float,
    ids_dtype: torch.dtype,
    want_incache: bool,
):
    T = inp.shape[0]
    H = inp.shape[1] if mode else 0
    dev = inp.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=ids_dtype, device=dev)
    logits = torch.empty(T if mode else 0, E, dtype=torch.float32, device=dev)
    incache = torch.zeros(T, top_k, dtype=torch.uint8, device=dev)
    if T == 0:
        return weights, ids, logits, incache.bool()
    m = _mask_2d(mask)
    mu8 = m.view(torch.uint8) if m is not None else None
    # A broadcast [1, E] mask uses row stride 0.
    s_mt = 0 if m is None or m.shape[0] == 1 else m.stride(0)
    cfg = route_launch_config(mode, T, E, H, top_k)
    n_group = max(1, n_group)
    dummy = weights
    _route_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
        inp,
        inp.stride(0),
        inp.stride(1),
        gate if gate is not None else dummy,
        *(gate.stride() if gate is not None else (0, 0)),
        norm_w if norm_w is not None else dummy,
        float(eps),
        mu8 if mu8 is not None else incache,
        s_mt,
        m.stride(1) if m is not None else 0,
        bias if bias is not None else dummy,
        weights,
        ids,
        top_k,
        logits if mode else dummy,
        incache,
        T,
        E,
        H,
        float(lam),
        float(scaling),
        K=top_k,
        MODE=mode,
        SCORING=_SCORING_CODE[scoring],
        RENORM=bool(renormalize),
        HAS_MASK=m is not None,
        HAS_BIAS=bias is not None,
        STORE_INCACHE=want_incache and m is not None,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group if n_group > 1 else 1,
        NG_P2=pow2(n_group, 2),
        **cfg,
    )
    return weights, ids, logits, incache.bool()


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
        mask: bool `[E]` or `[T, E]`: True where the expert is in the layer's cache.
        lam: bias strength; `0` is the model's exact routing.
        scoring: 'softmax' (OLMoE, Qwen-MoE, Mixtral), 'topk_softmax' (softmax over
            the chosen logits), 'sigmoid' (DeepSeek-V3 / Moonlight).
        renormalize: divide the k weights by their sum (`norm_topk_prob`; Mixtral: True).
        bias: `[E]` e_score_correction_bias (sigmoid scoring), added for selection only.
        n_group, topk_group: group-limited top-k (DeepSeek-V3).
        scaling: routed_scaling_factor applied to the final weights.
        check_finite: raise ValueError on NaN/inf logits (a host sync). Without it,
            NaN scores never compare greater, so the ids are unspecified garbage.

    Returns:
        `(weights [T, k] fp32, ids [T, k] ids_dtype)`, ids ordered by biased score.
    """
    op = "route"
    check_float(op, "logits", logits, 2)
    T, E = logits.shape
    _check_routing_args(op, E, T, top_k, mask, lam, scoring, bias, n_group, topk_group)
    check_launchable(op, logits, mask, bias)
    if check_finite:
        _require_finite(op, "logits", logits)
    w, ids, _, _ = _launch(
        0,
        logits,
        None,
        None,
        0.0,
        E,
        top_k,
        mask,
        lam,
        scoring,
        renormalize,
        bias,
        n_group,
        topk_group,
        scaling,
        ids_dtype,
        False,
    )
    return w, ids


def _check_gemv(op: str, hidden: torch.Tensor, gate_weight: torch.Tensor) -> tuple[int, int, int]:
    check_float(op, "hidden", hidden, 2)
    check_float(op, "gate_weight", gate_weight, 2)
    T, H = hidden.shape
    E, Hg = gate_weight.shape
    if Hg != H:
        raise ValueError(f"{op}: gate_weight is [{E}, {Hg}] but hidden size is {H}")
    return T, H, E


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

    Returns `(weights [T, k] fp32, ids [T, k], logits [T, E] fp32)`.
    """
    op = "route_hidden"
    T, _, E = _check_gemv(op, hidden, gate_weight)
    _check_routing_args(op, E, T, top_k, mask, lam, scoring, bias, n_group, topk_group)
    check_launchable(op, hidden, gate_weight, mask, bias)
    if check_finite:
        _require_finite(op, "hidden", hidden)
    w, ids, logits, _ = _launch(
        1,
        hidden,
        gate_weight,
        None,
        0.0,
        E,
        top_k,
        mask,
        lam,
        scoring,
        renormalize,
        bias,
        n_group,
        topk_group,
        scaling,
        ids_dtype,
        False,
    )
    return w, ids, logits


def _check_predict(
    op: str,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    n: int,
    mask: torch.Tensor | None,
    scoring: str,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    check_finite: bool,
) -> tuple[int, int]:
    """Shared argument checks of predict_next and its reference; returns (T, E)."""
    T, H, E = _check_gemv(op, residual, gate_weight)
    check_float(op, "norm_weight", norm_weight, 1)
    if norm_weight.shape[0] != H:
        raise ValueError(
            f"{op}: norm_weight has {norm_weight.shape[0]} elements, hidden size is {H}"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{op}: n must be an int >= 0, got {n!r}")
    _check_routing_args(op, E, T, max(n, 1), mask, 0.0, scoring, bias, n_group, topk_group, "n")
    if check_finite and n > 0:
        _require_finite(op, "residual", residual)
    return T, E


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

    Returns `(ids [T, n], in_cache [T, n] bool)`; in_cache is all False without a mask.
    """
    op = "predict_next"
    T, E = _check_predict(
        op,
        residual,
        norm_weight,
        gate_weight,
        n,
        mask,
        scoring,
        bias,
        n_group,
        topk_group,
        check_finite,
    )
    dev = check_launchable(op, residual, norm_weight, gate_weight, mask, bias)
    if n == 0:
        return _no_prediction(T, ids_dtype, dev)
    _, ids, _, incache = _launch(
        2,
        residual,
        gate_weight,
        norm_weight,
        eps,
        E,
        n,
        mask,
        0.0,
        scoring,
        False,
        bias,
        n_group,
        topk_group,
        1.0,
        ids_dtype,
        True,
    )
    return ids, incache


# --------------------------------------------------------------------------- references


def _scores_ref(logits: torch.Tensor, scoring: str, bias: torch.Tensor | None):
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
    return torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]


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
    _check_routing_args(op, E, T, top_k, mask, lam, scoring, bias, n_group, topk_group)
    if check_finite:
        _require_finite(op, "logits", logits)
    z, src = _scores_ref(logits, scoring, bias)
    sel = _group_limit_ref(biased_scores_ref(z, mask, lam), n_group, topk_group)
    ids = _topk_ref(sel, top_k)
    val = src.gather(1, ids)
    if scoring == "topk_softmax":
        w = torch.softmax(val, dim=-1)
    else:
        w = val
        if renormalize:
            denom = w.sum(-1, keepdim=True)
            w = w / (denom + 1e-20 if scoring == "sigmoid" else denom)
    return w * scaling, ids.to(ids_dtype)


def route_hidden_ref(
    hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, **kw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `route_hidden`."""
    _check_gemv("route_hidden_ref", hidden, gate_weight)
    logits = hidden.float() @ gate_weight.float().t()
    w, ids = route_ref(logits, top_k, **kw)
    return w, ids, logits


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
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
    T, E = _check_predict(
        op,
        residual,
        norm_weight,
        gate_weight,
        n,
        mask,
        scoring,
        bias,
        n_group,
        topk_group,
        check_finite,
    )
    if n == 0:
        return _no_prediction(T, ids_dtype, residual.device)
    logits = rms_norm_ref(residual, norm_weight, eps) @ gate_weight.float().t()
    z, _ = _scores_ref(logits, scoring, bias)
    ids = _topk_ref(_group_limit_ref(z, n_group, topk_group), n)
    if mask is None:
        incache = torch.zeros_like(ids, dtype=torch.bool)
    else:
        incache = _mask_2d(mask).expand(T, E).gather(1, ids)
    return ids.to(ids_dtype), incache
