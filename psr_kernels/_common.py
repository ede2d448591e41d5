"""Shared checks and launch helpers for psr_kernels (torch + triton only)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch's CPU elementwise loops run whole chunks of 2 vectors (32 floats on AVX-512) of a
# flattened tensor through the vector function and the rest through a scalar one, which
# round transcendentals differently: rows this many elements apart (a multiple of every
# chunk) are all taken the same way whatever the number of rows.
CPU_VECTOR_CHUNK = 64


def interpreting() -> bool:
    """TRITON_INTERPRET=1 (read now; Triton itself reads it when the kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_launchable(op: str, *tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device that Triton can run on (CUDA, or CPU when interpreting)."""
    devs = {t.device for t in tensors if t is not None}
    if len(devs) != 1:
        raise ValueError(f"{op}: tensors must be on one device, got {sorted(map(str, devs))}")
    dev = devs.pop()
    if dev.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"{op}: Triton kernels need CUDA tensors (got {dev}); set TRITON_INTERPRET=1 before "
            f"importing psr_kernels to run them on the CPU, or take the torch path: {op}_ref, "
            f"kernel_ops('auto' or 'torch', device), or the torch.ops.psr op"
        )
    return dev


def check_float(op: str, name: str, t: torch.Tensor, ndim: int | tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in dims:
        raise ValueError(
            f"{op}: {name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(t.shape)}"
        )
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} dtype must be float32, bfloat16 or float16, got {t.dtype}")


class NonFiniteError(ValueError):
    """Router inputs with NaN or inf (a caller may re-raise it in its own words)."""


def check_finite(op: str, name: str, t: torch.Tensor) -> None:
    """NaN/inf router scores would route silently to garbage: refuse them."""
    if not bool(torch.isfinite(t).all()):
        bad = "NaN" if bool(torch.isnan(t).any()) else "inf"
        raise NonFiniteError(
            f"{op}: {name} contains {bad} (pass check_finite=False to skip this check)"
        )


def pow2(n: int, lo: int = 1) -> int:
    p: int = triton.next_power_of_2(int(n))
    return max(lo, p)


@triton.jit
def load_slot(slots_ptr, i, table_ptr, HAS_TABLE: tl.constexpr):
    """The slab slot of routed entry `i`: slots[i], or with a slot table (the device slot
    map: `slots` then holds expert ids) table[slots[i]]; int64."""
    s = tl.load(slots_ptr + i)
    if HAS_TABLE:
        s = tl.load(table_ptr + s)
    return s.to(tl.int64)


# The down kernels' default SPLIT_K: one routed expert a program, the partials summed in
# expert order after (`sum_experts`: the same bits). At batch 1 the unsplit down launches only
# H / BLOCK_H programs, each looping over the k experts; split, the kernels alone ran
# 1.12-1.60x faster on an H200 for bf16, int4, Q8_0 and Q4_K_M rows at Qwen3-30B-A3B's shape
# (bench/results/gpu/2026-12-04-session3/gemv_sweep.md).
SPLIT_K_DEFAULT = 1


@triton.jit
def store_down(y, y_ptr, s_yt, part_ptr, t, j0, H, hs, hm, K: tl.constexpr, SPLIT_K: tl.constexpr):
    """A down kernel's result for token `t`, rows `hs`: y itself, or with SPLIT_K (one routed
    expert `j0` a program) its partial into `part [T, K, H]`, which `_sum_experts_kernel`
    adds in expert order from 0, as the unsplit loop does: the same bits, K times the
    programs (at batch 1 the unsplit down launches only H / BLOCK_H of them)."""
    if SPLIT_K:
        tl.store(part_ptr + (t * K + j0) * H + hs, y, mask=hm)
    else:
        tl.store(y_ptr + t * s_yt + hs, y.to(y_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _sum_experts_kernel(part_ptr, y_ptr, s_yt, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """y[t, hs] = sum over j in order of part[t, j, hs] (the SPLIT_K down's second pass)."""
    t = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hs < H
    y = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(K):
        y += tl.load(part_ptr + (t * K + j) * H + hs, mask=hm, other=0.0)
    tl.store(y_ptr + t * s_yt + hs, y.to(y_ptr.dtype.element_ty), mask=hm)


def sum_experts(part: torch.Tensor, y: torch.Tensor) -> None:
    """y[t] = the SPLIT_K down's partials `part [T, K, H]` summed over the experts in order."""
    T, K, H = part.shape
    block = min(pow2(H, 16), 1024)
    _sum_experts_kernel[(T, triton.cdiv(H, block))](part, y, y.stride(0), H, K=K, BLOCK_H=block)
