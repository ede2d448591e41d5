"""Shared checks and launch helpers for psr_kernels (torch + triton only)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
