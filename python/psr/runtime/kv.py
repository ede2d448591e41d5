"""transformers' KV cache under either of its names: the forward's argument and the output's
field (the engine's sequence guard and the generation loops both need them)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the accounting below is torch-free (`psr inspect` of a GGUF file)
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


# --- what each attention kind caches -----------------------------------------------------


def _text(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _kv_heads_values(c: Any) -> int:
    """Keys and values of every KV head (MHA, GQA, MQA)."""
    heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return 2 * heads * head_dim


def _mla_values(c: Any) -> int:
    """DeepSeek's MLA as transformers >= 5.24 caches it: the compressed latent
    (kv_lora_rank, as keys) and the shared rope key (qk_rope_head_dim, as values), one
    head; the per-head keys and values are expanded from them at each step."""
    return int(c.kv_lora_rank) + int(c.qk_rope_head_dim)


def _mla_expanded_values(c: Any) -> int:
    """MLA where transformers caches the expanded heads (before 5.24): per head, nope +
    rope keys and v_head_dim values."""
    k = int(c.qk_nope_head_dim) + int(c.qk_rope_head_dim)
    return int(c.num_attention_heads) * (k + int(c.v_head_dim))


def _linear_state_values(c: Any) -> int:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): the causal conv's last `kernel` inputs of the
    q, k, v channels and the recurrent state [value heads, key dim, value dim]."""
    key = int(c.linear_num_key_heads) * int(c.linear_key_head_dim)
    value = int(c.linear_num_value_heads) * int(c.linear_value_head_dim)
    conv = (2 * key + value) * int(c.linear_conv_kernel_dim)
    heads = int(c.linear_num_value_heads)
    return conv + heads * int(c.linear_key_head_dim) * int(c.linear_value_head_dim)


def _none(c: Any) -> int:
    return 0


def _all(c: Any) -> int | None:
    return None


@dataclass(frozen=True)
class CacheKind:
    """What one layer of an attention kind keeps for a sequence: `per_token` values for
    each cached token, at most `window` tokens (None: all), plus a fixed `state` of
    values (recurrent layers). Values are in the cache's dtype."""

    name: str
    what: str
    per_token: Callable[[Any], int]
    window: Callable[[Any], int | None] = _all
    state: Callable[[Any], int] = _none


# One table: a layer's kind (transformers' `layer_types`, MLA told from the config) ->
# what its cache holds. transformers' static cache (psr's decode graphs) holds exactly
# this for `tokens`; its dynamic cache keeps window - 1 tokens of a sliding layer.
CACHE_KINDS: dict[str, CacheKind] = {
    k.name: k
    for k in (
        CacheKind("full_attention", "keys and values per KV head (MHA/GQA)", _kv_heads_values),
        CacheKind("mla", "MLA latent + rope key, one head", _mla_values),
        CacheKind("mla_expanded", "MLA expanded: keys and values per head", _mla_expanded_values),
        CacheKind(
            "sliding_attention",
            "keys and values per KV head, the last sliding_window tokens",
            _kv_heads_values,
            window=lambda c: int(c.sliding_window),
        ),
        CacheKind(
            "chunked_attention",
            "keys and values per KV head, the last attention_chunk_size tokens",
            _kv_heads_values,
            window=lambda c: int(c.attention_chunk_size),
        ),
        CacheKind(
            "linear_attention",
            "a fixed conv + recurrent state (Gated DeltaNet)",
            _none,
            state=_linear_state_values,
        ),
    )
}


def _mla_latent_cached(model_type: str) -> bool:
    """transformers >= 5.24's MLA attention (DeepSeek-V2, -V3) caches the latent and
    expands it at each step (its `expand_kv`); earlier ones cache the expanded heads. Told
    from the installed version, so the accounting imports neither transformers nor torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(p) for p in version("transformers").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return True
    return (major, minor) >= (5, 24)


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's CACHE_KINDS entry."""
    c = _text(config)
    kinds = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    if getattr(c, "kv_lora_rank", None):  # DeepSeek's MLA (V2, V3, Kimi-K2)
        mla = "mla" if _mla_latent_cached(str(c.model_type)) else "mla_expanded"
        kinds = [mla if k == "full_attention" else k for k in kinds]
    unknown = sorted({k for k in kinds if k not in CACHE_KINDS})
    if unknown:
        raise ValueError(
            f"layer kind {unknown[0]!r} has no KV accounting in psr.runtime.kv.CACHE_KINDS"
        )
    if "sliding_attention" in kinds and not getattr(c, "sliding_window", None):
        kinds = ["full_attention" if k == "sliding_attention" else k for k in kinds]
    return kinds


def kv_by_kind(config: Any, itemsize: int, tokens: int) -> dict[str, int]:
    """Bytes of a cache holding `tokens` tokens, per attention kind (CACHE_KINDS)."""
    c = _text(config)
    out: dict[str, int] = {}
    for name in layer_kinds(config):
        k = CACHE_KINDS[name]
        w = k.window(c)
        n = tokens if w is None else min(tokens, w)
        out[name] = out.get(name, 0) + (k.per_token(c) * n + k.state(c)) * itemsize
    return out


def kv_bytes(config: Any, itemsize: int, tokens: int) -> int:
    """Bytes of a KV cache holding `tokens` tokens in `itemsize`-byte values: what each
    layer's attention really caches (CACHE_KINDS), summed over layers."""
    return sum(kv_by_kind(config, itemsize, tokens).values())
