"""psr_kernels: Triton kernels for cache-biased MoE decoding (depends on torch + triton only).

Ops (each with a plain-torch `*_ref` beside it, the same arguments and results):
  route(logits, top_k, mask=, lam=, scoring=, ...)        -> (weights, ids)
  route_hidden(hidden, gate_weight, top_k, ...)            -> (weights, ids, logits)
  predict_next(residual, norm_weight, gate_weight, n, ...) -> (ids, in_cache)
  expert_ffn(x, slab, slots, weights, H, F)                -> y
  expert_ffn_quant(x, slab, slots, weights, H, F, fmt)     -> y   (uint8 quantized slab)
  route_block(logits, top_k, block_k, mask=, lam=, ...)    -> (set, weights, ids)
      one expert set per block of tokens (speculative verification; torch on any device)
Slab layout: pack_expert(gate, up, down) -> row; unpack_expert(row, H, F) -> views.
Quantized rows (`psr_kernels.quant`, fmt in QUANT_FORMATS = int8, fp8, int4):
quantize_expert(gate, up, down, fmt) -> uint8 row; dequantize_expert(row, H, F, fmt) ->
fp32 matrices; QuantLayout.of(fmt, H, F) -> byte offsets; bytes_ratio(fmt, H, F).
Compute dispatch (`psr_kernels.dispatch`): resolve_compute(compute, device) ->
"triton" | "torch" and kernel_ops(compute, device) -> the ops of that path;
compute is "auto" | "triton" | "torch", "auto" honouring the env default PSR_COMPUTE.
Device-dispatching torch ops (`psr_kernels.ops`): torch.ops.psr.{route, route_hidden,
predict_next, expert_ffn, expert_ffn_quant}, and `make_vllm_routing_function` for
vLLM's FusedMoE.
"""

from psr_kernels.block_routing import block_scores_ref, route_block, route_block_ref
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
    expert_ffn_quant_op,
    make_vllm_routing_function,
    predict_next_op,
    route_hidden_op,
    route_op,
)
from psr_kernels.quant import FORMATS as QUANT_FORMATS
from psr_kernels.quant import (
    QuantLayout,
    bytes_ratio,
    dequantize_expert,
    expert_ffn_quant,
    expert_ffn_quant_ref,
    quantize_expert,
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
    "QUANT_FORMATS",
    "SCORINGS",
    "Compute",
    "ComputePath",
    "KernelOps",
    "QuantLayout",
    "RouteSpec",
    "biased_scores_ref",
    "block_scores_ref",
    "bytes_ratio",
    "default_compute",
    "dequantize_expert",
    "expert_ffn",
    "expert_ffn_op",
    "expert_ffn_quant",
    "expert_ffn_quant_op",
    "expert_ffn_quant_ref",
    "expert_ffn_ref",
    "kernel_ops",
    "make_vllm_routing_function",
    "pack_expert",
    "predict_next",
    "predict_next_op",
    "predict_next_ref",
    "quantize_expert",
    "resolve_compute",
    "rms_norm_ref",
    "route",
    "route_block",
    "route_block_ref",
    "route_hidden",
    "route_hidden_op",
    "route_hidden_ref",
    "route_op",
    "route_ref",
    "unpack_expert",
]
