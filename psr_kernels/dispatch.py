"""One compute dispatcher: Triton kernels or their torch references.

    resolve_compute(compute, device) -> "triton" | "torch"
    kernel_ops(compute, device)      -> KernelOps: .path, .route, .route_hidden,
                                        .predict_next, .expert_ffn, .decode_step,
                                        .route_counted

`compute` is one of `"auto"`, `"triton"`, `"torch"` (or None, the same as "auto"):

* `"auto"` takes the process default, the environment variable `PSR_COMPUTE`
  (`auto|triton|torch`, read at every call), and when that is unset or `auto`, the
  device: Triton kernels on a CUDA device, the torch references anywhere else.
* `"triton"` runs the kernels: on a CUDA device, or on the CPU only under Triton's
  interpreter (`TRITON_INTERPRET=1`, set before psr_kernels is imported); otherwise
  it is a RuntimeError that names the fixes.
* `"torch"` runs the references (any device).

The runtime (`pk.kernel_ops(compute, device)`) and the `torch.ops.psr.*` ops (with
"auto") both resolve here, so one environment variable steers every call site.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from psr_kernels._common import interpreting
from psr_kernels.decode import decode_step, decode_step_ref
from psr_kernels.expert_ffn import expert_ffn, expert_ffn_ref
from psr_kernels.routing import predict_next, route, route_counted, route_hidden
from psr_kernels.routing_ref import (
    predict_next_ref,
    route_counted_ref,
    route_hidden_ref,
    route_ref,
)

Compute = Literal["auto", "triton", "torch"]
ComputePath = Literal["triton", "torch"]
COMPUTE_CHOICES: tuple[str, ...] = get_args(Compute)
ENV_VAR = "PSR_COMPUTE"
_CHOICES_TEXT = ", ".join(repr(c) for c in COMPUTE_CHOICES)


_PARSED: dict[str, Compute] = {}  # PSR_COMPUTE's raw values already parsed (read per call)


def default_compute() -> Compute:
    """The process default: `PSR_COMPUTE` (case-insensitive), "auto" when unset or empty."""
    raw = os.environ.get(ENV_VAR, "")
    known = _PARSED.get(raw)
    if known is not None:
        return known
    value = raw.strip().lower()
    if value and value not in COMPUTE_CHOICES:
        raise ValueError(f"{ENV_VAR}={raw!r}: expected one of {_CHOICES_TEXT}")
    _PARSED[raw] = value or "auto"  # type: ignore[assignment]
    return _PARSED[raw]


def resolve_compute(compute: str | None, device: torch.device | str) -> ComputePath:
    """The compute path, "triton" or "torch", for `compute` on `device` (module docstring).

    Raises ValueError for a `compute` other than "auto", "triton", "torch" or None, and
    RuntimeError for "triton" where Triton cannot run.
    """
    if compute is not None and (not isinstance(compute, str) or compute not in COMPUTE_CHOICES):
        raise ValueError(f"compute must be one of {_CHOICES_TEXT}, got {compute!r}")
    dev = device if isinstance(device, torch.device) else torch.device(device)
    choice = default_compute() if compute in (None, "auto") else compute
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if dev.type == "cuda" else "torch"
    if dev.type == "cuda" or (dev.type == "cpu" and interpreting()):
        return "triton"
    source = f" (from {ENV_VAR})" if compute in (None, "auto") else ""
    raise RuntimeError(
        f"compute='triton'{source} needs a CUDA device, got {dev}: use compute='torch' "
        f"or 'auto' (the torch references), or, on the CPU, set TRITON_INTERPRET=1 "
        f"before importing psr_kernels to run the kernels in Triton's interpreter"
    )


@dataclass(frozen=True)
class KernelOps:
    """The ops of one compute path, with the signatures of `psr_kernels.route` etc.
    (`expert_ffn` serves float and quantized slab rows: its `fmt`)."""

    path: ComputePath
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    route_hidden: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    predict_next: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    expert_ffn: Callable[..., torch.Tensor]
    # One MoE layer's sync-free decode step on the device caches (psr_kernels.decode).
    decode_step: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # `route` plus the per-token substituted count (the host-driven steps).
    route_counted: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


_TRITON = KernelOps(
    "triton", route, route_hidden, predict_next, expert_ffn, decode_step, route_counted
)
_TORCH = KernelOps(
    "torch",
    route_ref,
    route_hidden_ref,
    predict_next_ref,
    expert_ffn_ref,
    decode_step_ref,
    route_counted_ref,
)


def kernel_ops(compute: str | None, device: torch.device | str) -> KernelOps:
    """The ops of `resolve_compute(compute, device)`: the Triton kernels or the references."""
    return _TRITON if resolve_compute(compute, device) == "triton" else _TORCH
