"""Everything family-specific: checkpoints, the supported architectures, `load` and
`offload` (wiring psr into a transformers model), and the embedded default model.

Exports load lazily (PEP 562), as `psr`'s do: `psr inspect` of a GGUF file reads its
header through `inspect`, `gguf` and `families` without importing torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psr.lazy import lazy_exports

# torch-free, and imported here: the function `inspect` must shadow its module's name
from psr.models.inspect import Inspection, inspect

_EXPORTS = {
    "psr.models.checkpoint": ("Checkpoint", "CheckpointError", "read_config"),
    "psr.models.embedded": ("DEFAULT_MODEL",),
    "psr.models.families": ("SUPPORTED", "moe_spec"),
    "psr.models.loader": ("load", "offload", "restore"),
}
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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
