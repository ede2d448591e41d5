"""Dense layers whose weights stay in their stored format on the device (issue 39 item 1):
drop-in `nn.Linear` / `nn.Embedding` replacements for a model's attention projections,
shared experts, dense FFN layers, output head and embeddings.

    QuantLinear(qweight, fmt, in_features, scales=, bias=, compute=)   y = x W^T + b
    QuantEmbedding(qweight, fmt, embedding_dim, dtype, scales=)         rows of W, dequantized
    MlaKvB(k, k_fmt, v, v_fmt, heads, compute=)      DeepSeek's kv_b_proj from split blocks
    RowLinear                     a float `nn.Linear` computed by `cpu_linear` on the CPU
    row_invariant(module)         whether a dense module's CPU forward is `cpu_linear`

`qweight` (uint8 `[N, row bytes]`) and `scales` are buffers in `psr_kernels.linear`'s
layout for the `LinearFormat` `fmt` (a GGML block type, or int8 / fp8 / int4 codes with
fp32 scales). `dense_linear` is the one dispatch: Triton on CUDA (`psr_kernels.linear`,
batch-invariant), the CPU kernels on the CPU (`cpu_linear`: each output row bit-identical
for any number of rows; formats without GGML blocks dequantized to fp32 first), the torch
reference elsewhere. The embedding dequantizes only the looked-up rows. A model's float
`nn.Linear` layers become `RowLinear` while its CPU forward is row-invariant
(runtime/model.py: `OffloadedModel.set_row_invariant`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import psr_kernels as pk
from psr.store import cpu_kernels
from psr_kernels._common import CPU_VECTOR_CHUNK
from psr_kernels.linear import LinearFormat


def _cpu_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    fmt: LinearFormat,
    in_features: int,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The CPU path: psr's CPU kernels (`cpu_kernels.cpu_linear`, rows bit-identical for
    any T) over the GGML blocks, or over the fp32 weight dequantized from other formats."""
    if fmt.block is None:
        w = pk.dequantize_weight(qweight, fmt, in_features, scales)
        return rows_linear(x, w, bias, out_dtype)
    y: torch.Tensor = cpu_kernels.cpu_linear(
        x,
        qweight,
        ggml_type=fmt.block.type_id,
        in_features=in_features,
        bias=bias,
        out_dtype=out_dtype,
    )
    return y


def dense_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    fmt: LinearFormat,
    in_features: int,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    compute: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x [T, K] @ W^T (+ bias)` on the compute path `compute` resolves to on x's device
    (`pk.resolve_compute`): Triton, the CPU kernels (torch path on the CPU), or the torch
    reference (torch path elsewhere). While torch.compile traces, its custom op."""
    if torch.compiler.is_compiling() and out_dtype is None:
        y: torch.Tensor = _linear_op(
            x, qweight, scales, bias, fmt.name, fmt.group, in_features, compute
        )
        return y
    out = out_dtype or x.dtype
    if pk.resolve_compute(compute, x.device) == "triton":
        return pk.linear(x, qweight, fmt, in_features, scales, bias, out)
    if x.device.type == "cpu":
        return _cpu_linear(x, qweight, fmt, in_features, scales, bias, out)
    return pk.linear_ref(x, qweight, fmt, in_features, scales, bias, out)


# The dense layers as torch custom ops, so that a compiled forward (graphs on the CPU:
# torch.compile fullgraph) traces through them as opaque calls; eager forwards call the
# functions directly (no custom-op dispatch), as runtime/store_ops.py does.
@torch.library.custom_op("psr_dense::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    fmt: str,
    group: int,
    k: int,
    compute: str,
) -> torch.Tensor:
    return dense_linear(
        x, qweight, LinearFormat.parse(fmt, group or None), k, scales, bias, compute
    )


@_linear_op.register_fake
def _(x, qweight, scales, bias, fmt, group, k, compute):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], qweight.shape[0])


def _heads_t(
    x: torch.Tensor, blocks: torch.Tensor, fmt: LinearFormat, heads: int, compute: str
) -> torch.Tensor:
    """`pk.linear_heads_t` on the compute path `compute` resolves to; on the CPU
    `cpu_linear` over the heads' transposed matrices stacked (every head reads the same x:
    `[heads * C, K]`, rows bit-identical for any T); else its reference."""
    if pk.resolve_compute(compute, x.device) == "triton":
        return pk.linear_heads_t(x, blocks, fmt, heads)
    if x.device.type == "cpu":
        b, k = fmt.block, x.shape[1]
        assert b is not None  # llama.cpp's split MLA blocks
        c = blocks.shape[1] // b.block_bytes * b.block_len
        w = pk.dequantize_weight(blocks, fmt, c).reshape(heads, k, c)
        return rows_linear(x, w.transpose(1, 2).reshape(heads * c, k))
    return pk.linear_heads_t_ref(x, blocks, fmt, heads)


@torch.library.custom_op("psr_dense::heads_t", mutates_args=())
def _heads_t_op(
    x: torch.Tensor, blocks: torch.Tensor, fmt: str, heads: int, compute: str
) -> torch.Tensor:
    return _heads_t(x, blocks, LinearFormat.parse(fmt), heads, compute)


@_heads_t_op.register_fake
def _(x, blocks, fmt, heads, compute):  # type: ignore[no-untyped-def]
    b = LinearFormat.parse(fmt).block
    assert b is not None
    return x.new_empty(x.shape[0], heads * (blocks.shape[1] // b.block_bytes * b.block_len))


@torch.library.custom_op("psr_dense::rows", mutates_args=())
def _rows_op(
    rows: torch.Tensor, scales: torch.Tensor | None, fmt: str, group: int, k: int
) -> torch.Tensor:
    return pk.decode_rows(rows, LinearFormat.parse(fmt, group or None), k, scales)


@_rows_op.register_fake
def _(rows, scales, fmt, group, k):  # type: ignore[no-untyped-def]
    return rows.new_empty(rows.shape[0], k, dtype=torch.float32)


# Rows of a rows_linear output start this many elements apart (psr_kernels' one constant of
# torch's CPU vector chunks): torch's elementwise loops then take every row the same way
# whatever the number of rows (sigmoid over a [T, 1] gate, SiLU over a narrow FFN; the
# routers' row_sigmoid pads to it too). Wider outputs whose width is a multiple of it are
# contiguous as they are.
ROW_ALIGN = CPU_VECTOR_CHUNK


def rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on the CPU by `cpu_linear` (fp32 sums): each row of
    `x [..., K]` computed as it is alone, whatever the other rows. Returns x's dtype (or
    `out_dtype`), contiguous (`row_aligned` for a layer's output)."""
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    if x.numel() == 0:
        return F.linear(x, weight, bias).to(out_dtype or x.dtype)
    y: torch.Tensor = cpu_kernels.cpu_linear(
        x.reshape(-1, k), weight, bias=bias, out_dtype=out_dtype or x.dtype
    )
    return y.reshape(*lead, n)


def row_aligned(y: torch.Tensor) -> torch.Tensor:
    """`y [..., N]` as a view whose rows start ROW_ALIGN elements apart (a copy) where N is
    not a multiple of it; else y."""
    n = y.shape[-1]
    if n % ROW_ALIGN == 0 or y.dim() < 2:
        return y
    wide = -(-n // ROW_ALIGN) * ROW_ALIGN
    return y.new_empty(*y.shape[:-1], wide)[..., :n].copy_(y)


class RowLinear(nn.Linear):
    """A float `nn.Linear` (the same parameters and state dict) whose forward on the CPU is
    `rows_linear`: row-invariant. A model's linears become one by `to_row_linears`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or self.weight.dtype not in cpu_kernels.CPU_FLOAT_DTYPES:
            return F.linear(x, self.weight, self.bias)
        return row_aligned(rows_linear(x, self.weight, self.bias))


def to_row_linears(model: nn.Module, on: bool) -> None:
    """Every plain float `nn.Linear` of `model` made a `RowLinear` (`on`), or back."""
    for m in model.modules():
        if on and type(m) is nn.Linear:
            m.__class__ = RowLinear
        elif not on and type(m) is RowLinear:
            m.__class__ = nn.Linear  # type: ignore[assignment]


def row_invariant(module: nn.Module) -> bool:
    """Whether `module`'s forward on the CPU computes each row as it would alone (its
    forward is `cpu_linear`): a `RowLinear` with float weights the CPU kernels read, and
    psr's dense layers on the CPU (QuantLinear, MlaKvB)."""
    if isinstance(module, RowLinear):
        w = module.weight
        return w.device.type == "cpu" and w.dtype in cpu_kernels.CPU_FLOAT_DTYPES
    if isinstance(module, QuantLinear | MlaKvB):
        w = module.qweight if isinstance(module, QuantLinear) else module.k_blocks
        return w.device.type == "cpu" and pk.resolve_compute(module.compute, w.device) == "torch"
    return False


class QuantLinear(nn.Module):
    """`nn.Linear` over a weight kept in its stored format (`fmt`)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        fmt: LinearFormat,
        in_features: int,
        scales: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        compute: str = "auto",
    ) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, int(in_features), qweight.shape[0]
        self.compute = compute
        self.qweight: torch.Tensor
        self.scales: torch.Tensor | None
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def _cpu_plan(self) -> cpu_kernels.LinearPlan | None:
        """The CPU kernels' prepared call of this layer's GGML blocks (None: another path),
        rebuilt when the weight or the bias tensor was replaced (`.to()`, load_state_dict)."""
        plan: cpu_kernels.LinearPlan | None = self.__dict__.get("_plan")
        if plan is not None and plan.source is self.qweight and plan.bias_source is self.bias:
            return plan
        if self.fmt.block is None or self.qweight.device.type != "cpu":
            return None
        plan = cpu_kernels.LinearPlan(
            self.qweight,
            ggml_type=self.fmt.block.type_id,
            in_features=self.in_features,
            bias=self.bias,
        )
        self.__dict__["_plan"] = plan
        return plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"QuantLinear: x has {x.shape[-1]} features, the layer takes {self.in_features}"
            )
        if (
            x.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and pk.resolve_compute(self.compute, x.device) == "torch"
            and (plan := self._cpu_plan()) is not None
        ):  # dense_linear's CPU path with the weight's checks done once (per token: it counts)
            return row_aligned(plan(x))
        y = dense_linear(
            x.reshape(-1, self.in_features),
            self.qweight,
            self.fmt,
            self.in_features,
            self.scales,
            self.bias,
            self.compute,
        )
        y = y.reshape(*lead, self.out_features)
        return row_aligned(y) if y.device.type == "cpu" and not torch.compiler.is_compiling() else y

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 `[out, in]` (a new tensor: for tests and conversions)."""
        return pk.dequantize_weight(self.qweight, self.fmt, self.in_features, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over rows kept in their stored format: a lookup dequantizes only the
    rows it reads, to `dtype`."""

    def __init__(
        self,
        qweight: torch.Tensor,
        fmt: LinearFormat,
        embedding_dim: int,
        dtype: torch.dtype,
        scales: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.fmt, self.embedding_dim, self.dtype = fmt, int(embedding_dim), dtype
        self.num_embeddings = qweight.shape[0]
        self.qweight: torch.Tensor
        self.scales: torch.Tensor | None
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.qweight.index_select(0, flat)
        s = None if self.scales is None else self.scales.index_select(0, flat)
        fmt, k = self.fmt, self.embedding_dim
        w: torch.Tensor
        if torch.compiler.is_compiling():
            w = _rows_op(rows, s, fmt.name, fmt.group, k)
        else:
            w = pk.decode_rows(rows, fmt, k, s)
        return w.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"


class MlaKvB(nn.Module):
    """DeepSeek's `kv_b_proj` (`[T, rank] -> [T, heads * (nope + v)]`, each head's nope k
    values then its v values) from llama.cpp's split MLA blocks: `k` = attn_k_b's rows
    `[heads * rank, nope]` (the transposed weight: `pk.linear_heads_t`) and `v` = attn_v_b's
    rows `[heads * v, rank]` (a plain linear)."""

    def __init__(
        self,
        k: torch.Tensor,
        k_fmt: LinearFormat,
        v: torch.Tensor,
        v_fmt: LinearFormat,
        heads: int,
        compute: str = "auto",
    ) -> None:
        super().__init__()
        self.k_fmt, self.v_fmt, self.heads, self.compute = k_fmt, v_fmt, int(heads), compute
        self.rank = k.shape[0] // self.heads
        self.k_blocks: torch.Tensor
        self.v_blocks: torch.Tensor
        self.register_buffer("k_blocks", k)
        self.register_buffer("v_blocks", v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.rank)
        if torch.compiler.is_compiling():
            k = _heads_t_op(x2, self.k_blocks, self.k_fmt.name, self.heads, self.compute)
        else:
            k = _heads_t(x2, self.k_blocks, self.k_fmt, self.heads, self.compute)
        v = dense_linear(x2, self.v_blocks, self.v_fmt, self.rank, compute=self.compute)
        t, h = x2.shape[0], self.heads
        y = torch.cat([k.view(t, h, -1), v.view(t, h, -1)], -1)
        return y.reshape(*lead, -1)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, rank={self.rank}, k {self.k_fmt}, v {self.v_fmt}"
