"""psr_kernels: Triton kernels for cache-biased MoE decoding (depends on torch + triton only).

Ops (each with a plain-torch `*_ref` beside it):
  route(logits, top_k, mask=, lam=, scoring=, ...)        -> (weights, ids)
  route_hidden(hidden, gate_weight, top_k, ...)            -> (weights, ids, logits)
  predict_next(residual, norm_weight, gate_weight, n, ...) -> (ids, in_cache)
  expert_ffn(x, slab, slots, weights, H, F)                -> y
Device-dispatching torch ops: torch.ops.psr.{route, route_hidden, predict_next, expert_ffn}
(`psr_kernels.ops`), and `make_vllm_routing_function` for vLLM's FusedMoE.
"""

from psr_kernels.expert_ffn import expert_ffn, expert_ffn_ref, pack_expert
from psr_kernels.ops import (
    expert_ffn_op,
    make_vllm_routing_function,
    predict_next_op,
    route_hidden_op,
    route_op,
)
from psr_kernels.routing import (
    SCORINGS,
    biased_scores_ref,
    predict_next,
    predict_next_ref,
    rms_norm_ref,
    route,
    route_hidden,
    route_hidden_ref,
    route_ref,
)

__all__ = [
    "SCORINGS",
    "biased_scores_ref",
    "expert_ffn",
    "expert_ffn_op",
    "expert_ffn_ref",
    "make_vllm_routing_function",
    "pack_expert",
    "predict_next",
    "predict_next_op",
    "predict_next_ref",
    "rms_norm_ref",
    "route",
    "route_hidden",
    "route_hidden_op",
    "route_hidden_ref",
    "route_op",
    "route_ref",
]
