"""transformers' KV cache under either of its names: the forward's argument and the output's
field (the engine's sequence guard and the generation loops both need them)."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.24 calls the KV cache argument `cache`, earlier `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(out: Any) -> Any:
    """The KV cache of a model output (None if absent), under either name. Asking a
    transformers >= 5.24 output for the old name warns, so only its own field is read."""
    if not isinstance(out, dict):
        return None
    key = (
        "cache" if "cache" in getattr(type(out), "__dataclass_fields__", {}) else "past_key_values"
    )
    return out[key] if key in out else None
