"""Everything family-specific: checkpoints, the supported architectures, `load` and
`offload` (wiring psr into a transformers model), and the embedded default model."""

from psr.models.checkpoint import Checkpoint, CheckpointError, read_config
from psr.models.embedded import DEFAULT_MODEL
from psr.models.families import SUPPORTED, moe_spec
from psr.models.inspect import Inspection, inspect
from psr.models.loader import load, offload, restore

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
