"""Chunked prefill and the prompt cache.

A prompt is prefilled in chunks of `prefill_chunk` tokens at fixed absolute boundaries
(c, 2c, ...; the last chunk ends at the prompt's end), one forward each, the KV cache
carried between them. The logical caches are seeded after the last chunk from the routed
ids alone (prefill.py), whatever the chunking.

Whether the chunk matters depends on the forward. A row-invariant one (on the CPU backend,
`OffloadedModel.set_row_invariant`, which `psr serve` turns on with its prompt cache;
linears by `cpu_linear`, attention by `cpu_attention`, the experts by the CPU kernels)
computes every token bit-identically whatever the chunking, so the chunk is a speed
setting only. Otherwise attention over a chunk and
the experts grouped per chunk round as the chunk makes them: the chunk is then part of
the model's configuration (a given configuration reproduces its tokens and logits).

`PromptCache` keeps, after each boundary b < the prompt's end (and, for a row-invariant
forward, after the prompt's end), everything the rest of the run depends on: the KV cache
of the first b tokens and every MoE layer's routing history (the caches are seeded from it
after the prompt's last chunk, so it is their whole state there), keyed by the token ids
up to b and by the model and its configuration. A later prompt that extends a cached one
resumes from the longest cached prefix before its end (an index of the cached lengths per
configuration: one lookup per length, no scan of the tokens) and computes the rest: a
chunk boundary for a chunk-dependent forward, so exactly the chunks a miss computes on the
same state; any length for a row-invariant one, whose tokens do not depend on the chunks.
A row-invariant forward also resumes where a prompt parts from any cached one (requests
that share a system prompt, a chat template that rewrites the last turn): the longest
prefix it shares with a cached prompt, that entry's state cut there (its KV cache's first
tokens and their routed ids: each token's values depend only on the tokens up to it).
So there a prompt's end entry replaces its boundary entries, whose states it holds.
Either way a hit changes nothing (tokens and logits bit-identical). Held in memory up to a
byte budget, least recently used dropped first.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import numpy as np
import torch

DEFAULT_PREFILL_CHUNK = 512  # tokens per prefill chunk (llama.cpp's default micro-batch)


def check_chunk(chunk: Any, context: int | None) -> int:
    """`prefill_chunk` validated: an int in [1, the model's context]."""
    if isinstance(chunk, bool) or not isinstance(chunk, Integral) or int(chunk) < 1:
        raise ValueError(f"prefill_chunk must be an int >= 1 (tokens), got {chunk!r}")
    n = int(chunk)
    if context is not None and n > context:
        raise ValueError(f"prefill_chunk={n} exceeds the model's context of {context} tokens")
    return n


def boundaries(start: int, length: int, chunk: int) -> list[int]:
    """Ends of the chunks that prefill tokens [start, length): the multiples of `chunk`
    after `start` and below `length`, then `length`."""
    first = (start // chunk + 1) * chunk
    return [*range(first, length, chunk), length]


# --- KV caches at a boundary ---------------------------------------------------------------
def _layer_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

    from psr.runtime.kv_quant import PACKED_LAYERS, GrowLayer

    # Dynamic layers that replace their tensors (never write them in place), and GrowLayer
    # (writes in place only past every copy's length): shared, not copied; the static layer
    # (graphs): its first b positions copied out and back in.
    return (DynamicLayer, DynamicSlidingWindowLayer, GrowLayer, *PACKED_LAYERS), (StaticLayer,)


def kv_snapshot(kv: Any, length: int) -> tuple[Any, int] | None:
    """A copy of KV cache `kv` holding `length` tokens that `kv_restore` turns back into a
    cache, and its bytes; None for a cache psr cannot copy (static sliding-window or other
    layers of a static cache)."""
    shared, static = _layer_types()
    layers = getattr(kv, "layers", None)
    if layers is None:
        return None
    if all(type(x) in static for x in layers):
        parts = [(x.keys[:, :, :length].clone(), x.values[:, :, :length].clone()) for x in layers]
        return ("static", parts), sum(k.nbytes + v.nbytes for k, v in parts)
    if any(type(x) in static for x in layers) or getattr(kv, "offloading", False):
        return None
    snap = copy.copy(kv)
    snap.layers = [copy.copy(x) if type(x) in shared else copy.deepcopy(x) for x in layers]
    # The storages the copy keeps alive, each once (a GrowLayer's views: its whole buffers).
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for x in snap.layers
        for t in vars(x).values()
        if isinstance(t, torch.Tensor)
    }
    return ("dynamic", snap), sum(held.values())


def kv_restore(snap: Any, into: Any = None, cut: int = 0) -> Any:
    """The cache a snapshot was taken of: a new dynamic cache, or (a static snapshot) the
    static cache `into`, reset and refilled in place (a captured graph reads its tensors);
    `cut` > 0: without its last `cut` tokens (a snapshot `cuts_exactly` says can be cut)."""
    kind, data = snap
    if kind == "static":
        into.reset()
        for x, (k, v) in zip(into.layers, data, strict=True):
            n = k.shape[-2] - cut
            x.update(k[:, :, :n], v[:, :, :n])
        return into
    shared, _ = _layer_types()
    kv = copy.copy(data)
    kv.layers = [copy.copy(x) if type(x) in shared else copy.deepcopy(x) for x in data.layers]
    if cut:
        # Each layer's tensors become views of its first tokens (the entry's stay whole): a
        # GrowLayer then holds fewer tokens than its buffers' fill, so it copies before it
        # writes, never into the buffers the entry and its other copies read.
        for x in kv.layers:
            x.crop(-cut)
    return kv


def cuts_exactly(snap: Any, length: int) -> bool:
    """Whether snapshot `snap` of a `length`-token cache, cut to any shorter length, holds
    exactly what a cache of that many tokens would: every layer keeps every token (not a
    window that dropped some, nor a layer caching nothing) and is of a kind whose `crop`
    only drops the last tokens (the dynamic layers a snapshot shares: transformers' full and
    window layers, psr's grown and packed ones; a window below its size)."""
    kind, data = snap
    if kind == "static":
        return True
    shared, _ = _layer_types()
    return all(
        type(x) in shared
        and x.keys is not None
        and x.keys.shape[-2] == length
        and getattr(x, "cumulative_length", length) == length
        for x in data.layers
    )


# --- the prompt cache ------------------------------------------------------------------------
@dataclass
class Entry:
    kv: Any  # kv_snapshot's copy
    histories: list[torch.Tensor]  # per MoE layer, [b, k] routed ids (int32)
    nbytes: int
    tokens: int  # b: the prompt prefix it holds
    # A row-invariant forward's, cutting exactly (`cuts_exactly`): its state at any
    # shorter prefix is its first tokens'.
    cuttable: bool = False

    def restore(
        self, into: Any = None, length: int | None = None
    ) -> tuple[Any, list[list[list[int]]]]:
        """The state it holds, for a sequence to resume from: its KV cache (`kv_restore`;
        `into`: a static cache to refill) and each MoE layer's routed ids per token;
        `length` (a cuttable entry): the state after that many of its tokens."""
        n = self.tokens if length is None else length
        if n != self.tokens and not (self.cuttable and 0 < n < self.tokens):
            raise ValueError(f"a prompt-cache entry of {self.tokens} tokens cannot resume at {n}")
        kv = kv_restore(self.kv, into, self.tokens - n)
        return kv, [h[:n].tolist() for h in self.histories]


def keeps(end: int, length: int, any_length: bool) -> bool:
    """Whether the state after a chunk ending at `end` of a `length`-token prompt is kept:
    every boundary before the end, and the end itself for a row-invariant forward (whose
    hits may resume at any length)."""
    return end < length or any_length


@dataclass
class PromptCache:
    """Prefill states at prompt prefixes, for prompts that extend earlier ones (module
    docstring). `max_bytes`: the budget (KV and histories), least recently used dropped
    first. The caller keeps it and passes it to `generate(..., prompt_cache=...)`; one
    cache may serve several models (entries are keyed by the model and configuration)."""

    max_bytes: int
    _entries: OrderedDict[tuple[Hashable, bytes], Entry] = field(default_factory=OrderedDict)
    # per configuration, how many entries hold each prefix length (the lookup's index)
    _lengths: dict[Hashable, Counter[int]] = field(default_factory=dict)
    nbytes: int = 0
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens resumed from the cache, all requests
    computed_tokens: int = 0  # prompt tokens prefilled, all requests
    last_cached: int = 0  # the last request's cached tokens
    # Models used from different threads may share one cache: its bookkeeping is locked.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        b = self.max_bytes
        if isinstance(b, bool) or not isinstance(b, Integral) or b < 1:
            raise ValueError(f"prompt cache budget must be an int >= 1 (bytes), got {b!r}")

    def __len__(self) -> int:
        return len(self._entries)

    def check_budget(self, chunk_bytes: int, chunk: int) -> None:
        """Refuse a budget that cannot hold one chunk's KV (`chunk_bytes`)."""
        if self.max_bytes < chunk_bytes:
            raise ValueError(
                f"prompt cache budget of {self.max_bytes} bytes is below one prefill chunk's "
                f"KV ({chunk} tokens: {chunk_bytes} bytes)"
            )

    @staticmethod
    def _key(config: Hashable, ids: torch.Tensor) -> tuple[Hashable, bytes]:
        return config, ids.to("cpu", torch.int64).numpy().tobytes()

    def lookup(
        self, config: Hashable, ids: torch.Tensor, any_length: bool = False
    ) -> tuple[int, Entry | None]:
        """(n, entry): the longest cached prefix of prompt `ids [T]` before its end (0, None:
        none). `any_length` (a row-invariant forward, whose state after n tokens is the same
        whatever follows them): the longest prefix before its end that `ids` shares with
        any cached prompt of `config` whose entry cuts exactly (`Entry.cuttable`), when
        longer: a prompt that leaves a cached one inside it (another request with the same
        system prompt, a chat template that rewrites the last turn) resumes where they
        part; `entry.restore(length=n)` gives the state there."""
        T = ids.shape[0]
        with self._lock:
            best, key = 0, None
            lengths = self._lengths.get(config, Counter())
            for b in sorted((n for n in lengths if n < T), reverse=True):
                k = self._key(config, ids[:b])
                if k in self._entries:
                    best, key = b, k
                    break
            if any_length:
                best, key = self._shared(config, ids, best, key)
            if key is None:
                return 0, None
            self._entries.move_to_end(key)
            return best, self._entries[key]

    def _shared(
        self, config: Hashable, ids: torch.Tensor, best: int, key: tuple[Hashable, bytes] | None
    ) -> tuple[int, tuple[Hashable, bytes] | None]:
        """`lookup`'s any-length search (under the lock): the longest prefix (< T) that `ids`
        shares with a cuttable entry of `config`, if longer than `best` (the exact prefix
        found, whole: a tie keeps it); ties go to the shortest entry (the least to cut)."""
        new = ids.to("cpu", torch.int64).numpy()
        limit = new.shape[0] - 1
        rank = (best, -best)  # (tokens resumed, - the entry's tokens): the higher the better
        for k, entry in self._entries.items():
            if k[0] != config or not entry.cuttable:
                continue
            m = min(entry.tokens, limit)
            if (m, -entry.tokens) <= rank:  # it shares at most m: it cannot rank higher
                continue
            same = np.frombuffer(k[1], dtype=np.int64, count=m) == new[:m]
            n = m if same.all() else int(same.argmin())
            if (n, -entry.tokens) > rank:
                rank, key = (n, -entry.tokens), k
        return rank[0], key

    def _index(self, key: tuple[Hashable, bytes], entry: Entry, step: int) -> None:
        """Count `key`'s prefix length in (step 1) or out of (-1) its configuration's index."""
        config, n = key[0], len(key[1]) // 8  # int64 ids
        lengths = self._lengths.setdefault(config, Counter())
        lengths[n] += step
        if lengths[n] <= 0:
            del lengths[n]
        if not lengths:
            del self._lengths[config]
        self.nbytes += step * entry.nbytes

    def put(self, config: Hashable, ids: torch.Tensor, entry: Entry) -> None:
        """Keep the state after prompt prefix `ids`; the least recently used go first. A
        cuttable entry replaces the cuttable ones of its own prefixes (its chunk
        boundaries): cut, it gives their states, and each holds a KV buffer of its own."""
        if entry.nbytes > self.max_bytes:
            return
        key = self._key(config, ids)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._index(key, old, -1)
            if entry.cuttable:
                for b in [n for n in self._lengths.get(config, ()) if n < ids.shape[0]]:
                    k = self._key(config, ids[:b])
                    if k in self._entries and self._entries[k].cuttable:
                        self._index(k, self._entries.pop(k), -1)
            self._entries[key] = entry
            self._index(key, entry, 1)
            while self.nbytes > self.max_bytes:
                gone_key, gone = self._entries.popitem(last=False)
                self._index(gone_key, gone, -1)

    def keep(
        self,
        config: Hashable,
        ids: torch.Tensor,
        kv: Any,
        histories: list[list[list[int]]],
        any_length: bool = False,
    ) -> None:
        """Keep the state after prompt prefix `ids [b]`: the KV cache `kv` holding its b
        tokens and each MoE layer's routed ids `histories` (a cache psr cannot copy: not
        kept). `any_length`: the forward is row-invariant, so the state cut to any shorter
        prefix is that prefix's (`Entry.cuttable`, where the KV cache cuts exactly)."""
        b = ids.shape[0]
        snap = kv_snapshot(kv, b)
        if snap is None:
            return
        hist = [torch.tensor(h, dtype=torch.int32) for h in histories]
        nbytes = snap[1] + sum(h.nbytes for h in hist)
        cut = any_length and cuts_exactly(snap[0], b)
        self.put(config, ids, Entry(snap[0], hist, nbytes, b, cut))

    def count(self, cached: int, computed: int) -> None:
        """One request: `cached` prompt tokens resumed, `computed` prefilled."""
        with self._lock:
            self.last_cached = cached
            self.cached_tokens += cached
            self.computed_tokens += computed
            if cached:
                self.hits += 1
            else:
                self.misses += 1


# --- the driver ------------------------------------------------------------------------------
# One prefill chunk's forward: (ids [1, n], start, kv or None) -> (logits [1, n, V], kv).
Forward = Callable[[torch.Tensor, int, Any], tuple[torch.Tensor, Any]]


def prefill(
    runtime: Any,
    forward: Forward,
    ids: torch.Tensor,
    chunk: int,
    cache: PromptCache | None = None,
    config: Hashable = None,
    into: Any = None,
    keep_all: bool = False,
    any_length: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Prefill prompt `ids [1, T]` chunk by chunk (module docstring) through `forward`,
    resuming from `cache` where it holds a prefix of this prompt under `config`, and
    keeping every boundary computed and (`any_length`: the forward is row-invariant, any
    prefix resumes) the prompt's end. `runtime` (the OffloadRuntime) is told which forward
    is the prompt's last chunk. `into`: a static cache a snapshot is restored into (graphs).
    Returns the logits `[1, m, V]` of the last position (`keep_all`: of every position
    computed) and the KV cache."""
    T = ids.shape[1]
    start, kv = 0, None
    if cache is not None:
        start, entry = cache.lookup(config, ids[0], any_length)
        if entry is not None:
            kv, histories = entry.restore(into, start)
            runtime.resume_prefill(kv, histories)
        cache.count(start, T - start)
    kept: list[torch.Tensor] = []
    pos = start
    for end in boundaries(start, T, chunk):
        runtime.prefill_more = end < T
        try:
            logits, kv = forward(ids[:, pos:end], pos, kv)
        finally:
            runtime.prefill_more = False
        kept = [*kept, logits] if keep_all else [logits[:, -1:]]
        if cache is not None and keeps(end, T, any_length):
            cache.keep(config, ids[0, :end], kv, runtime.histories(), any_length)
        pos = end
    return torch.cat(kept, dim=1), kv
