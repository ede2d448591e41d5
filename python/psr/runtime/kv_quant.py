"""A compact KV cache: `psr.load(..., kv_format="int8" | "fp8" | "bf16")`.

Keys and values are stored in the format's dtype (psr.runtime.kv.KV_FORMATS): int8 with
a symmetric absmax fp32 scale per (token, head), fp8 e4m3 with an fp32 scale per (token,
head), bf16 as is; what attention reads is the stored form dequantized to the compute
dtype, the tokens just appended included (so a forward reads what a later one will: a
prompt-cache hit is bit-identical to a miss). Built as transformers cache layers
(subclasses of its DynamicLayer / DynamicSlidingWindowLayer), so every attention kind
that caches through `update` takes it: MHA / GQA, sliding and chunked windows, DeepSeek's
MLA latent (transformers >= 5.24 caches the latent as keys and the rope key as values, one
head each). Kinds that keep a recurrent state are refused when the model loads
(kv.check_kv_format). Decode graphs capture a static cache, which has no packed layer:
`graphs=True` with a kv_format is refused, and graphs='auto' runs eagerly (graph_status
says why).

The psr forward wrapper (models/hf.py) gives a forward that would start a sequence
without a cache one from `new_cache`, and packs an empty transformers DynamicCache passed
in (`cache_for`); `set_kv_format` installs it on a model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers.cache_utils as _cache_utils
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from psr.runtime.kv import KVFormat, check_kv_format

_INT8_MAX = 127.0
# A layer that caches nothing (shared-KV layers); transformers 5.17 (the GPU image's) has none.
_DUMMY_LAYER: type | None = getattr(_cache_utils, "DummyLayer", None)


def pack(x: torch.Tensor, f: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x [..., D]` in format `f`: the stored values and their scales `[..., 1]` (fp32;
    None for an unscaled format)."""
    dtype = getattr(torch, str(f.dtype))
    if not f.quantized:
        return x.to(dtype), None
    top = _INT8_MAX if dtype == torch.int8 else torch.finfo(dtype).max
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / top).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero row: 0s
    q = x.float() / scale
    if dtype == torch.int8:
        q = q.round().clamp(-_INT8_MAX, _INT8_MAX)
    return q.to(dtype), scale


def unpack(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored values back in the compute `dtype`."""
    return q.to(dtype) if scale is None else (q.float() * scale).to(dtype)


class PackedLayer(DynamicLayer):
    """A full-attention layer whose keys and values are kept packed (module docstring):
    `keys` / `values` `[B, H, T, D]` in the format's dtype, `key_scales` / `value_scales`
    `[B, H, T, 1]` fp32 (None for bf16)."""

    is_croppable = True

    def __init__(self, fmt: KVFormat, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self.fmt = fmt
        self.key_scales: torch.Tensor | None = None
        self.value_scales: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype
        self.keys, self.key_scales = pack(key_states[..., :0, :], self.fmt)
        self.values, self.value_scales = pack(value_states[..., :0, :], self.fmt)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens packed; return every cached token's keys and values
        (the new ones included) dequantized."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._count(key_states.shape[-2])
        assert self.keys is not None and self.values is not None  # set by lazy_initialization
        k, ks = _cat(self.keys, self.key_scales, pack(key_states, self.fmt))
        v, vs = _cat(self.values, self.value_scales, pack(value_states, self.fmt))
        self._keep(k, ks, v, vs)
        return unpack(k, ks, self.dtype), unpack(v, vs, self.dtype)

    def _count(self, tokens: int) -> None:
        """Tokens seen (a window layer's position)."""

    def _keep(
        self, k: torch.Tensor, ks: torch.Tensor | None, v: torch.Tensor, vs: torch.Tensor | None
    ) -> None:
        self.keys, self.key_scales, self.values, self.value_scales = k, ks, v, vs

    def reset(self) -> None:
        super().reset()
        self.key_scales = self.value_scales = None

    def _map(self, fn: Any) -> None:
        """`fn` applied to every stored tensor (batch reorders and selections)."""
        if self.get_seq_length() == 0:
            return
        for name in ("keys", "values", "key_scales", "value_scales"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # keys / values (and a window's count)
        if self.is_initialized and self.key_scales is not None and self.value_scales is not None:
            n = self.keys.shape[-2]  # type: ignore[union-attr]
            self.key_scales = self.key_scales[..., :n, :]
            self.value_scales = self.value_scales[..., :n, :]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])


class PackedSlidingLayer(PackedLayer, DynamicSlidingWindowLayer):
    """A sliding-window (or chunked) layer kept packed: as transformers' dynamic window
    layer, the last `sliding_window - 1` tokens stay cached and a forward reads them and
    its own."""

    def __init__(self, fmt: KVFormat, sliding_window: int) -> None:
        super().__init__(fmt, sliding_window=sliding_window)

    def _count(self, tokens: int) -> None:
        self.cumulative_length += tokens

    def _keep(
        self, k: torch.Tensor, ks: torch.Tensor | None, v: torch.Tensor, vs: torch.Tensor | None
    ) -> None:
        keep = slice(-self.sliding_window + 1, None)
        super()._keep(
            k[:, :, keep],
            None if ks is None else ks[:, :, keep],
            v[:, :, keep],
            None if vs is None else vs[:, :, keep],
        )


def _cat(
    q: torch.Tensor, s: torch.Tensor | None, new: tuple[torch.Tensor, torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cached (values, scales) with `new` appended along the tokens."""
    q = torch.cat([q, new[0]], dim=-2)
    return q, None if s is None or new[1] is None else torch.cat([s, new[1]], dim=-2)


# Room a GrowLayer buffer leaves past what it holds: at least this many tokens, and an
# eighth of its length (a copy of the cache every length / 8 tokens, at most 1/8 unused),
# never past the model's context: a cache decoded to its context holds exactly the KV bytes
# the memory plan counts (models/memory_plan.py).
GROW_MIN = 256


def grow_capacity(need: int, limit: int | None) -> int:
    """Tokens a GrowLayer buffer holds when `need` tokens no longer fit: `need` and room
    past it, at most `limit` (the context; a longer sequence gets no room, it still runs)."""
    cap = need + max(GROW_MIN, need // 8)
    return cap if limit is None else max(need, min(cap, limit))


class _Room:
    """A GrowLayer's buffers `[B, H, capacity, D]` and how many positions are written (not
    tensors themselves: the prompt cache counts a layer's tensors, its views)."""

    __slots__ = ("fill", "k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v, self.fill = k, v, 0


class GrowLayer(DynamicLayer):
    """A full-attention layer of transformers' own format ("auto") whose keys and values live
    in buffers with room to grow: a step writes its tokens in place, where DynamicLayer
    copies the whole cache (`torch.cat`, O(length) per decode token). `keys` / `values` are
    views of the buffers' first `length` positions, holding the same values DynamicLayer
    would. Shallow copies (the prompt cache's snapshots) share the buffers; only a layer
    whose length is the buffers' fill writes in place, any other (and one whose tensors
    were replaced: crop, reorder, offload) first copies its tokens to new buffers, so the
    values of a view once returned never change. `limit`: the context (room stops there)."""

    def __init__(self, limit: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self.limit = limit

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.room: _Room | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens `[B, H, T, D]`; return every cached token's keys and values."""
        r, n = self.room_for(key_states, value_states)
        t = key_states.shape[-2]
        r.k[:, :, n : n + t].copy_(key_states)
        r.v[:, :, n : n + t].copy_(value_states)
        return self.wrote(r, n + t)

    def room_for(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[_Room, int]:
        """The buffers the next tokens (shaped and typed as `key_states` / `value_states`
        `[B, H, T, D]`) are written to, in place from the position returned (grown or copied
        first where needed, as `update` does); `wrote` then records them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        r = self.room
        if r is None or not self._writes_in_place(r, n, n + t, key_states, value_states):
            r = self.room = self._grown(n + t, key_states, value_states)
        return r, n

    def wrote(self, r: _Room, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Record `r`'s positions up to `end` as written (`room_for`'s buffers); returns every
        cached token's keys and values."""
        r.fill = end
        self.keys, self.values = r.k[:, :, :end], r.v[:, :, :end]
        return self.keys, self.values

    def _writes_in_place(
        self, r: _Room, n: int, need: int, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Whether `r` takes the next tokens in place: this layer's tensors are its views, at
        its fill, with room for `need` tokens of new rows shaped and typed as `k` / `v`."""
        assert self.keys is not None and self.values is not None
        return (
            r.fill == n
            and need <= r.k.shape[-2]
            and self.keys.data_ptr() == r.k.data_ptr()
            and self.values.data_ptr() == r.v.data_ptr()
            and all(
                (t.shape[:2], t.shape[3], t.dtype, t.device)
                == (b.shape[:2], b.shape[3], b.dtype, b.device)
                for t, b in ((k, r.k), (v, r.v))
            )
        )

    def _grown(self, need: int, k: torch.Tensor, v: torch.Tensor) -> _Room:
        """New buffers for `need` tokens and room past them, this layer's tokens copied in."""
        cap = grow_capacity(need, self.limit)
        r = _Room(
            k.new_empty(*k.shape[:2], cap, k.shape[3]), v.new_empty(*v.shape[:2], cap, v.shape[3])
        )
        n = self.get_seq_length()
        if n:
            assert self.keys is not None and self.values is not None
            r.k[:, :, :n].copy_(self.keys)
            r.v[:, :, :n].copy_(self.values)
        r.fill = n
        return r

    def reset(self) -> None:
        super().reset()
        self.room = None


# transformers' dynamic layer class -> its twin in format `f`: packed, or ("auto") a
# full-attention layer grown in place; other layers as they are ("auto"; a DummyLayer
# caches nothing).
def _packed(layer: Any, f: KVFormat, limit: int | None = None) -> Any:
    if isinstance(layer, (*PACKED_LAYERS, GrowLayer)):
        return layer
    if type(layer) is DynamicLayer:
        return PackedLayer(f) if f.dtype is not None else GrowLayer(limit)
    if (_DUMMY_LAYER is not None and type(layer) is _DUMMY_LAYER) or f.dtype is None:
        return layer
    if type(layer) is DynamicSlidingWindowLayer:
        return PackedSlidingLayer(f, layer.sliding_window)
    what = type(layer).__name__
    raise ValueError(f"kv_format={f.name!r}: a {what} cache layer has no packed form")


# The packed layers, for the prompt cache (chunked.py): like transformers' dynamic ones they
# replace their tensors on update, never write them in place.
PACKED_LAYERS: tuple[type, ...] = (PackedLayer, PackedSlidingLayer)


def new_cache(config: Any, fmt: str, limit: int | None = None) -> DynamicCache:
    """An empty cache of `config`'s layers in KV format `fmt` (KV_FORMATS; "auto":
    transformers' own, full-attention layers grown in place up to `limit` tokens)."""
    f = check_kv_format(config, fmt)
    cache = DynamicCache(config=config)
    cache.layers = [_packed(x, f, limit) for x in cache.layers]
    return cache


def cache_for(config: Any, fmt: str, kv: Any, limit: int | None = None) -> Any:
    """The cache a forward starting a sequence uses in KV format `fmt`: `new_cache`'s for
    none, else `kv` itself, its layers packed in place when it is an empty transformers
    DynamicCache (the one transformers' `generate` makes for an offloaded model)."""
    if kv is None:
        return new_cache(config, fmt, limit)
    if type(kv) is not DynamicCache or kv.offloading:  # e.g. a static cache, a batch's
        return kv
    if not any(getattr(x, "is_initialized", False) for x in kv.layers):
        f = check_kv_format(config, fmt)
        kv.layers = [_packed(x, f, limit) for x in kv.layers]
        if kv.layer_class_to_replicate is DynamicLayer:  # layers made on first update
            grow = functools.partial(GrowLayer, limit)
            kv.layer_class_to_replicate = (
                functools.partial(PackedLayer, f) if f.dtype is not None else grow  # type: ignore[assignment]
            )
    return kv


def set_kv_format(hf: nn.Module, fmt: str, context: int | None = None) -> None:
    """Decode `hf` (psr-wrapped) with KV format `fmt`: psr's forward wrapper passes each
    forward's cache through `cache_for` (a one-line ValueError for a kind that has none;
    "auto": full-attention layers grown in place, `GrowLayer`, never past `context`)."""
    f = check_kv_format(hf.config, fmt)
    hf.psr_kv_format = f.name  # type: ignore[assignment]
    hf.psr_kv_cache = functools.partial(cache_for, hf.config, f.name, limit=context)  # type: ignore[assignment]
