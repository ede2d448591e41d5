"""Everything family-specific: checkpoints, the supported architectures, `load` and
`offload` (wiring psr into a transformers model), and the embedded default model.

Exports load lazily (PEP 562), as `psr`'s do: `psr inspect` of a GGUF file reads its
header through `inspect`, `gguf` and `families` without importing torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# torch-free, and imported here: the function `inspect` must shadow its module's name
from psr.models.inspect import Inspection, inspect

_EXPORTS = {
    "psr.models.checkpoint": ("Checkpoint", "CheckpointError", "read_config"),
    "psr.models.embedded": ("DEFAULT_MODEL",),
    "psr.models.families": ("SUPPORTED", "moe_spec"),
    "psr.models.loader": ("load", "offload", "restore"),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED",
    "Checkpoint",
    "CheckpointError",
    "Inspection",
    "inspect",
    "load",
    "moe_spec",
    "offload",
    "read_config",
    "restore",
]

if TYPE_CHECKING:
    from psr.models.checkpoint import Checkpoint, CheckpointError, read_config
    from psr.models.embedded import DEFAULT_MODEL
    from psr.models.families import SUPPORTED, moe_spec
    from psr.models.loader import load, offload, restore


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'psr.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
