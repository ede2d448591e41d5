"""Row-invariant attention on the CPU: each query row computed on its own against exactly
the keys it sees, so its output does not depend on how a prompt is chunked (a decode
step's one query is the same computation as that row inside any prefill chunk).

`rows_attention` is the one function (the CPU attention kernel, `cpu_attention`);
`ATTENTION` ("psr_rows") is the name it is registered under in transformers' attention
interface (`register`), which models set as their `_attn_implementation` while their
CPU forward is row-invariant (runtime/model.py). It reads the keys the cache update
returned: the whole dynamic cache of the layer (the queries are its last rows), never a
static cache (graphs keep sdpa).

`fuse` gives the attention modules whose forward is one of `FUSED`'s audited forwards a
forward that, on that path, does the rotary embedding, the cache update and rows_attention
in one kernel call (`cpu_rope_attention`) instead of ~40 torch ops: the same bits, as
the kernel rounds the rotary embedding as torch does and writes the same cache buffers.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from psr.runtime.kv_quant import GrowLayer
from psr.runtime.norms import same_code
from psr.store import cpu_kernels

ATTENTION = "psr_rows"


# The one function: the CPU attention kernel (psr.store.cpu_attention documents its causal,
# sliding-window, sinks and grouped-query semantics and why each row is invariant).
rows_attention = cpu_kernels.cpu_attention


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over `rows_attention`: query `[B, Hq, T, D]`, the
    updated cache's keys and values `[B, Hkv, L, D]` (the queries are its last T rows);
    returns `[B, T, Hq, Dv]` as the interface does. No mask: none is built for this
    implementation, the causal structure is rows_attention's."""
    B, _, T, D = query.shape
    L = key.shape[2]
    scale = D**-0.5 if scaling is None else scaling
    outs = [
        rows_attention(
            query[b].transpose(0, 1),
            key[b].transpose(0, 1),
            value[b].transpose(0, 1),
            q_start=L - T,
            scale=scale,
            window=sliding_window,
            sinks=s_aux,
        )
        for b in range(B)
    ]
    return torch.stack(outs), None


def register() -> None:
    """Register `ATTENTION` in transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


# Layer kinds rows_attention computes (transformers' config.layer_types); any other kind
# (linear attention, Llama 4's chunked attention) leaves a model's forward not row-invariant.
ROW_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def why_not_rows(config: Any) -> str | None:
    """Why a model's attention cannot run as `rows_attention` (None: it can)."""
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    other = sorted(types - ROW_LAYER_TYPES)
    if other:
        return f"attention layers of kind {', '.join(other)}"
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention"
    return None


# --- the fused decode-layer attention ------------------------------------------------


@dataclass(frozen=True)
class FusedKind:
    """One audited attention forward (`module`.`cls`'s, compared by bytecode) and what it
    does beside the projections, the rotary embedding, the cache update, the attention
    call and o_proj: `qk_norm` ("full": q_norm / k_norm over the whole projection, "head":
    over each head, None: none), `clip` (clamps q, k, v to config.clip_qkv when set), and
    the `sliding_window` it passes the attention function."""

    module: str
    cls: str
    qk_norm: str | None
    clip: bool
    window: Callable[[nn.Module], int | None]


def _no_window(m: nn.Module) -> int | None:
    return None


def _config_window(m: nn.Module) -> int | None:
    return getattr(m.config, "sliding_window", None)


def _own_window(m: nn.Module) -> int | None:
    return m.sliding_window  # type: ignore[return-value]


# The table: transformers' attention forwards psr computes in one call. A family's class
# qualifies when its forward's bytecode is one of these (most families copy Llama's,
# Mistral's or Qwen3's) and its module's rotary helpers are Llama's.
FUSED: tuple[FusedKind, ...] = (
    FusedKind("llama", "LlamaAttention", None, False, _no_window),
    FusedKind("mistral", "MistralAttention", None, False, _config_window),
    FusedKind("qwen3", "Qwen3Attention", "head", False, _own_window),
    FusedKind("olmoe", "OlmoeAttention", "full", True, _config_window),
)


def _code(fn: Any) -> Any:
    return getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None


_KINDS: dict[type, FusedKind | None] = {}  # attention class -> its FUSED kind (None: none)
_FUSED_CLASSES: dict[type, type] = {}  # attention class -> its fused subclass
_UNFUSED: dict[type, Any] = {}  # and back


def _reference(kind: FusedKind) -> tuple[Any, Any, Any]:
    """The code of `kind`'s forward and of its module's two rotary helpers."""
    mod = importlib.import_module(f"transformers.models.{kind.module}.modeling_{kind.module}")
    return (
        _code(getattr(mod, kind.cls).forward),
        _code(mod.apply_rotary_pos_emb),
        _code(mod.rotate_half),
    )


def fused_kind(cls: type) -> FusedKind | None:
    """The FUSED kind whose audited forward `cls` (an attention module class) has, with
    Llama's rotary helpers in its module (None: none)."""
    cls = _UNFUSED.get(cls, cls)
    if cls not in _KINDS:
        _KINDS[cls] = None
        mod = sys.modules.get(cls.__module__)
        mine = (
            _code(getattr(cls, "forward", None)),
            _code(getattr(mod, "apply_rotary_pos_emb", None)),
            _code(getattr(mod, "rotate_half", None)),
        )
        for kind in FUSED:
            if all(same_code(a, b) for a, b in zip(mine, _reference(kind), strict=True)):
                _KINDS[cls] = kind
                break
    return _KINDS[cls]


def _grow_layer(module: Any, cache: Any) -> GrowLayer | None:
    """The layer of `cache` that `module` updates when it is a GrowLayer (else None)."""
    layers = getattr(cache, "layers", None)
    idx = module.layer_idx
    if layers is None or getattr(cache, "offloading", False) or len(layers) <= idx:
        return None
    layer = layers[idx]
    return layer if type(layer) is GrowLayer else None


def _fusable(m: Any, x: torch.Tensor, rope: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the fused forward computes this call as the class's own forward would: the
    row-invariant forward's attention, a float32 or bfloat16 batch of one, a full-width
    rotary embedding in that dtype, no autograd."""
    cos = rope[0] if rope is not None else None
    return (
        m.config._attn_implementation == ATTENTION
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and x.dim() == 3
        and x.shape[0] == 1
        and not torch.is_grad_enabled()
        and isinstance(cos, torch.Tensor)
        and cos.dtype == x.dtype
        and rope[1].dtype == x.dtype
        and cos.shape == (1, x.shape[1], m.head_dim)
        and "past_key_values" not in kwargs
    )


def _fused_forward(
    self: Any,  # the attention module (its projections, norms and config by name)
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The audited forward with the rotary embedding, the cache update and rows_attention
    in one kernel call, where it computes rows_attention over a grown cache (GrowLayer,
    `_fusable`); the class's own forward anywhere else (a batch forward, other dtypes)."""
    kind, layer, x = fused_kind(type(self)), _grow_layer(self, cache), hidden_states
    if kind is None or layer is None or not _fusable(self, x, position_embeddings, kwargs):
        forward = _UNFUSED.get(type(self), type(self)).forward
        return forward(  # type: ignore[no-any-return]
            self, x, position_embeddings, attention_mask, cache=cache, **kwargs
        )
    assert position_embeddings is not None  # _fusable
    T, D = x.shape[1], self.head_dim
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if kind.qk_norm == "full":
        q, k = self.q_norm(q), self.k_norm(k)
    elif kind.qk_norm == "head":
        q, k = self.q_norm(q.view(1, T, -1, D)), self.k_norm(k.view(1, T, -1, D))
    clip = getattr(self.config, "clip_qkv", None) if kind.clip else None
    if clip is not None:
        for t in (q, k, v):
            t.clamp_(min=-clip, max=clip)
    q, k, v = q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D)
    room, n = layer.room_for(k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2))
    cos, sin = position_embeddings
    y = cpu_kernels.cpu_rope_attention(
        q, k, v, cos[0], sin[0], room.k[0], room.v[0],
        start=n, scale=self.scaling, window=kind.window(self),
    )  # fmt: skip
    layer.wrote(room, n + T)
    return self.o_proj(y.to(x.dtype).view(1, T, -1)), None


def _fused_class(cls: type) -> type:
    if cls not in _FUSED_CLASSES:
        sub = type(cls.__name__, (cls,), {"forward": _fused_forward, "__module__": cls.__module__})
        _FUSED_CLASSES[cls], _UNFUSED[sub] = sub, cls
    return _FUSED_CLASSES[cls]


def fuse(model: nn.Module, on: bool = True) -> int:
    """Give each attention module of `model` whose forward is audited (`fused_kind`) the
    fused forward (`on`), or take it back; returns how many modules it changed. A class
    swap, as runtime/norms.py's (no per-instance bound method, no reference cycle)."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if on and cls not in _UNFUSED and fused_kind(cls) is not None:
            m.__class__ = _fused_class(cls)
        elif not on and cls in _UNFUSED:
            m.__class__ = _UNFUSED[cls]
        else:
            continue
        n += 1
    return n
