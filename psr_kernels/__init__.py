"""psr_kernels: Triton kernels for cache-biased MoE decoding (depends on torch + triton only).

Ops (each with a plain-torch `*_ref` beside it, the same arguments and results):
  route(logits, top_k, mask=, lam=, scoring=, ...)        -> (weights, ids)
  route_hidden(hidden, gate_weight, top_k, ...)            -> (weights, ids, logits)
  predict_next(residual, norm_weight, gate_weight, n, ...) -> (ids, in_cache)
  expert_ffn(x, slab, slots, weights, H, F)                -> y
Slab layout: pack_expert(gate, up, down) -> row; unpack_expert(row, H, F) -> views.
Compute dispatch (`psr_kernels.dispatch`): resolve_compute(compute, device) ->
"triton" | "torch" and kernel_ops(compute, device) -> the four ops of that path;
compute is "auto" | "triton" | "torch", "auto" honouring the env default PSR_COMPUTE.
Device-dispatching torch ops: torch.ops.psr.{route, route_hidden, predict_next, expert_ffn}
(`psr_kernels.ops`), and `make_vllm_routing_function` for vLLM's FusedMoE.
"""

from psr_kernels.dispatch import (
    Compute,
    ComputePath,
    KernelOps,
    default_compute,
    kernel_ops,
    resolve_compute,
)
from psr_kernels.expert_ffn import expert_ffn, expert_ffn_ref, pack_expert, unpack_expert
from psr_kernels.ops import (
    expert_ffn_op,
    make_vllm_routing_function,
    predict_next_op,
    route_hidden_op,
    route_op,
)
from psr_kernels.routing import (
    SCORINGS,
    RouteSpec,
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
    "Compute",
    "ComputePath",
    "KernelOps",
    "RouteSpec",
    "biased_scores_ref",
    "default_compute",
    "expert_ffn",
    "expert_ffn_op",
    "expert_ffn_ref",
    "kernel_ops",
    "make_vllm_routing_function",
    "pack_expert",
    "predict_next",
    "predict_next_op",
    "predict_next_ref",
    "resolve_compute",
    "rms_norm_ref",
    "route",
    "route_hidden",
    "route_hidden_op",
    "route_hidden_ref",
    "route_op",
    "route_ref",
    "unpack_expert",
]
