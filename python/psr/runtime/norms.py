"""transformers' RMS norms on the CPU through psr's row kernel (`cpu_rms_norm`).

A norm qualifies by its forward's bytecode: one of the RMS norms audited here (`audited`:
Llama's, which most families copy, and gpt-oss's), with a 1-D weight and a float
`variance_epsilon`. `row_norms(model)` makes each qualifying norm of a model an instance of
a subclass of its class (`_ROW_CLASSES`, one per class) whose forward calls the kernel for
float32 inputs on the CPU (one call instead of ~7 torch ops: ~1.3 ms of a 16-layer decode
token) and the class's own forward otherwise (other dtypes, devices, torch.compile,
autograd). A class swap, not an instance attribute: a bound method would make each norm a
reference cycle, which keeps a dropped model alive until the garbage collector runs. The
kernel reduces each row in a fixed order, so a row's bits never depend on the other rows
(prefill chunks, batched decode)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psr.store import cpu_rms_norm

_AUDITED: list[Any] = []  # the audited norms' code objects (imported on first use)


def audited() -> list[Any]:
    """The code objects of the audited RMS norms' forwards."""
    if not _AUDITED:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        _AUDITED.extend(f.forward.__code__ for f in (LlamaRMSNorm, GptOssRMSNorm))
    return _AUDITED


def same_code(a: Any, b: Any) -> bool:
    """Whether two code objects are the same code (bytecode, names, constants, locals): how
    psr audits a transformers forward (these norms; runtime/attention.py's FUSED). None
    (no code) matches nothing."""
    if a is None or b is None:
        return False
    return (a.co_code, a.co_names, a.co_consts, a.co_varnames) == (
        b.co_code, b.co_names, b.co_consts, b.co_varnames
    )  # fmt: skip


def _original(cls: type) -> Any:
    """The transformers class of a norm `row_norms` swapped (else `cls` itself)."""
    return _ORIGINAL.get(cls, cls)


def is_rms_norm(module: nn.Module, device: str | None = "cpu") -> bool:
    """Whether `module` is one of the audited RMS norms (its weight on `device`; None: any),
    with or without psr's row kernel (`row_norms`)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    if device is not None and weight.device.type != device:
        return False
    if not isinstance(getattr(module, "variance_epsilon", None), float):
        return False
    code = getattr(_original(type(module)).forward, "__code__", None)
    return any(same_code(code, c) for c in audited())


def _forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (
        hidden_states.dtype == torch.float32
        and hidden_states.device.type == "cpu"
        and isinstance(w, torch.Tensor)
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad))
    ):
        eps: float = self.variance_epsilon  # type: ignore[assignment]  # checked float
        return cpu_rms_norm(hidden_states, w, eps)
    out: torch.Tensor = _original(type(self)).forward(self, hidden_states)
    return out


_ROW_CLASSES: dict[type, type] = {}  # transformers norm class -> its row-kernel subclass
_ORIGINAL: dict[type, type] = {}  # and back


def _row_class(cls: type) -> type:
    if cls not in _ROW_CLASSES:
        sub = type(cls.__name__, (cls,), {"forward": _forward, "__module__": cls.__module__})
        _ROW_CLASSES[cls], _ORIGINAL[sub] = sub, cls
    return _ROW_CLASSES[cls]


def has_row_kernel(module: nn.Module) -> bool:
    """Whether `row_norms` gave `module` the row kernel."""
    return type(module) in _ORIGINAL


def row_norms(model: nn.Module, on: bool = True) -> int:
    """Give every audited RMS norm of `model` the kernel's forward (`on`), or take it back;
    returns how many norms it changed."""
    n = 0
    for m in model.modules():
        if not is_rms_norm(m, device=None) or has_row_kernel(m) == on:
            continue
        m.__class__ = _row_class(type(m)) if on else _original(type(m))
        n += 1
    return n
