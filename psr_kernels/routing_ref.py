"""Plain-torch references of the routing ops (`psr_kernels.routing`), and their parts.

Each `*_ref` op takes the arguments of its kernel op and returns the same results
(contiguous tensors, like the kernels): the kernels are tested against them, and they
are the CPU path of `kernel_ops` and the `torch.ops.psr` ops. The parts (`scores_ref`,
`group_limit_ref`, `topk_ref`, `gate_weights_ref`, `biased_scores_ref`,
`rms_norm_ref`) also serve block routing (`block_routing`) and the runtime.
"""

from __future__ import annotations

import torch

from psr_kernels._common import CPU_VECTOR_CHUNK, check_float
from psr_kernels._common import check_finite as _require_finite
from psr_kernels.routing import (
    RouteSpec,
    check_gemv,
    check_predict,
    mask_2d,
    no_prediction,
    require_spec,
)

_NEG_INF = float("-inf")
# torch splits elementwise work past 32768 elements between threads at arbitrary offsets.
_CHUNK, _ONE_THREAD = CPU_VECTOR_CHUNK, 32768


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`torch.sigmoid(x [T, E])` with each row's bits independent of the other rows (batch-
    and chunk-invariant routing). torch's CPU sigmoid is not (`_CHUNK`): a row of 8 or 60
    experts rounds differently alone and among others on AVX2. Rows padded to a multiple of
    64, in blocks one thread computes, put every element in a whole vector chunk."""
    T, E = x.shape
    if x.device.type != "cpu" or (E % _CHUNK == 0 and T * E <= _ONE_THREAD):
        return torch.sigmoid(x)
    wide = -(-E // _CHUNK) * _CHUNK
    xp = x.new_zeros(T, wide)
    xp[:, :E] = x
    step = max(1, _ONE_THREAD // wide)
    if T <= step:
        return torch.sigmoid(xp)[:, :E].contiguous()
    return torch.cat([torch.sigmoid(xp[i : i + step]) for i in range(0, T, step)])[
        :, :E
    ].contiguous()


def scores_ref(
    logits: torch.Tensor, scoring: str, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(selection scores z, weight source) in fp32."""
    x = logits.float()
    if scoring == "sigmoid":
        s = row_sigmoid(x)
        return (s + bias.float() if bias is not None else s), s
    if scoring == "softmax":
        p = torch.softmax(x, dim=-1)
        # ERNIE: the correction bias is added to the probabilities for selection.
        return (p + bias.float() if bias is not None else x), p
    return x, x


def group_limit_ref(
    sel: torch.Tensor, n_group: int, topk_group: int, group_score: str = "top2"
) -> torch.Tensor:
    """`sel` with every group outside the `topk_group` of largest group scores at -inf: a
    group's top-2 sum, or (`group_score="max"`) its maximum."""
    if n_group <= 1:
        return sel
    T, E = sel.shape
    top = sel.view(T, n_group, E // n_group).sort(dim=-1, descending=True).values
    gscore = top[..., 0] if group_score == "max" else top[..., :2].sum(-1)
    order = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=sel.device)
    keep.scatter_(1, order, True)
    return sel.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), _NEG_INF)


def topk_ref(sel: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the `k` largest scores per row, ties to the lower id (contiguous)."""
    # Stable descending sort: equal scores keep ascending id order (ties to the lower id).
    # The slice is a strided view; the ops' outputs are contiguous (their fakes say so).
    return torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def gate_weights_ref(
    src: torch.Tensor,
    ids: torch.Tensor,
    scoring: str,
    renormalize: bool,
    scaling: float,
    norm_min: float = 0.0,
    mixer_eps: float = 0.0,
) -> torch.Tensor:
    """Gate weights of chosen `ids` from the unbiased weight source, normalised as the
    model does (top-k softmax, `norm_topk_prob` with ERNIE's floor `norm_min`, PhiMoE's
    sparsemixer, `routed_scaling_factor`)."""
    val = src.gather(1, ids)
    if scoring == "sparsemixer":
        w = sparsemixer_weights_ref(src, ids, mixer_eps)
    elif scoring == "topk_sigmoid":
        w = row_sigmoid(val)
    elif scoring == "topk_softmax":
        w = torch.softmax(val, dim=-1)
    else:
        w = val
        if renormalize:
            denom = w.sum(-1, keepdim=True)
            if scoring == "sigmoid":
                denom = denom + 1e-20
            w = w / (denom.clamp(min=norm_min) if norm_min > 0 else denom)
    # w is a fresh contiguous tensor; w * 1.0 would be the same bits (one op saved per call).
    return w if scaling == 1.0 else (w * scaling).contiguous()


def sparsemixer_weights_ref(x: torch.Tensor, ids: torch.Tensor, eps: float) -> torch.Tensor:
    """PhiMoE's sparsemixer weights (eval mode) of the chosen `ids` from the logits `x`: for
    the j-th choice, of logit c, the softmax at c over the experts that
    (c - x) / max(|x|, c) > 2 eps does not mask, the earlier choices excluded (for the
    model's own choices, transformers' `sparsemixer`)."""
    out = []
    excluded = torch.zeros_like(x, dtype=torch.bool)
    for j in range(ids.shape[1]):
        c = x.gather(1, ids[:, j : j + 1])
        masked = ((c - x) / x.abs().clamp(min=c)) > 2 * eps
        gates = torch.softmax(x.masked_fill(masked | excluded, float("-inf")), dim=-1)
        out.append(gates.gather(1, ids[:, j : j + 1]))
        excluded = excluded.scatter(1, ids[:, j : j + 1], True)
    return torch.cat(out, dim=1)


def biased_scores_ref(z: torch.Tensor, mask: torch.Tensor | None, lam: float) -> torch.Tensor:
    """z' = z + lam * D * m with D the per-row spread of z."""
    if mask is None:
        return z
    lo, hi = torch.aminmax(z, dim=-1)  # one op for both
    spread = hi - lo
    return z + lam * spread[:, None] * mask_2d(mask).float()


def route_ref(
    logits: torch.Tensor,
    spec: RouteSpec,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `route` (same arguments, same results)."""
    op = "route_ref"
    require_spec(op, spec)
    check_float(op, "logits", logits, 2)
    T, E = logits.shape
    spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias)
    if check_finite:
        _require_finite(op, "logits", logits)
    w, ids, _ = _route_parts(logits, spec, mask, bias, counted=False)
    return w, ids.to(ids_dtype).contiguous()


def _route_parts(
    logits: torch.Tensor,
    spec: RouteSpec,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    counted: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weights, int64 ids, per-row substituted count when `counted`): the kernel's
    stages on checked arguments. The count compares the chosen ids with the exact top-k
    of the same scores `z` without the cache bias (same group limit, same ties)."""
    z, src = scores_ref(logits, spec.scoring, bias)
    g = (spec.n_group, spec.topk_group, spec.group_score)
    ids = topk_ref(group_limit_ref(biased_scores_ref(z, mask, spec.lam), *g), spec.top_k)
    w = gate_weights_ref(
        src, ids, spec.scoring, spec.renormalize, spec.scaling, spec.norm_min, spec.mixer_eps
    )
    if not counted:
        return w, ids, None
    if mask is None:  # no bias: the exact routing, nothing substituted
        return w, ids, torch.zeros(ids.shape[0], dtype=torch.int32, device=ids.device)
    return w, ids, substituted_ref(ids, topk_ref(group_limit_ref(z, *g), spec.top_k))


def substituted_ref(ids: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Per row, how many of `ids [T, k]` are not among `exact [T, k']` (int32 `[T]`)."""
    inside = (ids[:, :, None] == exact[:, None, :]).any(-1)
    return (ids.shape[1] - inside.sum(-1)).to(torch.int32)


def route_counted_ref(
    logits: torch.Tensor,
    spec: RouteSpec,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
    checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `route_counted`: `route_ref`'s results and the
    substituted count per token `[T]` int32. `checked=True`: the arguments passed these
    checks before with the same kinds (the decode step's later calls of a layer), so they
    are skipped (Python a CPU decode token paid per MoE layer)."""
    op = "route_counted_ref"
    if not checked:
        require_spec(op, spec)
        check_float(op, "logits", logits, 2)
        T, E = logits.shape
        spec.check(op, num_experts=E, num_tokens=T, mask=mask, bias=bias)
    if check_finite:
        _require_finite(op, "logits", logits)
    w, ids, sub = _route_parts(logits, spec, mask, bias, counted=True)
    assert sub is not None
    return w, ids.to(ids_dtype).contiguous(), sub


def route_hidden_ref(
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
    """Plain-torch reference of `route_hidden` (`check_finite` checks the logits)."""
    op = "route_hidden_ref"
    require_spec(op, spec)
    check_gemv(op, hidden, gate_weight, gate_bias)
    logits = hidden.float() @ gate_weight.float().t()
    if gate_bias is not None:
        logits = logits + gate_bias.float()
    w, ids = route_ref(
        logits, spec, mask=mask, bias=bias, ids_dtype=ids_dtype, check_finite=check_finite
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
    spec: RouteSpec,
    *,
    eps: float = 1e-6,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
    check_finite: bool = True,
    gate_bias: torch.Tensor | None = None,
    rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `predict_next`. `rows=True`: each row of `residual` as if
    called on that row alone (a batch's sequences, psr.runtime.batch): the norm and the
    selection over every row (row-wise ops), the router product row by row on a fresh row
    (a matmul's rounding depends on its row count and its input's alignment)."""
    op = "predict_next_ref"
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
    if n == 0:
        return no_prediction(T, ids_dtype, residual.device)
    normed = rms_norm_ref(residual, norm_weight, eps)
    if rows:
        parts = [normed[r : r + 1].clone() for r in range(T)]
        logits = torch.cat([predict_logits_ref(x, gate_weight, gate_bias) for x in parts])
    else:
        logits = predict_logits_ref(normed, gate_weight, gate_bias)
    return predict_select_ref(logits, n, unbiased, mask=mask, bias=bias, ids_dtype=ids_dtype)


def predict_logits_ref(
    normed: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None
) -> torch.Tensor:
    """`predict_next_ref`'s router logits of the normed residual (fp32)."""
    logits = normed @ gate_weight.float().t()
    if gate_bias is not None:
        logits = logits + gate_bias.float()
    return logits


def predict_select_ref(
    logits: torch.Tensor,
    n: int,
    unbiased: RouteSpec,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ids_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`predict_next_ref`'s selection from its logits `[T, E]` (row by row: only row-wise
    ops, so rows selected together equal each selected alone): the first `n` ids of the
    unbiased spec's exact order and whether `mask` holds each."""
    T, E = logits.shape
    # Selection scores only: a softmax's weight source is not needed here.
    plain = unbiased.scoring == "softmax" and bias is None
    z = logits if plain else scores_ref(logits, unbiased.scoring, bias)[0]
    g = unbiased
    ids = topk_ref(group_limit_ref(z, g.n_group, g.topk_group, g.group_score), n)
    m = mask_2d(mask)
    if m is None:
        incache = torch.zeros_like(ids, dtype=torch.bool)
    else:
        incache = m.expand(T, E).gather(1, ids)
    return ids.to(ids_dtype).contiguous(), incache.contiguous()
