"""Dense linear layers on weights kept in their stored format (issue 39 item 1).

    y[T, N] = x[T, K] @ W[N, K]^T (+ bias[N])

W stays as a checkpoint holds it; a `LinearFormat` (parsed once, `LinearFormat.parse`) says
how:

    format              qweight (uint8)        scales (fp32)     value of W[n, k]
    a GGML block type   [N, K / QK * BS]       none              the block's decode
    int8 / fp8 / int4   [N, B(K)]              [N, K / G]        code * scale[n, k // G]

GGML's block types are the expert kernels' (`rowformat.BLOCK_TYPE_TRAITS`: F32 ... IQ1_M,
FP8_B128), decoded per element by the same Triton code (`ggml._ggml_tile`); int8 / fp8 /
int4 are psr's expert codes (`quant`: B(K) = K bytes, or ceil(K / 2) for int4's nibbles)
with a scale per output channel (G = K) or per group of G inputs.

**Batch invariance.** `linear` launches one kernel with fixed tiles (BLOCK_M x BLOCK_N
outputs, BLOCK_K inputs a step, `LINEAR_TILES`) whatever T is, no split-K, no atomics; the
row count is a run-time argument the compiler does not specialise on. Row t of the output
is therefore computed by the same instructions on the same values for any T: bit-identical
whether it is decoded alone or in a batch (tested). Each step dequantizes a weight tile to
fp32 and accumulates `tl.dot` over fp32 x in fp32 (IEEE products, no TF32: a bf16 / fp16 x
is widened exactly; its output rounded once, at the store). `linear_ref` is the torch
reference: the weight dequantized to fp32, `F.linear` in fp32 (for an fp32 model, the float
path's arithmetic bit for bit). Not done: bf16 tensor-core products for prefill (Triton's
interpreter, where the tests run, cannot compute them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from psr_kernels._common import FLOAT_DTYPES, check_launchable
from psr_kernels.ggml import _ggml_tile, decode_ggml, dequantize_ggml, iq_table
from psr_kernels.quant import _fp8_e4m3_to_f32
from psr_kernels.rowformat import (
    BLOCK_TYPE_TRAITS,
    BLOCK_TYPES,
    FP8,
    QUANT_FORMATS,
    BlockType,
    RowFormat,
    quant_format,
)

# The one tile configuration (batch invariance: never chosen from T).
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 16, 32, 128, 4
LINEAR_TILES = (BLOCK_M, BLOCK_N, BLOCK_K)


@dataclass(frozen=True)
class LinearFormat:
    """How a dense weight is stored: a GGML block type, or psr's int8 / fp8 / int4 codes
    with fp32 scales per group of `group` inputs (0: one scale per output channel)."""

    name: str  # "Q4_K", "int8", ...
    block: BlockType | None = None
    quant: RowFormat | None = None
    group: int = 0

    def __str__(self) -> str:
        return self.name if not self.group else f"{self.name}/g{self.group}"

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def parse(word: str, group_size: int | None = None) -> LinearFormat:
        """The format of a GGML type name (`BLOCK_TYPES`) or "int8" / "fp8" / "int4"
        (`group_size`: scales per that many inputs; None: per output channel, int8 / fp8
        only)."""
        if word in BLOCK_TYPE_TRAITS:
            if group_size is not None:
                raise ValueError(f"LinearFormat: {word} blocks carry their own scales")
            return LinearFormat(word, block=BLOCK_TYPE_TRAITS[word])
        if word in QUANT_FORMATS:
            q = quant_format("LinearFormat", word)
            if q.grouped and group_size is None:
                raise ValueError(f"LinearFormat: {word} needs a group_size")
            if group_size is not None and (group_size < 16 or group_size & (group_size - 1)):
                raise ValueError(
                    f"LinearFormat: group_size must be a power of two >= 16, got {group_size}"
                )
            return LinearFormat(word, quant=q, group=group_size or 0)
        raise ValueError(
            f"LinearFormat: {word!r} is not a dense weight format psr computes (GGML types "
            f"{', '.join(BLOCK_TYPES)}, or {', '.join(QUANT_FORMATS)})"
        )

    def group_of(self, k: int) -> int:
        """The scale group along rows of `k` inputs (quant formats)."""
        return self.group or k

    def row_bytes(self, k: int) -> int:
        """Bytes of one stored row of `k` inputs (the codes; scales apart)."""
        if self.block is not None:
            return self.block.row_bytes(k)
        if k % self.group_of(k):
            raise ValueError(f"LinearFormat: group {self.group} does not divide {k} inputs")
        return (k + 1) // 2 if self.quant is not None and self.quant.grouped else k

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """Shape of the fp32 scales of an [n, k] weight ((n, 0) for GGML blocks)."""
        return (n, 0) if self.block is not None else (n, k // self.group_of(k))

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of an [n, k] weight as stored (codes and scales)."""
        s = self.scale_shape(n, k)
        return n * self.row_bytes(k) + 4 * s[0] * s[1]


def _check_weight(
    op: str, qweight: torch.Tensor, fmt: LinearFormat, k: int, scales: torch.Tensor | None
) -> None:
    rb = fmt.row_bytes(k)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != rb:
        raise ValueError(
            f"{op}: a {fmt} weight of {k} inputs is uint8 [N, {rb}], got {qweight.dtype} "
            f"{list(qweight.shape)}"
        )
    want = fmt.scale_shape(qweight.shape[0], k)
    if fmt.quant is not None and (
        scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != want
    ):
        got = None if scales is None else f"{scales.dtype} {list(scales.shape)}"
        raise ValueError(f"{op}: {fmt} needs fp32 scales {list(want)}, got {got}")


def _check_x(op: str, x: torch.Tensor, k: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{op}: x must be [T, {k}], got {getattr(x, 'shape', type(x))}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")


def quantize_weight(w: torch.Tensor, fmt: LinearFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8, scales fp32) of float `w [N, K]` in int8 / fp8 / int4 (symmetric,
    the expert codes' rounding: `quant`'s quantizer)."""
    from psr_kernels.quant import _quantize_matrix

    if fmt.quant is None:
        raise ValueError(f"quantize_weight: {fmt} is read from a file, not quantized by psr")
    n, k = w.shape
    codes, scales = _quantize_matrix(w.detach().float().cpu(), fmt.quant, fmt.group_of(k))
    return codes.to(w.device), scales.reshape(n, -1).to(w.device)


def dequantize_weight(
    qweight: torch.Tensor, fmt: LinearFormat, k: int, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 `[R, k]` of stored rows `qweight [R, row_bytes]` (any R: a gathered subset's
    scales beside it): the reference dequantizer."""
    _check_weight("dequantize_weight", qweight, fmt, k, scales)
    r = qweight.shape[0]
    if fmt.block is not None:
        return dequantize_ggml(qweight.contiguous(), fmt.name, (r, k))
    assert scales is not None and fmt.quant is not None  # _check_weight
    if fmt.quant.grouped:
        b = qweight.to(torch.int32)
        n = torch.stack([b & 0xF, b >> 4], -1).reshape(r, -1)[:, :k]
        q = ((n ^ 8) - 8).float()
    elif fmt.quant == FP8:
        q = qweight.view(torch.float8_e4m3fn).float()
    else:
        q = qweight.view(torch.int8).float()
    g = fmt.group_of(k)
    return (q.reshape(r, k // g, g) * scales[..., None]).reshape(r, k)


def decode_rows(
    qweight: torch.Tensor, fmt: LinearFormat, k: int, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """`dequantize_weight` where Triton runs (GGML blocks by the kernels' element decoder,
    no host tensor built per call: CUDA graphs capture it), the reference elsewhere."""
    if qweight.device.type == "cuda" and fmt.block is not None:
        return decode_ggml(qweight, fmt.name, (qweight.shape[0], k))
    return dequantize_weight(qweight, fmt, k, scales)


def linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    fmt: LinearFormat,
    in_features: int,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The torch reference of `linear`: W dequantized to fp32, cast to x's dtype,
    `F.linear` (the float path's arithmetic)."""
    _check_x("linear_ref", x, in_features)
    w = dequantize_weight(qweight, fmt, in_features, scales)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(out_dtype or x.dtype)


@triton.jit
def _quant_tile(rows, k, m, s_rows, G, QFMT: tl.constexpr):
    """fp32 weights at columns `k` ([1, BK]) of int8 (QFMT 0) / fp8 (1) / int4 (2) code rows
    at byte pointers `rows` ([R, 1]), times their scales (fp32 pointers `s_rows`, a scale per
    G columns); masked elements read as 0."""
    if QFMT == 0:
        q = tl.load(rows.to(tl.pointer_type(tl.int8)) + k, mask=m, other=0).to(tl.float32)
    elif QFMT == 1:
        q = _fp8_e4m3_to_f32(tl.load(rows + k, mask=m, other=0).to(tl.int32))
    else:
        b = tl.load(rows + k // 2, mask=m, other=0).to(tl.int32)
        q = ((((b >> (4 * (k % 2))) & 0xF) ^ 8) - 8).to(tl.float32)
    return q * tl.load(s_rows + k // G, mask=m, other=0.0)


@triton.jit(do_not_specialize=["T"])
def _linear_kernel(
    x_ptr,
    s_xt,
    w_ptr,  # uint8 [N, RB]
    RB,
    s_ptr,  # fp32 [N, NG] scales (IS_BLOCKS false)
    G,
    NG,
    b_ptr,  # [N] bias (HAS_BIAS)
    y_ptr,
    s_yt,
    T,  # rows of x: never specialised on, so any T runs the same code (batch invariance)
    N,
    K,
    C,  # TRANS_W: outputs per head (the stored rows' length)
    tab_ptr,  # the IQ types' grids and signs (`ggml.iq_table`)
    IS_BLOCKS: tl.constexpr,  # GGML blocks (WTYPE) or psr's codes with scales (QFMT)
    WTYPE: tl.constexpr,
    QFMT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TRANS_W: tl.constexpr,  # blocks of heads' W_h^T: output n of head n // C is column n % C
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = ms < T
    nm = ns < N
    rows = w_ptr + ns[:, None].to(tl.int64) * RB
    s_rows = s_ptr.to(tl.pointer_type(tl.float32)) + ns[:, None].to(tl.int64) * NG
    x_rows = x_ptr + ms[:, None].to(tl.int64) * s_xt
    head_rows = w_ptr + ((ns // C) * K)[None, :].to(tl.int64) * RB  # TRANS_W: row h * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one order for every T: no split-K
        ks = k0 + tl.arange(0, BLOCK_K)[None, :]
        km = ks < K
        x = tl.load(x_rows + ks, mask=mm[:, None] & km, other=0.0).to(tl.float32)
        if TRANS_W:  # w [BK, BN]: stored row h * K + k, column n % C
            kc = k0 + tl.arange(0, BLOCK_K)[:, None]
            wm = (kc < K) & nm[None, :]
            w = _ggml_tile(head_rows + kc.to(tl.int64) * RB, (ns % C)[None, :], wm, tab_ptr, WTYPE)
        else:
            wm = nm[:, None] & km
            if IS_BLOCKS:
                w = _ggml_tile(rows, ks, wm, tab_ptr, WTYPE)
            else:
                w = _quant_tile(rows, ks, wm, s_rows, G, QFMT)
            w = tl.trans(w)
        acc = tl.dot(x, w, acc, input_precision="ieee")  # fp32 products, no TF32
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=nm, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + ms[:, None].to(tl.int64) * s_yt + ns[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    fmt: LinearFormat,
    in_features: int,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x [T, K] @ W^T (+ bias)` with W read in its stored format (module doc): one Triton
    launch, fixed tiles, row t bit-identical for any T. `out_dtype` defaults to x's."""
    op = "linear"
    _check_x(op, x, in_features)
    _check_weight(op, qweight, fmt, in_features, scales)
    n = qweight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op}: bias must be [{n}], got {list(bias.shape)}")
    dev = check_launchable(op, x, qweight, scales, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    w = qweight if qweight.is_contiguous() else qweight.contiguous()
    y = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype, device=dev)
    if x.shape[0] == 0 or n == 0:
        return y
    s = scales if scales is not None else torch.empty(1, dtype=torch.float32, device=dev)
    _launch(x, w, fmt, in_features, s, bias, y, n, 1)
    return y


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    fmt: LinearFormat,
    k: int,
    s: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    n: int,
    cols: int,
    trans: bool = False,
) -> None:
    """The one launch of `_linear_kernel` (fixed tiles) for `n` outputs."""
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _linear_kernel[grid](
        x, x.stride(0), w, w.shape[1], s.contiguous(), fmt.group_of(k),
        s.shape[-1] if fmt.block is None else 1, bias if bias is not None else s, y,
        y.stride(0), x.shape[0], n, k, cols, iq_table(y.device),
        **linear_constexprs(fmt, bias is not None, trans), num_warps=NUM_WARPS,
    )  # fmt: skip


def linear_constexprs(fmt: LinearFormat, has_bias: bool, trans: bool) -> dict[str, object]:
    """`_linear_kernel`'s constexprs for `fmt` (what `linear` launches and the cubin-compile
    test compiles): the format's flags and the fixed tiles, never T."""
    block, quant = fmt.block, fmt.quant
    return dict(
        IS_BLOCKS=block is not None,
        WTYPE=block.type_id if block is not None else -1,
        QFMT=quant.code if quant is not None else -1,
        HAS_BIAS=has_bias,
        TRANS_W=trans,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def _check_heads(op: str, qweight: torch.Tensor, fmt: LinearFormat, heads: int) -> tuple[int, int]:
    """(K, C) of blocks holding `heads` matrices W_h^T [K, C] (rows h * K + k)."""
    if fmt.block is None or qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"{op}: the heads' blocks are GGML rows, uint8 [heads * K, row bytes]")
    if heads < 1 or qweight.shape[0] % heads:
        raise ValueError(f"{op}: {qweight.shape[0]} rows are not {heads} heads' matrices")
    c = qweight.shape[1] // fmt.block.block_bytes * fmt.block.block_len
    if fmt.row_bytes(c) != qweight.shape[1]:
        raise ValueError(f"{op}: rows of {qweight.shape[1]} bytes are not whole {fmt} blocks")
    return qweight.shape[0] // heads, c


def linear_heads_t_ref(
    x: torch.Tensor, qweight: torch.Tensor, fmt: LinearFormat, heads: int
) -> torch.Tensor:
    """The reference of `linear_heads_t`: W dequantized to fp32, one matmul per head."""
    k, c = _check_heads("linear_heads_t_ref", qweight, fmt, heads)
    _check_x("linear_heads_t_ref", x, k)
    w = dequantize_weight(qweight, fmt, c).reshape(heads, k, c)
    y = torch.einsum("tk,hkc->thc", x.float(), w)
    return y.reshape(x.shape[0], heads * c).to(x.dtype)


def linear_heads_t(
    x: torch.Tensor, qweight: torch.Tensor, fmt: LinearFormat, heads: int
) -> torch.Tensor:
    """`y[t, h * C + c] = sum_k x[t, k] W_h[k, c]` for `heads` matrices W_h `[K, C]` stored
    as GGML rows `h * K + k` (llama.cpp's split MLA `attn_k_b [heads, rank, nope]`: the
    transposed weight DeepSeek's kv_b_proj applies), the same kernel and batch invariance
    as `linear`."""
    op = "linear_heads_t"
    k, c = _check_heads(op, qweight, fmt, heads)
    _check_x(op, x, k)
    dev = check_launchable(op, x, qweight)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], heads * c, dtype=x.dtype, device=dev)
    if x.shape[0]:
        s = torch.empty(1, dtype=torch.float32, device=dev)
        _launch(x, qweight.contiguous(), fmt, k, s, None, y, heads * c, c, trans=True)
    return y
