"""psr_kernels: Triton kernels for cache-biased MoE decoding (depends on torch + triton only).

Ops (each with a plain-torch `*_ref` beside it, the same arguments and results):
  route(logits, spec, mask=, bias=)                         -> (weights, ids)
  route_hidden(hidden, gate_weight, spec, mask=, bias=)     -> (weights, ids, logits)
  route_counted(logits, spec, mask=, bias=)                 -> (weights, ids, substituted)
      substituted [T]: chosen ids not in the same scores' exact (unbiased) top-k
  predict_next(residual, norm_weight, gate_weight, n, spec,
               eps=, mask=, bias=)                          -> (ids, in_cache)
  expert_ffn(x, slab, slots, weights, H, F, fmt=, slot_table=) -> y
      fmt None: float slab rows; 'int8' | 'fp8' | 'int4': quantized uint8 rows;
      slot_table: slots hold expert ids, looked up in the device slot map
  grouped_expert_ffn(x, slab, ids, weights, H, F, fmt=, slot_table=, bias=) -> y
      prefill's grouped dequant-GEMM: the routed pairs sorted by expert, tiles of one
      expert's tokens x its rows (tl.dot), every row format (psr_kernels.grouped_ffn)
  decode_step(logits, spec, state, layout, layer, n=, residual=, ...) -> (weights, ids)
      one MoE layer's sync-free decode step in one launch: route on the device cache,
      `use`, and predict + `prefetch` into the next layer (psr_kernels.decode)
  route_block(logits, spec, block_k, mask=, bias=)          -> (set, weights, ids)
      one expert set per block of tokens (speculative verification; torch on any device)
`spec` is a `RouteSpec` (frozen): top_k, lam (the cache bias; 0 = exact routing),
scoring (SCORINGS), renormalize, n_group / topk_group, scaling. The routing references
live in `psr_kernels.routing_ref`; `swiglu_ref` is the one SwiGLU reference formula and
`expert_row_ffn_ref(x, row, H, F, fmt=)` runs one expert from one row.
Device-resident logical caches (`psr_kernels.cache_state`): CacheLayout(E, S, k, n),
new_state, reset_layer, cache_use / cache_prefetch (the spec's `use` / `prefetch` as
kernels; references in `psr_kernels.cache_state_ref`), copy lists for the store's gather.
Expert row formats (`psr_kernels.rowformat`, one table): RowFormat.parse(word) -> the
format (NATIVE, BF16, INT8, FP8, INT4, or GGUF's blocks per part); fmt.layout(H, F, group)
-> where each part sits (FloatLayout | QuantLayout | GGMLLayout); fmt.cpu_layout(...) ->
CpuLayout (the CPU kernels'); expert_ffn.dequantize_rows(fmt, rows, H, F) -> the
reference's matrices;
BlockType traits of GGML's block types (BLOCK_TYPE_TRAITS). `fmt=` takes a RowFormat or
its word everywhere.
Slab layout: pack_expert(gate, up, down) -> row; unpack_expert(row, H, F) -> views.
Quantized rows (`psr_kernels.quant`, fmt in QUANT_FORMATS = int8, fp8, int4):
quantize_expert(gate, up, down, fmt) -> uint8 row; dequantize_expert(row, H, F, fmt) ->
fp32 matrices; QuantLayout.of(fmt, H, F) -> byte offsets; bytes_ratio(fmt, H, F).
GGUF's blocks as they are (`psr_kernels.ggml`, GGML_TYPES: F32 F16 BF16 Q8_0 Q4_0 Q4_1
Q5_0 Q5_1 Q4_K Q5_K Q6_K MXFP4): fmt = ggml_format(gate, up, down) ("gguf:Q4_K,Q4_K,Q6_K");
GGMLLayout.of(fmt, H, F); pack_ggml_expert(lay, [gate, up, down bytes]) -> row;
dequantize_ggml(bytes, type, shape) -> fp32 (the reference; decode_ggml: the kernels').
Block-wise FP8 checkpoints (128 x 128 tile scales) as blocks: pack_fp8_b128 -> FP8_B128 rows.
Dense layers on stored weights (`psr_kernels.linear`): LinearFormat.parse("Q4_K" | "int8",
group) -> fmt; linear(x, qweight, fmt, K, scales=, bias=) -> x W^T (Triton, batch-invariant:
row t bit-identical for any T); linear_ref (torch); dequantize_weight / decode_rows -> fp32
rows; quantize_weight(w, fmt) -> (codes, scales) for int8 / fp8 / int4; linear_heads_t(x,
blocks, fmt, heads) -> x W_h per head for transposed blocks (MLA's split attn_k_b).
Compute dispatch (`psr_kernels.dispatch`): resolve_compute(compute, device) ->
"triton" | "torch" and kernel_ops(compute, device) -> the ops of that path;
compute is "auto" | "triton" | "torch", "auto" honouring the env default PSR_COMPUTE.
Device-dispatching torch ops (`psr_kernels.ops`): torch.ops.psr.{route, route_hidden,
predict_next, expert_ffn} (primitive schemas: RouteSpec's fields as arguments), and
`make_vllm_routing_function` for vLLM's FusedMoE.
"""

from psr_kernels._common import NonFiniteError, interpreting
from psr_kernels.activation import ACTIVATIONS, SILU, Activation
from psr_kernels.block_routing import block_scores_ref, route_block, route_block_ref
from psr_kernels.cache_state import CacheLayout, cache_prefetch, cache_use
from psr_kernels.cache_state_ref import cache_prefetch_ref, cache_use_ref
from psr_kernels.decode import decode_step, decode_step_ref
from psr_kernels.dispatch import (
    Compute,
    ComputePath,
    KernelOps,
    default_compute,
    kernel_ops,
    resolve_compute,
)
from psr_kernels.expert_ffn import (
    expert_ffn,
    expert_ffn_ref,
    expert_row_ffn_ref,
    pack_expert,
    swiglu_ref,
    unpack_expert,
)
from psr_kernels.ggml import (
    decode_ggml,
    dequantize_ggml,
    dequantize_ggml_expert,
    ggml_format,
    ggml_row_bytes,
    ggml_type_id,
    ggml_types,
    pack_fp8_b128,
    pack_ggml_expert,
    pack_ggml_parts,
)
from psr_kernels.grouped_ffn import grouped_expert_ffn, grouped_expert_ffn_ref
from psr_kernels.linear import (
    LinearFormat,
    decode_rows,
    dequantize_weight,
    linear,
    linear_heads_t,
    linear_heads_t_ref,
    linear_ref,
    quantize_weight,
)
from psr_kernels.ops import (
    expert_ffn_op,
    make_vllm_routing_function,
    predict_next_op,
    route_hidden_op,
    route_op,
)
from psr_kernels.quant import (
    bytes_ratio,
    dequantize_expert,
    quantize_expert,
)
from psr_kernels.routing import (
    GROUP_SCORES,
    SCORINGS,
    RouteSpec,
    predict_next,
    route,
    route_counted,
    route_hidden,
)
from psr_kernels.routing_ref import (
    biased_scores_ref,
    predict_next_ref,
    rms_norm_ref,
    route_counted_ref,
    route_hidden_ref,
    route_ref,
    substituted_ref,
)
from psr_kernels.rowformat import (
    BF16,
    BLOCK_TYPE_TRAITS,
    BLOCK_TYPES,
    EXPERT_FORMATS,
    FP8,
    GGML_TYPES,
    INT4,
    INT8,
    NATIVE,
    QUANT_FORMATS,
    BlockType,
    CpuLayout,
    FloatLayout,
    FormatLike,
    GGMLLayout,
    QuantLayout,
    RowFormat,
    RowKind,
    RowLayout,
    is_ggml_format,
)

__all__ = [
    "ACTIVATIONS",
    "BF16",
    "BLOCK_TYPES",
    "BLOCK_TYPE_TRAITS",
    "EXPERT_FORMATS",
    "FP8",
    "GGML_TYPES",
    "GROUP_SCORES",
    "INT4",
    "INT8",
    "NATIVE",
    "QUANT_FORMATS",
    "SCORINGS",
    "SILU",
    "Activation",
    "BlockType",
    "CacheLayout",
    "Compute",
    "ComputePath",
    "CpuLayout",
    "FloatLayout",
    "FormatLike",
    "GGMLLayout",
    "KernelOps",
    "LinearFormat",
    "NonFiniteError",
    "QuantLayout",
    "RouteSpec",
    "RowFormat",
    "RowKind",
    "RowLayout",
    "biased_scores_ref",
    "block_scores_ref",
    "bytes_ratio",
    "cache_prefetch",
    "cache_prefetch_ref",
    "cache_use",
    "cache_use_ref",
    "decode_ggml",
    "decode_rows",
    "decode_step",
    "decode_step_ref",
    "default_compute",
    "dequantize_expert",
    "dequantize_ggml",
    "dequantize_ggml_expert",
    "dequantize_weight",
    "expert_ffn",
    "expert_ffn_op",
    "expert_ffn_ref",
    "expert_row_ffn_ref",
    "ggml_format",
    "ggml_row_bytes",
    "ggml_type_id",
    "ggml_types",
    "grouped_expert_ffn",
    "grouped_expert_ffn_ref",
    "interpreting",
    "is_ggml_format",
    "kernel_ops",
    "linear",
    "linear_heads_t",
    "linear_heads_t_ref",
    "linear_ref",
    "make_vllm_routing_function",
    "pack_expert",
    "pack_fp8_b128",
    "pack_ggml_expert",
    "pack_ggml_parts",
    "predict_next",
    "predict_next_op",
    "predict_next_ref",
    "quantize_expert",
    "quantize_weight",
    "resolve_compute",
    "rms_norm_ref",
    "route",
    "route_block",
    "route_block_ref",
    "route_counted",
    "route_counted_ref",
    "route_hidden",
    "route_hidden_op",
    "route_hidden_ref",
    "route_op",
    "route_ref",
    "substituted_ref",
    "swiglu_ref",
    "unpack_expert",
]
