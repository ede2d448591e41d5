"""transformers' KV cache under either of its names: the forward's argument and the output's
field (the engine's sequence guard and the generation loops both need them)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psr.vocab as vocab

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


def _kv_heads(c: Any) -> int:
    return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)


def _kv_heads_values(c: Any) -> int:
    """Keys and values of every KV head (MHA, GQA, MQA)."""
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return 2 * _kv_heads(c) * head_dim


def _kv_heads_rows(c: Any) -> int:
    """A key row and a value row per KV head."""
    return 2 * _kv_heads(c)


def _mla_values(c: Any) -> int:
    """DeepSeek's MLA as transformers >= 5.24 caches it: the compressed latent
    (kv_lora_rank, as keys) and the shared rope key (qk_rope_head_dim, as values), one
    head; the per-head keys and values are expanded from them at each step."""
    return int(c.kv_lora_rank) + int(c.qk_rope_head_dim)


def _two_rows(c: Any) -> int:
    """MLA's latent (as keys) and rope key (as values): one head each."""
    return 2


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


def _mla_expanded_rows(c: Any) -> int:
    return 2 * int(c.num_attention_heads)


def _none(c: Any) -> int:
    return 0


def _all(c: Any) -> int | None:
    return None


@dataclass(frozen=True)
class CacheKind:
    """What one layer of an attention kind keeps for a sequence: `per_token` values for
    each cached token, in `rows` rows (one per head of keys and of values: a quantized
    format keeps a scale per row), at most `window` tokens (None: all), plus a fixed
    `state` of values (recurrent layers). Values are in the cache's format (KV_FORMATS)."""

    name: str
    what: str
    per_token: Callable[[Any], int]
    rows: Callable[[Any], int]
    window: Callable[[Any], int | None] = _all
    state: Callable[[Any], int] = _none
    compact: bool = True  # its cached values may take a compact KV format (not a state)


# One table: a layer's kind (transformers' `layer_types`, MLA told from the config) ->
# what its cache holds. transformers' static cache (psr's decode graphs) holds exactly
# this for `tokens`; its dynamic cache keeps window - 1 tokens of a sliding layer.
CACHE_KINDS: dict[str, CacheKind] = {
    k.name: k
    for k in (
        CacheKind(
            "full_attention",
            "keys and values per KV head (MHA/GQA)",
            _kv_heads_values,
            _kv_heads_rows,
        ),
        CacheKind("mla", "MLA latent + rope key, one head", _mla_values, _two_rows),
        CacheKind(
            "mla_expanded",
            "MLA expanded: keys and values per head",
            _mla_expanded_values,
            _mla_expanded_rows,
        ),
        CacheKind(
            "sliding_attention",
            "keys and values per KV head, the last sliding_window tokens",
            _kv_heads_values,
            _kv_heads_rows,
            window=lambda c: int(c.sliding_window),
        ),
        CacheKind(
            "chunked_attention",
            "keys and values per KV head, the last attention_chunk_size tokens",
            _kv_heads_values,
            _kv_heads_rows,
            window=lambda c: int(c.attention_chunk_size),
        ),
        CacheKind(
            "linear_attention",
            "a fixed conv + recurrent state (Gated DeltaNet)",
            _none,
            _none,
            state=_linear_state_values,
            compact=False,
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


@dataclass(frozen=True)
class KVFormat:
    """How cached values are stored (psr.runtime.kv_quant builds the cache): `value_bytes`
    per value (None: the model dtype's) and `scale_bytes` per row (one head's keys or
    values at one token: a quantized format's per-(token, head) scale)."""

    name: str
    what: str
    value_bytes: int | None = None
    scale_bytes: int = 0
    dtype: str | None = None  # the stored values' torch dtype name (None: the model's)

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0

    def nbytes(self, values: int, rows: int, itemsize: int) -> int:
        """Bytes of `values` values in `rows` rows."""
        size = itemsize if self.value_bytes is None else self.value_bytes
        return values * size + rows * self.scale_bytes


# The KV formats `psr.load(kv_format=...)` builds and the memory plan counts (`psr inspect
# --kv-format`): "auto" is transformers' own cache in the model dtype.
KV_FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("auto", "the model dtype (transformers' own cache)"),
        KVFormat("bf16", "bfloat16 values", 2, 0, "bfloat16"),
        KVFormat("int8", "int8 values, an fp32 absmax scale per (token, head)", 1, 4, "int8"),
        KVFormat("fp8", "fp8 e4m3 values, an fp32 scale per (token, head)", 1, 4, "float8_e4m3fn"),
    )
}


assert tuple(KV_FORMATS) == vocab.KV_FORMATS  # the option's words (no torch) name these


def kv_format(name: str) -> KVFormat:
    """The KV_FORMATS entry of `name`; ValueError naming the choices otherwise."""
    return KV_FORMATS[vocab.kv_format(name)]


def check_kv_format(config: Any, fmt: str) -> KVFormat:
    """KV format `fmt` checked against every layer kind of `config` (one that keeps a
    recurrent state has no compact form): a one-line ValueError naming the kind."""
    f = kv_format(fmt)
    if f.dtype is None:
        return f
    for name in dict.fromkeys(layer_kinds(config)):
        k = CACHE_KINDS[name]
        if not k.compact:
            raise ValueError(
                f"kv_format={fmt!r}: the {name} layers keep {k.what}, which has no {fmt} "
                "form; use kv_format='auto'"
            )
    return f


def kv_by_kind(config: Any, itemsize: int, tokens: int, fmt: str = "auto") -> dict[str, int]:
    """Bytes of a cache holding `tokens` tokens, per attention kind (CACHE_KINDS), in KV
    format `fmt` (KV_FORMATS; a kind that caches a recurrent state takes "auto" only)."""
    c, f = _text(config), check_kv_format(config, fmt)
    out: dict[str, int] = {}
    for name in layer_kinds(config):
        k = CACHE_KINDS[name]
        w = k.window(c)
        n = tokens if w is None else min(tokens, w)
        per_token = f.nbytes(k.per_token(c), k.rows(c), itemsize) * n
        out[name] = out.get(name, 0) + per_token + k.state(c) * itemsize
    return out


def kv_bytes(config: Any, itemsize: int, tokens: int, fmt: str = "auto") -> int:
    """Bytes of a KV cache holding `tokens` tokens in `itemsize`-byte values (or KV format
    `fmt`): what each layer's attention really caches (CACHE_KINDS), summed over layers."""
    return sum(kv_by_kind(config, itemsize, tokens, fmt).values())
