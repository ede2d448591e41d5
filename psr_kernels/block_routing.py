"""Block-level expert selection for speculative verification: ONE set of experts per MoE
layer for a whole block of tokens, then each token's own top-k inside that set.

    block score  b[e] = sum over the block's tokens of the weight source s_t[e]
                 (softmax probabilities for softmax routers; sigmoid scores plus
                 e_score_correction_bias for sigmoid routers)
    biased       b'[e] = b[e] + lam * (max b - min b) * m[e]     (m: the layer's cache)
    set          S = the `block_k` ids of largest b' (ties to the lower id)
    per token    the model's own top-k of its unbiased scores restricted to S; gate
                 weights from the unbiased scores, normalised as the model does

Group-limited routers (DeepSeek-V3's n_group / topk_group): each token keeps the groups
its own router picks (G_t); the block score sums each token's source over G_t only, S is
drawn from the union of the tokens' groups first, and each token takes its top-k inside
S and G_t first, then (where S holds fewer than k of its groups' experts) from S's other
members: the set stays at most `block_k`, the substitution is the set's quality cost.

With `block_k = E` every expert is allowed and each token's routing is the model's
exact routing (what `route_ref` gives with lam = 0), group limit included. This is a
handful of small torch ops per layer and block; it runs as is on CPU and CUDA tensors (no
Triton kernel).
"""

from __future__ import annotations

import torch

from psr_kernels._common import check_float
from psr_kernels.routing import RouteSpec, require_spec
from psr_kernels.routing_ref import (
    biased_scores_ref,
    gate_weights_ref,
    group_limit_ref,
    scores_ref,
    topk_ref,
)

_NEG_INF = float("-inf")


def block_scores_ref(
    logits: torch.Tensor, scoring: str = "softmax", bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A block's score per expert `[E]`: the sum over its tokens of the weight source
    (softmax probabilities), or of the selection scores for sigmoid routers."""
    z, src = scores_ref(logits, scoring, bias)
    return (z if scoring == "sigmoid" else src).sum(0)


def route_block_ref(
    logits: torch.Tensor,
    spec: RouteSpec,
    block_k: int,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block selection over `logits [T, E]` (T tokens of one block), routed as `spec`
    says (its `lam` biases the set toward `mask`, the layer's cache `[E]`).

    Returns `(experts [block_k] ascending ids, weights [T, k] fp32, ids [T, k] int64)`.
    """
    op = "route_block"
    require_spec(op, spec)
    check_float(op, "logits", logits, 2)
    T, E = logits.shape
    if T < 1:
        raise ValueError(f"{op}: a block needs at least one token")
    top_k, lam = spec.top_k, spec.lam
    spec.check(
        op,
        num_experts=E,
        num_tokens=1,
        mask=mask if mask is None else mask.reshape(1, E),
        bias=bias,
    )
    if isinstance(block_k, bool) or not isinstance(block_k, int) or not top_k <= block_k <= E:
        raise ValueError(f"{op}: block_k={block_k!r} must be an int in [top_k={top_k}, E={E}]")
    z, src = scores_ref(logits, spec.scoring, bias)
    m = None if mask is None else mask.reshape(1, E)
    own = None  # [T, E]: each token's own groups (None: no group limit)
    if spec.n_group > 1:
        own = group_limit_ref(z, spec.n_group, spec.topk_group, spec.group_score) > _NEG_INF
        reach = own.any(0)  # some token's groups
        score = (z if spec.scoring == "sigmoid" else src).masked_fill(~own, 0).sum(0)
        # unreached experts ranked last, after the bias (their stand-in keeps its range)
        score = score.masked_fill(~reach, score[reach].min())[None]
        biased = biased_scores_ref(score, m, lam).masked_fill(~reach[None], _NEG_INF)
    else:
        biased = biased_scores_ref(block_scores_ref(logits, spec.scoring, bias)[None], m, lam)
    chosen = topk_ref(biased, block_k)[0]  # [block_k]
    allowed = torch.zeros(E, dtype=torch.bool, device=logits.device)
    allowed[chosen] = True
    key = z.masked_fill(~allowed[None, :], _NEG_INF)
    if own is None:
        ids = topk_ref(key, top_k)
    else:  # S and the token's groups first (by score), then S's other members
        order = topk_ref(key, E)
        first = (own & allowed[None, :]).gather(1, order).to(torch.int8)
        ids = order.gather(1, topk_ref(first, top_k))
    w = gate_weights_ref(src, ids, spec.scoring, spec.renormalize, spec.scaling, spec.norm_min)
    return chosen.sort().values, w, ids.contiguous()


route_block = route_block_ref  # the same torch code serves CPU and CUDA tensors
