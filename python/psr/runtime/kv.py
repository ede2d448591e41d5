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


# Layer kinds that keep no per-token KV (recurrent state of a fixed size).
_STATE_LAYERS = ("linear_attention", "mamba", "conv")


def kv_bytes(config: Any, itemsize: int, tokens: int) -> int:
    """Bytes of a KV cache holding `tokens`: keys and values of every attention layer
    (`num_key_value_heads` x `head_dim` each, in the cache's `itemsize`); sliding-window
    layers hold at most their window, layers of linear attention (Qwen3-Next's Gated
    DeltaNet) a fixed state instead (not counted)."""
    text = getattr(config, "text_config", None) or config
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    per_token = 2 * heads * head_dim * itemsize  # one layer
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    total = 0
    for kind in kinds:
        if kind not in _STATE_LAYERS:
            n = min(tokens, int(window)) if kind == "sliding_attention" and window else tokens
            total += per_token * n
    return total
