"""The CPU expert kernels' Python API (csrc/cpu/expert_gemv.h through `psr._C`): checked
calls on torch tensors, the format table's CPU layout, the machine's ISA paths and thread cap.
One of the two modules of `psr.store`, the package that touches the extension.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

import psr._C as _C
from psr.vocab import cpu_dot_choice

if TYPE_CHECKING:
    from psr_kernels.rowformat import RowFormat

# The batch-1 (and small-T) routed expert FFN of csrc/cpu/expert_gemv.h, reading packed
# expert rows (a slab or the host rows) in place: no gather copy. Same math as
# psr_kernels.expert_ffn_ref (fp32 accumulation, weights widened or dequantized on the
# fly), with a fixed reduction order: bit-identical run to run and for any thread count
# on one ISA path (different paths round differently).

CPU_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
CPU_ACTIVATIONS: tuple[str, ...] = ("swiglu", "swiglu_oai")
_INDEX_DTYPES = (torch.int32, torch.int64)

# How GGML rows meet their activations (CPU_DOTS; csrc/cpu/expert_gemv.h's `Dot`): 'f32'
# (fp32 activations, blocks decoded to fp32), 'q8' (each activation row quantized once per
# call to its weights' vec_dot type, Q8_K / Q8_0, then integer block dots: ggml_qdot.h, as
# llama.cpp), 'q8_madd' (q8 without AVX-512 VNNI's instruction: the same bits; for tests),
# 'auto' (q8 for the types where it is measured faster on the path: expert_gemv.h's
# q8_by_default). Process-wide like the thread count (`psr.load(..., cpu_dot=...)` sets
# it); a call's `dot` overrides it.
_cpu_dot = ["auto"]


def set_cpu_dot(dot: str) -> None:
    """Sets the process-wide default `dot` of cpu_expert_ffn / cpu_linear (CPU_DOTS), and
    of the extension's own calls (the store's CPU hand-off of a decode token's experts)."""
    _cpu_dot[0] = _check_dot(dot)
    _C.set_cpu_dot(_cpu_dot[0])


def cpu_dot() -> str:
    """The process-wide default `dot` (CPU_DOTS)."""
    return _cpu_dot[0]


def _check_dot(dot: object) -> str:
    return cpu_dot_choice(dot)


# The q8 path's activation block types (GGML ids; BlockType.vec_dot): values, bytes a block.
ACT_BLOCKS: dict[int, tuple[int, int]] = {15: (256, 292), 8: (32, 34)}  # Q8_K, Q8_0


def cpu_quantize_act(x: torch.Tensor, act: int, isa: str = "auto") -> torch.Tensor:
    """One activation row `x [K]` quantized as the q8 path quantizes it (csrc/cpu/ggml_qdot.h:
    `act` 15 = Q8_K, 8 = Q8_0; K whole blocks) on ISA path `isa`: its bytes (uint8)."""
    if act not in ACT_BLOCKS:
        raise ValueError(f"cpu_quantize_act: act must be 15 (Q8_K) or 8 (Q8_0), got {act!r}")
    qk, bs = ACT_BLOCKS[act]
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] % qk or x.shape[0] < 1:
        raise ValueError(f"cpu_quantize_act: x must be a 1-D tensor of whole blocks of {qk}")
    xf = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0] // qk * bs, dtype=torch.uint8)
    _C.cpu_quantize_act(act, xf.data_ptr(), x.shape[0], out.data_ptr(), isa)
    return out


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (the q8 path's vpdpbusd)."""
    return bool(_C.cpu_has_vnni())


def cpu_isas() -> list[str]:
    """The ISA paths of the CPU expert kernels this CPU runs, best last ('scalar' always;
    'avx2', 'avx512' where the CPU has them: chosen at run time)."""
    return list(_C.cpu_isas())


@functools.cache
def cpu_max_threads() -> int:
    """The most threads the CPU expert kernels take: this machine's hardware threads (read
    once: the kernels check it on every call)."""
    return int(_C.cpu_max_threads())


def cpu_triad(n: int, threads: int = 1, reps: int = 5) -> float:
    """Best bytes/s of a STREAM triad `a = b + s * c` over n floats (12 n bytes per pass),
    on the CPU kernels' thread pool with `threads` threads: what a memory-bound kernel can
    reach on this machine."""
    return float(_C.cpu_triad(n, threads, reps))


def cpu_layout(
    fmt: RowFormat | str | None,
    dtype: torch.dtype,
    hidden: int,
    ffn: int,
    group_size: int,
    row_bytes: int,
) -> tuple[int, ...]:
    """The CPU kernels' layout of expert rows of `fmt` (None: float rows of `dtype`), as
    `ExpertStore.cpu_experts_setup` takes it (ValueError if the rows' bytes disagree)."""
    return _cpu_layout(_row_format(fmt), dtype, hidden, ffn, group_size, row_bytes)


def _row_format(fmt: RowFormat | str | None) -> RowFormat:
    """The kernels' `fmt` as its RowFormat (here: importing the store needs no kernels)."""
    from psr_kernels.rowformat import RowFormat

    return RowFormat.of_kernel("cpu_expert_ffn", fmt)


@functools.lru_cache(maxsize=256)
def _cpu_layout(
    fmt: RowFormat, dtype: torch.dtype, hidden: int, ffn: int, group_size: int, row_bytes: int
) -> tuple[int, ...]:
    """The integers csrc/cpu/expert_gemv.h's `Layout` is read from (the format table's
    `CpuLayout`: one source of truth)."""
    return fmt.cpu_layout(dtype, hidden, ffn, group_size, row_bytes).ints()


def _check_cpu_tensor(name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() != dims:
        raise ValueError(f"cpu_expert_ffn: {name} must be a {dims}-D CPU tensor")
    return t


def _check_cpu_rows(rows: object, fmt: RowFormat) -> torch.Tensor:
    rows = _check_cpu_tensor("rows", rows, 2)
    if fmt.is_float and rows.dtype not in CPU_FLOAT_DTYPES:
        raise ValueError(
            f"cpu_expert_ffn: float rows must be float32, bfloat16 or float16, got {rows.dtype}"
        )
    if not fmt.is_float and rows.dtype != torch.uint8:
        raise ValueError(
            f"cpu_expert_ffn: rows of format {fmt} must be uint8, got {rows.dtype} rows"
        )
    if rows.shape[0] < 1 or rows.stride(1) != 1:
        raise ValueError("cpu_expert_ffn: rows must be non-empty with contiguous rows")
    return rows


def cpu_expert_ffn(
    x: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    fmt: RowFormat | str | None = None,
    group_size: int = 128,
    slot_table: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str = "auto",
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    out_dtype: torch.dtype | None = None,
    skip_absent: bool = False,
    dot: str | None = None,
) -> torch.Tensor:
    """Routed experts of `x [T, H]` computed on the CPU from packed expert rows, in place.

    Args: as psr_kernels.expert_ffn: `rows` `[C, 3*H*F]` float rows (float32 / bfloat16 /
    float16) or `[C, nbytes]` uint8 rows of a quantized `fmt`; `slots`, `weights` `[T, k]`;
    `slot_table` `[E]` (then `slots` holds expert ids). `threads` (default
    kernel_threads()) in [1, cpu_max_threads()]; `isa` 'auto' or one of
    cpu_isas(); `activation` 'swiglu' or 'swiglu_oai' (gpt-oss's clamped SwiGLU with
    `alpha`, `limit`). Every id and slot is checked (IndexError); a row is never read
    past its end. `skip_absent` (with a slot_table): an expert whose slot is -1 is absent
    (computed elsewhere: experts_on's CPU part) and contributes nothing. Returns `[T, H]`
    in `out_dtype` (default x's dtype). `dot` (GGML rows): one of CPU_DOTS, default cpu_dot().
    """
    dot = _check_dot(cpu_dot() if dot is None else dot)
    rf = _row_format(fmt)
    rows = _check_cpu_rows(rows, rf)
    x = _check_cpu_tensor("x", x, 2)
    if x.shape[1] != hidden_size or not x.is_floating_point():
        raise ValueError(f"cpu_expert_ffn: x must be float [T, {hidden_size}], got {list(x.shape)}")
    slots = _check_cpu_tensor("slots", slots, 2)
    weights = _check_cpu_tensor("weights", weights, 2)
    if slots.dtype not in _INDEX_DTYPES or slots.shape[0] != x.shape[0]:
        raise ValueError(f"cpu_expert_ffn: slots must be int32/int64 [T={x.shape[0]}, k]")
    if weights.shape != slots.shape:
        raise ValueError(
            f"cpu_expert_ffn: weights {list(weights.shape)} and slots {list(slots.shape)} differ"
        )
    if activation not in CPU_ACTIVATIONS:
        raise ValueError(f"cpu_expert_ffn: activation must be one of {CPU_ACTIVATIONS}")
    row_bytes = rows.shape[1] * rows.element_size()
    lay = _cpu_layout(rf, rows.dtype, hidden_size, ffn_size, group_size, row_bytes)
    table, tbytes, tlen = 0, 4, 0
    if slot_table is not None:
        slot_table = _check_cpu_tensor("slot_table", slot_table, 1)
        if slot_table.dtype not in _INDEX_DTYPES or slot_table.stride(0) != 1:
            raise ValueError("cpu_expert_ffn: slot_table must be a contiguous int32/int64 tensor")
        table, tbytes, tlen = slot_table.data_ptr(), slot_table.element_size(), len(slot_table)
    xf = x.to(torch.float32).contiguous()
    wf = weights.to(torch.float32).contiguous()
    ids = slots.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32)
    _C.cpu_expert_ffn(
        lay, xf.data_ptr(), x.shape[0], rows.data_ptr(), rows.shape[0],
        rows.stride(0) * rows.element_size(), ids.data_ptr(), ids.element_size(),
        ids.shape[1], table, tbytes, tlen, wf.data_ptr(), y.data_ptr(),
        kernel_threads() if threads is None else int(threads), isa,
        CPU_ACTIVATIONS.index(activation), float(alpha), float(limit), bool(skip_absent), dot,
    )  # fmt: skip
    out = out_dtype or x.dtype
    return y if out == torch.float32 else y.to(out)


# The dense linear layer of csrc/cpu/expert_gemv.h (`linear`): float rows through the
# expert kernels' float row dots, GGML blocks through their block row dots (one dot
# product per format). Each y[t, n] is one row dot product computed by one thread, so a
# row of the output is bit-identical whatever T, the other rows and the thread count.
_LINEAR_FLOAT_FMTS = {d: str(d).removeprefix("torch.") for d in CPU_FLOAT_DTYPES}


@functools.cache
def _fmt_codes() -> dict[str, int]:
    return dict(_C.cpu_formats())


@functools.cache
def _ggml_blocks() -> dict[int, tuple[str, int, int]]:
    """GGML type id -> (name, block_len, block_bytes) of the types the CPU kernels compute."""
    return {tid: (name, qk, bs) for name, tid, qk, bs, _ in _C.ggml_type_traits()}


# The kernels' thread count while `torch_ops_threads` holds torch's below it (a stack: the
# innermost count; empty: torch.get_num_threads(), the kernels' default).
_KERNEL_THREADS: list[int] = []


def kernel_threads() -> int:
    """The threads psr's CPU kernels run on when a call names none: torch's intra-op count,
    or the count `torch_ops_threads` kept for them."""
    return _KERNEL_THREADS[-1] if _KERNEL_THREADS else torch.get_num_threads()


@contextlib.contextmanager
def torch_ops_threads(n: int | None = 1) -> Iterator[None]:
    """Within: torch's own ops on `n` threads, psr's CPU kernels still on the count they had
    (`kernel_threads`); None changes nothing. Where the kernels do the work (a GGUF model's
    decode), torch's idle OpenMP workers otherwise spin after each parallel torch op on the
    cores the kernels' pool needs: a full-depth OLMoE-shaped decode at 2 threads ran at 0.5x
    (bench/results/cpu/threads/)."""
    before = torch.get_num_threads()
    if n is None or n >= before:
        yield
        return
    _KERNEL_THREADS.append(kernel_threads())
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        _KERNEL_THREADS.pop()


def _linear_threads(threads: int | None, who: str = "cpu_linear") -> int:
    n = kernel_threads() if threads is None else threads
    if not isinstance(n, int) or not 1 <= n <= cpu_max_threads():
        raise ValueError(f"{who}: threads must be an int in [1, {cpu_max_threads()}], got {n}")
    return n


def _linear_weight(
    weight: object, ggml_type: int | None, in_features: int | None
) -> tuple[torch.Tensor, str, int]:
    """The checked weight, its format's name and its GGML type id (0 for float rows)."""
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError("cpu_linear: weight must be a 2-D CPU tensor [N, K] or [N, row_bytes]")
    if weight.shape[0] < 1:
        raise ValueError("cpu_linear: weight must have at least one row (out feature)")
    if ggml_type is None:
        if weight.dtype not in _LINEAR_FLOAT_FMTS:
            raise ValueError(
                "cpu_linear: weight must be float32, bfloat16 or float16 without ggml_type,"
                f" got {weight.dtype}"
            )
        return weight, _LINEAR_FLOAT_FMTS[weight.dtype], 0
    if isinstance(ggml_type, bool) or not isinstance(ggml_type, int):
        raise ValueError(f"cpu_linear: ggml_type must be an int GGML type id, got {ggml_type!r}")
    if ggml_type not in _ggml_blocks():
        raise ValueError(f"cpu_linear: ggml_type {ggml_type} is not a type the CPU kernels compute")
    name, qk, bs = _ggml_blocks()[ggml_type]
    if in_features is None:
        raise ValueError("cpu_linear: in_features is required with ggml_type")
    if weight.dtype != torch.uint8:
        raise ValueError(
            f"cpu_linear: weight of ggml_type {name} must be uint8, not {weight.dtype}"
        )
    if in_features % qk:
        raise ValueError(
            f"cpu_linear: in_features={in_features} is not whole {name} blocks of {qk}"
        )
    if weight.shape[1] != in_features // qk * bs:
        raise ValueError(
            f"cpu_linear: weight rows of {name} with in_features={in_features} hold "
            f"{in_features // qk * bs} bytes, got {weight.shape[1]}"
        )
    return weight, "ggml", ggml_type


# Q4_K matrices on the integer dot run as tiles of 8 rows (Q4_K_X8: csrc/cpu/expert_gemv.h's
# tile_q4k, one row a vector lane; bench/results/cpu/tiles_avx2.md). Expert rows are tiled
# at load on the CPU backend (psr.models.loader: the same bytes, permuted, so no memory is
# added); a dense Q4_K weight gets a tiled copy at its first such call, kept while the weight lives
# (and is not written), so every CPU call of that weight (a layer's plan, cpu_linear, a
# compiled forward's op) computes the same bits. PSR_CPU_TILES, read once: "auto" (the
# default: on where the best ISA path is AVX2; AVX-512's own kernels are not measured
# against them), "1", "0".
CPU_TILES_ENV = "PSR_CPU_TILES"
_Q4_K, _Q4_K_X8, _TILE_ROWS = 12, 201, 8


@functools.cache
def cpu_tiles_on() -> bool:
    """Whether Q4_K weights run as tiles of 8 rows on the integer dot (PSR_CPU_TILES, read
    once: auto | 1 | 0; unset: auto)."""
    raw = os.environ.get(CPU_TILES_ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "1", "0"):
        raise ValueError(f"{CPU_TILES_ENV}={raw!r}: expected auto, 1 or 0")
    return raw == "1" or (raw == "auto" and cpu_isas()[-1] == "avx2")


def tile_q4k(weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q4_K rows `[N, row_bytes]` (N a multiple of 8) as the CPU kernels' tiles of 8 rows
    (a new uint8 tensor of the same shape: the same bytes, permuted within each tile)."""
    src = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty(weight.shape, dtype=torch.uint8)
    _C.cpu_tile_q4k(src.data_ptr(), src.stride(0), weight.shape[0], in_features, out.data_ptr())
    return out


def _tiles_of(weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """The tiled copy of `weight`, made again if the weight was written in place."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: no version counter (and never written)
        version = -1
    held: tuple[int, torch.Tensor] | None = getattr(weight, "_psr_tiles", None)
    if held is None or held[0] != version:  # kept on the weight: it lives as long
        held = (version, tile_q4k(weight, in_features))
        weight._psr_tiles = held  # type: ignore[attr-defined]
    return held[1]


class LinearPlan:
    """`cpu_linear` of one weight with the weight's and the bias's checks done once: a dense
    layer calls its kernel per token, where those checks cost more than a small call. The
    same kernel call as `cpu_linear` (the same bits); `source` and `bias_source` are the
    tensors it was built from (a module rebuilds its plan when they are replaced)."""

    __slots__ = ("K", "N", "b", "bias", "bias_source", "fmt", "gtype", "in_features", "source",
                 "stride", "w")  # fmt: skip

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        ggml_type: int | None = None,
        in_features: int | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        w, fmt, gtype = _linear_weight(weight, ggml_type, in_features)
        self.source, self.bias_source = weight, bias
        self.in_features = in_features
        self.K: int = w.shape[1] if fmt != "ggml" or in_features is None else in_features
        self.N = w.shape[0]
        self.w = w if w.stride(1) == 1 else w.contiguous()
        self.fmt, self.gtype = _fmt_codes()[fmt], gtype
        self.stride = self.w.stride(0) * self.w.element_size()
        self.bias, self.b = None, 0
        if bias is not None:
            if (
                not isinstance(bias, torch.Tensor)
                or bias.device.type != "cpu"
                or bias.shape != (self.N,)
            ):
                raise ValueError(f"cpu_linear: bias must be a CPU tensor [N={self.N}]")
            if not bias.is_floating_point():
                raise ValueError(f"cpu_linear: bias must be float, got {bias.dtype}")
            self.bias = bias.to(torch.float32).contiguous()
            self.b = self.bias.data_ptr()

    def __call__(
        self,
        x: torch.Tensor,
        *,
        threads: int | None = None,
        isa: str = "auto",
        out_dtype: torch.dtype | None = None,
        dot: str | None = None,
    ) -> torch.Tensor:
        """`x [..., K] @ W^T (+ bias)` as `cpu_linear` documents it (any leading dims: a
        layer's `[B, T, K]` input without view ops, which cost a few us each)."""
        dot = _cpu_dot[0] if dot is None else _check_dot(dot)
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() < 1:
            raise ValueError("cpu_linear: x must be a CPU tensor [..., K]")
        K = x.shape[-1]
        if not x.is_floating_point() or K < 1:
            raise ValueError(
                f"cpu_linear: x must be float [T, K >= 1], got {x.dtype} {list(x.shape)}"
            )
        named = self.in_features
        if K != self.K or (named is not None and K != named):
            if named is not None and K != named:
                raise ValueError(f"cpu_linear: in_features={named} but x has {K} columns")
            raise ValueError(f"cpu_linear: weight {list(self.w.shape)} does not take x's K={K}")
        n_threads = _linear_threads(threads)
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        T = xf.numel() // K
        y = torch.empty((*x.shape[:-1], self.N), dtype=torch.float32)
        w, stride, gtype = self.w, self.stride, self.gtype
        if gtype == _Q4_K and dot != "f32" and self.N % _TILE_ROWS == 0 and cpu_tiles_on():
            w, gtype = _tiles_of(self.source, K), _Q4_K_X8  # uint8, contiguous
            stride = w.stride(0)
        _C.cpu_linear(
            xf.data_ptr(), T, K, w.data_ptr(), self.N, stride, self.fmt, gtype,
            self.b, y.data_ptr(), n_threads, isa, dot,
        )  # fmt: skip
        out = out_dtype or x.dtype
        return y if out == torch.float32 else y.to(out)


def cpu_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    ggml_type: int | None = None,
    in_features: int | None = None,
    bias: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str = "auto",
    out_dtype: torch.dtype | None = None,
    dot: str | None = None,
) -> torch.Tensor:
    """A batch-invariant dense linear layer `x @ W^T (+ bias)` on the CPU, computed in fp32.

    `x` `[T, K]` of any float dtype; `weight` a float `[N, K]` tensor (float32 / bfloat16 /
    float16), or with `ggml_type` (a GGML type id, `_C.ggml_type_traits()`) a uint8
    `[N, row_bytes]` tensor of GGUF blocks (`in_features` = K required). `bias` `[N]`.
    Each weight row is read once for all T tokens; each output element is one row dot
    product by one thread in a fixed order, so every output row is bit-identical for any
    T, any other rows and any thread count (on one ISA path). `threads` (default
    kernel_threads()) in [1, cpu_max_threads()]; `isa` 'auto' or one of cpu_isas().
    `dot` (GGML rows): one of CPU_DOTS, default cpu_dot(). A layer that calls it per token
    keeps a `LinearPlan` of its weight instead (the same call, the checks done once).
    Returns `[T, N]` in `out_dtype` (default x's dtype).
    """
    dot = _check_dot(cpu_dot() if dot is None else dot)
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError("cpu_linear: x must be a 2-D CPU tensor [T, K]")
    plan = LinearPlan(weight, ggml_type=ggml_type, in_features=in_features, bias=bias)
    return plan(x, threads=threads, isa=isa, out_dtype=out_dtype, dot=dot)


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-style RMS norm of float32 `x [..., n]`: `weight * (x / sqrt(mean(
    x^2) + eps))` in fp32 (csrc/cpu/norm.cpp), a new tensor of x's shape. Each row reduced by
    one fixed-order loop: its bits depend on the row alone (any rows, strides, CPU)."""
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError("cpu_rms_norm: x must be a float32 CPU tensor")
    n = x.shape[-1] if x.dim() else 0
    if (
        not isinstance(weight, torch.Tensor)
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or weight.shape != (n,)
    ):
        raise ValueError(f"cpu_rms_norm: weight must be a float32 CPU tensor [{n}]")
    if n < 1:
        raise ValueError("cpu_rms_norm: x must have a last dimension of at least 1")
    w = weight if weight.is_contiguous() else weight.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.is_contiguous():  # a decode step's norm: no view ops (each costs a few us)
        rows, xp, stride = x.numel() // n, x.data_ptr(), n
    else:  # rows one stride apart (DeepSeek's split latent) in place, else a copy
        x2 = x.reshape(-1, n)
        if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < n):
            x2 = x2.contiguous()
        rows, xp, stride = x2.shape[0], x2.data_ptr(), max(x2.stride(0), n)
    _C.cpu_rms_norm(xp, rows, n, stride, w.data_ptr(), float(eps), y.data_ptr(), n)
    return y


# Causal attention of csrc/cpu/attention.cpp (expert_gemv.h's `attention`): scores by the
# float row dots above (each key a row, the query the input), the weighted V sum in key
# order. Each (token, head) output is computed by one thread from the keys at positions
# <= its own, in an order fixed by its position: row-invariant (any chunking of a prompt,
# a decode step or a prefill row, any thread count give the same bits on one ISA path).


def _attention_input(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() != 3:
        raise ValueError(f"cpu_attention: {name} must be a 3-D CPU tensor")
    if t.dtype not in CPU_FLOAT_DTYPES:
        raise ValueError(
            f"cpu_attention: {name} must be float32, bfloat16 or float16, got {t.dtype}"
        )
    if min(t.shape[1:]) < 1:
        raise ValueError(f"cpu_attention: {name} {list(t.shape)} has an empty head dimension")
    return t if t.stride(2) == 1 else t.contiguous()


def _attention_sinks(sinks: object, hq: int) -> torch.Tensor | None:
    """`sinks` checked, as a contiguous fp32 [Hq] tensor (None: no sinks)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.device.type != "cpu" or sinks.shape != (hq,):
        raise ValueError(f"cpu_attention: sinks must be a CPU tensor [Hq={hq}]")
    if not sinks.is_floating_point():
        raise ValueError(f"cpu_attention: sinks must be float, got {sinks.dtype}")
    return sinks.to(torch.float32).contiguous()


def cpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_start: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Row-invariant causal attention on the CPU, accumulated in fp32.

    `q` `[T, Hq, Dk]`, `k` `[L, Hkv, Dk]`, `v` `[L, Hkv, Dv]` (float32 / bfloat16 /
    float16 each; any strides, the last dim contiguous or copied); query head h reads kv
    head h // (Hq // Hkv). Query t sits at position p = q_start + t and attends keys j <= p
    (L >= q_start + T), and with `window` only j > p - window (transformers'
    sliding_window). `sinks` `[Hq]`: gpt-oss's per-head logit in the softmax denominator
    with no value. Scores are `scale * q . k_j`. Each output row is bit-identical whatever
    T, L, q_start split, other rows and thread count, on one ISA path. `threads` (default
    kernel_threads()) in [1, cpu_max_threads()]; `isa` 'auto' or one of cpu_isas().
    Returns `[T, Hq, Dv]` in `out_dtype` (default q's dtype).
    """
    q, k, v = _attention_input("q", q), _attention_input("k", k), _attention_input("v", v)
    T, Hq, Dk = q.shape
    L, Hkv, Dv = v.shape
    if k.shape[:2] != v.shape[:2] or k.shape[2] != Dk:
        raise ValueError(
            f"cpu_attention: k {list(k.shape)} and v {list(v.shape)} do not match q"
            f" {list(q.shape)} as [L, Hkv, Dk] / [L, Hkv, Dv]"
        )
    if Hq % Hkv:
        raise ValueError(f"cpu_attention: {Hq} query heads are not a multiple of {Hkv} kv heads")
    if isinstance(q_start, bool) or not isinstance(q_start, int) or q_start < 0:
        raise ValueError(f"cpu_attention: q_start must be an int >= 0, got {q_start!r}")
    if L < q_start + T:
        raise ValueError(
            f"cpu_attention: {L} keys do not reach the last query at position {q_start + T - 1}"
        )
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"cpu_attention: window must be None or an int >= 1, got {window!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"cpu_attention: scale must be a float, got {scale!r}")
    sf = _attention_sinks(sinks, Hq)
    n_threads = _linear_threads(threads, "cpu_attention")
    qf = q.to(torch.float32).contiguous()
    y = torch.empty(T, Hq, Dv, dtype=torch.float32)
    codes = _fmt_codes()
    _C.cpu_attention(
        qf.data_ptr(), T, Hq, Dk, k.data_ptr(), codes[_LINEAR_FLOAT_FMTS[k.dtype]],
        k.stride(0), k.stride(1), v.data_ptr(), codes[_LINEAR_FLOAT_FMTS[v.dtype]],
        v.stride(0), v.stride(1), Dv, L, Hkv, q_start, window or 0, float(scale),
        0 if sf is None else sf.data_ptr(), y.data_ptr(), n_threads, isa,
    )  # fmt: skip
    out = out_dtype or q.dtype
    return y if out == torch.float32 else y.to(out)


_ROPE_DTYPES = (torch.float32, torch.bfloat16)


def _rope_input(name: str, t: object, dims: int, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` checked as a `dims`-D CPU tensor of `dtype` (None: float32 or bfloat16)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() != dims:
        raise ValueError(f"cpu_rope_attention: {name} must be a {dims}-D CPU tensor")
    if t.dtype != (dtype or t.dtype) or t.dtype not in _ROPE_DTYPES:
        want = dtype or "float32 or bfloat16"
        raise ValueError(f"cpu_rope_attention: {name} must be {want}, got {t.dtype}")
    return t


def cpu_rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    start: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """A decode layer's attention after its projections, in one call: the rotary embedding
    of the T new rows (transformers' rotate_half form, `q * cos + rotate_half(q) * sin`,
    each product and the sum rounded to the inputs' dtype as torch's elementwise ops round
    them), their keys and values written into the cache at positions `start` .. `start + T
    - 1`, then `cpu_attention` of the roped queries over the cache's first `start + T`
    positions (q_start = start).

    `q` `[T, Hq, Dk]`, `k` `[T, Hkv, Dk]`, `v` `[T, Hkv, Dv]`, `cos` / `sin` `[T, Dk]`
    (Dk even); `k_cache` `[Hkv, C, Dk]` and `v_cache` `[Hkv, C, Dv]` with C >= start + T and
    the last dim contiguous (a KV cache layer's buffers, written in place); all float32 or
    all bfloat16. `window`, `sinks`, `threads`, `isa` as cpu_attention's. Returns
    `[T, Hq, Dv]` float32, bit-identical to the rotary embedding, the cache update and
    cpu_attention done apart.
    """
    q = _rope_input("q", q, 3, None).contiguous()
    dt = q.dtype
    k, v = _rope_input("k", k, 3, dt).contiguous(), _rope_input("v", v, 3, dt).contiguous()
    cos = _rope_input("cos", cos, 2, dt).contiguous()
    sin = _rope_input("sin", sin, 2, dt).contiguous()
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _rope_input(name, c, 3, dt).stride(2) != 1:
            raise ValueError(f"cpu_rope_attention: {name}'s last dim must be contiguous")
    T, Hq, Dk = q.shape
    Hkv, C, Dv = v_cache.shape
    want = {"k": (T, Hkv, Dk), "v": (T, Hkv, Dv), "cos": (T, Dk), "sin": (T, Dk)}
    for name, got in (("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if tuple(got.shape) != want[name]:
            raise ValueError(
                f"cpu_rope_attention: {name} {list(got.shape)} is not {list(want[name])}"
                f" (q {list(q.shape)}, v_cache {list(v_cache.shape)})"
            )
    if tuple(k_cache.shape) != (Hkv, C, Dk):
        raise ValueError(f"cpu_rope_attention: k_cache {list(k_cache.shape)} is not {[Hkv, C, Dk]}")
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= C - T:
        raise ValueError(
            f"cpu_rope_attention: start must be an int in [0, {C - T}] ({C} cached"
            f" positions, {T} new), got {start!r}"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"cpu_rope_attention: window must be None or an int, got {window!r}")
    sf = _attention_sinks(sinks, Hq)
    n_threads = _linear_threads(threads, "cpu_rope_attention")
    roped = torch.empty(T, Hq, Dk, dtype=torch.float32)
    y = torch.empty(T, Hq, Dv, dtype=torch.float32)
    _C.cpu_rope_attention(
        _fmt_codes()[_LINEAR_FLOAT_FMTS[dt]], q.data_ptr(), k.data_ptr(), v.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), roped.data_ptr(), T, Hq, Dk, k_cache.data_ptr(),
        k_cache.stride(1), k_cache.stride(0), v_cache.data_ptr(), v_cache.stride(1),
        v_cache.stride(0), Dv, Hkv, start, window or 0, float(scale),
        0 if sf is None else sf.data_ptr(), y.data_ptr(), n_threads, isa,
    )  # fmt: skip
    return y
