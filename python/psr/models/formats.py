"""`psr_kernels.rowformat` (the RowFormat table, torch-free at module level) without
running `psr_kernels/__init__.py`, which imports torch and triton: for what reads a
checkpoint's header only (`psr inspect` of a GGUF file). The module is loaded under its
own name, so a later `import psr_kernels` reuses it (one RowFormat class per process)."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

NAME = "psr_kernels.rowformat"


@cache
def rowformat() -> ModuleType:
    """The psr_kernels.rowformat module, imported without psr_kernels' package init."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    pkg = importlib.util.find_spec("psr_kernels")  # locates the package, runs nothing
    assert pkg is not None and pkg.submodule_search_locations
    path = Path(next(iter(pkg.submodule_search_locations))) / "rowformat.py"
    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = mod
    spec.loader.exec_module(mod)
    return mod
