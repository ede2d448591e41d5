"""The CPU expert kernels' Python API (csrc/cpu/expert_gemv.h through `psr._C`): checked
calls on torch tensors, the format table's CPU layout, the machine's ISA paths and thread cap.
One of the two modules of `psr.store`, the package that touches the extension.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

import psr._C as _C

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


def cpu_isas() -> list[str]:
    """The ISA paths of the CPU expert kernels this CPU runs, best last ('scalar' always;
    'avx2', 'avx512' where the CPU has them: chosen at run time)."""
    return list(_C.cpu_isas())


def cpu_max_threads() -> int:
    """The most threads the CPU expert kernels take: this machine's hardware threads."""
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
) -> torch.Tensor:
    """Routed experts of `x [T, H]` computed on the CPU from packed expert rows, in place.

    Args: as psr_kernels.expert_ffn: `rows` `[C, 3*H*F]` float rows (float32 / bfloat16 /
    float16) or `[C, nbytes]` uint8 rows of a quantized `fmt`; `slots`, `weights` `[T, k]`;
    `slot_table` `[E]` (then `slots` holds expert ids). `threads` (default
    torch.get_num_threads()) in [1, cpu_max_threads()]; `isa` 'auto' or one of
    cpu_isas(); `activation` 'swiglu' or 'swiglu_oai' (gpt-oss's clamped SwiGLU with
    `alpha`, `limit`). Every id and slot is checked (IndexError); a row is never read
    past its end. `skip_absent` (with a slot_table): an expert whose slot is -1 is absent
    (computed elsewhere: experts_on's CPU part) and contributes nothing. Returns `[T, H]`
    in `out_dtype` (default x's dtype).
    """
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
        torch.get_num_threads() if threads is None else int(threads), isa,
        CPU_ACTIVATIONS.index(activation), float(alpha), float(limit), bool(skip_absent),
    )  # fmt: skip
    out = out_dtype or x.dtype
    return y if out == torch.float32 else y.to(out)
