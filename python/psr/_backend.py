"""What the C++ extension was built with, what this machine can use, and which backend runs."""

from __future__ import annotations

import os
from typing import Any

from psr import _C

_BACKENDS = ("cpu", "cuda")
_forced: str | None = None


def cuda_available() -> bool:
    """A CUDA device usable by both the extension and torch."""
    if not _C.cuda_compiled() or _C.cuda_device_count() == 0:
        return False
    import torch

    return torch.cuda.is_available()


def set_backend(name: str | None) -> None:
    """Force the store backend ('cpu' or 'cuda'); None restores automatic choice."""
    global _forced
    if name is not None:
        _check_backend(name, where="set_backend")
    _forced = name


def _check_backend(name: str, where: str) -> None:
    if name not in _BACKENDS:
        raise ValueError(f"{where}: unknown backend {name!r}; expected one of {_BACKENDS}")
    if name == "cuda" and not _C.cuda_compiled():
        raise RuntimeError(
            f"{where}: the CUDA backend was not built into psr._C "
            "(reinstall with nvcc on PATH, or PSR_FORCE_CUDA=1 to make that an error)"
        )
    if name == "cuda" and not cuda_available():
        raise RuntimeError(f"{where}: the CUDA backend is built but no CUDA device is available")


def current_backend() -> str:
    """The backend new stores use: set_backend(), else $PSR_BACKEND, else cuda if usable."""
    if _forced is not None:
        return _forced
    env = os.environ.get("PSR_BACKEND", "").strip().lower()
    if env:
        _check_backend(env, where="PSR_BACKEND")
        return env
    return "cuda" if cuda_available() else "cpu"


def backend_info() -> dict[str, Any]:
    """Build and run-time facts: cuda_compiled, cuda_available, backend, ..."""
    return {
        "cuda_compiled": bool(_C.cuda_compiled()),
        "cuda_available": cuda_available(),
        "cuda_device_count": int(_C.cuda_device_count()),
        "cuda_runtime_version": int(_C.cuda_runtime_version()),
        "cuda_archs": [a for a in str(_C.cuda_archs).split(",") if a],
        "backend": current_backend(),
        "extension": _C.__file__,
    }
