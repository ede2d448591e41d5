"""Batched decode, isolated: b sequences decode together, each token equal to its solo run.

    dec = BatchDecoder(model, max_batch=4)
    a, b = dec.add(prompt_a), dec.add(prompt_b)     # prefilled in chunks, between steps
    while dec.live:
        logits = dec.ready()                       # {sequence: logits [V]} awaiting a token
        dec.feed({s: int(l.argmax()) for s, l in logits.items()})   # one batched step
    dec.remove(a)                                  # frees its KV, caches and slot references

* **Isolated by default.** Each sequence keeps its own logical caches (its solo capacity,
  updated only by its own tokens: `use`, `prefetch`, the prefill seed), so it routes as it
  would alone. One slab serves them all (batch_slab.py: reference counts, each expert copied
  once per layer step however many sequences need it).
* **Each row as at b = 1** (`batch_invariant=True`, the default): the dense linears and the
  routers' logits through one seam (batch_ops.batch_linear), attention per sequence on its
  own KV, routing / `use` / predictions per sequence as the host decode step does them; the
  routed experts of all rows in one call of the CPU expert kernels, which compute each token
  as a one-token call does (other compute paths: one call per row, the host step's). So a
  sequence's logits are bit-identical to its solo run (`model.generate`, the host or device
  step) whatever its co-runners, their join times and the copies' timing.
* **Continuous batching.** `add` queues a prompt; its prefill (the solo prefill: exact
  routing, psr.runtime.chunked's chunks and boundaries) runs one chunk after each `feed`, or
  in `ready` when no sequence awaits a token, so a long prompt never stalls the others for
  more than a chunk. Sequences join and leave between steps.
* **The prompt cache** (`prompt_cache=`, psr.runtime.chunked's `PromptCache`, keyed as the
  solo prefill keys it: one cache serves both). A newcomer resumes from the longest cached
  prefix of its prompt when its prefill begins (its KV cache and routing history restored
  into its own state; its caches are seeded from that history after its last chunk, as
  solo), and its prefill keeps the states a solo prefill keeps. Hits resume where a solo
  hit would (any length for a row-invariant forward, else a chunk boundary), so a hit
  changes nothing: its tokens and logits are its solo run's.
* Decode steps take the host-driven path (the device step and graphs hold one sequence's
  caches); the batch's counts are its own (`BatchDecoder.stats`), not the model's `stats`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import psr_kernels as pk
from psr.cache import LogicalCache
from psr.runtime.batch_ops import BatchKV, DenseSeam, batch_linear, check_attention
from psr.runtime.batch_slab import SharedSlab, slab_size
from psr.runtime.chunked import PromptCache, boundaries, keeps
from psr.runtime.kv import cache_kwarg, output_cache
from psr.runtime.layer import MoELayer
from psr.runtime.prefill import PrefillStep, reads_host
from psr.runtime.slots import SlotMap
from psr.runtime.step import Routed, Step, non_finite
from psr.runtime.trace import Copy, LayerStep, Trace
from psr.store import CopyReason, cpu_kernels

if TYPE_CHECKING:
    from psr.runtime.context import StepContext
    from psr.runtime.model import OffloadedModel


@dataclass
class _Seq:
    """One sequence of a batch: its prompt, KV cache, logical caches and next logits."""

    id: int
    prompt: torch.Tensor  # [1, P] on the model's device
    caches: list[LogicalCache]
    history: list[list[list[int]]]  # per MoE layer, prefill's routed ids per token
    kv: Any = None
    done: int = 0  # prompt tokens prefilled (or resumed from the prompt cache)
    cached: int = 0  # prompt tokens resumed from the prompt cache
    length: int = 0  # tokens in its KV cache
    reserved: int = 0  # KV tokens set aside for it under kv_tokens (`add`)
    logits: torch.Tensor | None = None  # awaiting a token
    # Its decode steps' logical counts (routed, hits, misses, prefetches, ...): its solo
    # run's, as its caches are; the copies and stalls are the batch's (shared).
    stats: Counter[str] = field(default_factory=Counter)

    @property
    def prefilling(self) -> bool:
        return self.done < self.prompt.shape[1]


@dataclass
class _Row:
    """A sequence's routing at one layer step: its routed ids and those on the CPU."""

    routed: list[int]
    cpu: set[int] = field(default_factory=set)

    @property
    def members(self) -> list[int]:
        return [e for e in self.routed if e not in self.cpu]


class BatchPrefill(PrefillStep):
    """A newcomer's prefill chunk: the solo prefill step itself (its routing, its expert
    arithmetic, its seed), run on the sequence's own history and caches, lent to each
    layer for the call, and on a slot map of the store's slots as they are (a copy it
    stages may evict an expert another sequence holds: it is copied back when read)."""

    name = "batch-prefill"

    def __init__(self, runtime: StepContext, slab: SharedSlab, seq: _Seq) -> None:
        super().__init__(runtime)
        self.slab, self.seq = slab, seq

    @contextmanager
    def _lent(self, layer: MoELayer) -> Iterator[None]:
        i, rt = layer.index, self.rt
        saved = layer.cache, layer.history, layer.slots, layer.seeded
        layer.cache, layer.history = self.seq.caches[i], self.seq.history[i]
        layer.slots = SlotMap(rt.store.slot_experts(i)[: rt.capacity])
        try:
            yield
        finally:
            layer.cache, layer.history, layer.slots, layer.seeded = saved

    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        with self._lent(layer):
            return super().route(layer, x)

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        with self._lent(layer):
            out = super().experts(layer, x, ids, weights)
        if not self.rt.prefill_more:  # the prompt's last chunk: the cache is seeded
            self.slab.hold(layer.index, self.seq.caches[layer.index].order())
        return out


class BatchStep(Step):
    """One batched decode forward: per MoE layer, each row routed on its own sequence's
    caches (as the host decode step routes one token), then every row's experts."""

    name = "batch"

    def __init__(self, runtime: StepContext, dec: BatchDecoder, seqs: Sequence[_Seq]) -> None:
        super().__init__(runtime)
        self.dec, self.seqs = dec, list(seqs)
        self.pending: dict[int, list[_Row]] = {}
        self.layer_steps: list[tuple[int, int]] = []  # (MoE layer, slab.log's length then)
        self.routed: dict[int, list[_Row]] = {}  # MoE layer -> its rows (record_trace)

    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        rt, dec, i = self.rt, self.dec, layer.index
        inv = dec.batch_invariant
        if dec.slab.log is not None:
            self.layer_steps.append((i, len(dec.slab.log)))
        logits = self.logits(layer, x, lambda a, w, b: batch_linear(a, w, b, inv))
        lam = rt.steering.lam(layer)
        cap = rt.max_inserts(layer)
        # Every row's routing and predictions first (each a function of its own row and
        # its own cache's mask), then each sequence's cache updates in row order.
        masks = [s.caches[i].mask() for s in self.seqs] if lam else None
        try:
            w, ids, subs = self._route_rows(layer, logits, lam, masks)
        except pk.NonFiniteError as e:
            raise non_finite([i], "found while decoding") from e
        try:
            predictions = rt.steering.predictions_rows(layer, layer.need_residual())
        except pk.NonFiniteError as e:
            raise non_finite([i + 1], "found while predicting it") from e
        rows: list[_Row] = []
        prefetched: dict[int, list[int]] = {}
        for r, (seq, routed) in enumerate(zip(self.seqs, ids.tolist(), strict=True)):
            cache = seq.caches[i]
            used = cache.use(routed) if cap is None else cache.use(routed, cap)
            dec.track(i, used.misses)
            dec.count(seq, routed=len(routed), hits=used.hits,
                      misses=len(used.misses) + len(used.cpu),
                      prefetch_used=used.prefetch_used, substituted=subs[r],
                      cpu_experts=len(used.cpu))  # fmt: skip
            rows.append(_Row(routed, set(used.cpu)))
            for target, n, pred in predictions:
                ins = seq.caches[target].prefetch(pred[r], n)
                dec.track(target, ins)
                dec.count(seq, prefetches=len(ins))
                prefetched.setdefault(target, []).extend(a.expert for a in ins)
        for target, experts in prefetched.items():
            if experts and not reads_host(rt, rt.layers[target]):
                dec.slab.ensure(target, experts, CopyReason.PREFETCH, spill=False)
        self.pending[i] = rows
        return self.out(logits, w, ids)

    def _route_rows(
        self, layer: MoELayer, logits: torch.Tensor, lam: float, masks: list[list[bool]] | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(weights [b, k], ids [b, k], substituted per row): each row as its solo host
        step routes it. The torch path routes every row in one call (its ops are row-wise:
        softmax / top-k / sums along each row; tests/runtime/test_batch_route.py holds
        each row equal to its own call); the kernels once per row, on a fresh row."""
        rt = self.rt
        spec = rt.spec.route_spec(lam)
        dev = logits.device
        mask = None if masks is None else torch.tensor(masks, dtype=torch.bool, device=dev)
        if rt.ops.path == "torch" or logits.shape[0] == 1:
            w, ids, sub = rt.ops.route_counted(logits, spec, mask=mask, bias=layer.bias)
            return w, ids, sub.tolist()
        parts = [
            rt.ops.route_counted(logits[r : r + 1].clone(), spec,
                                 mask=None if mask is None else mask[r], bias=layer.bias)
            for r in range(logits.shape[0])
        ]  # fmt: skip
        w, ids, sub = (torch.cat(p) for p in zip(*parts, strict=True))
        return w, ids, sub.tolist()

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        rows = self.pending.pop(layer.index)
        self.routed[layer.index] = rows
        return self.dec.compute_experts(layer, x, ids, weights, rows)


class BatchDecoder:
    """Isolated batched decoding over one model (module docstring).

    `max_batch`: the most live sequences (prefilling or decoding); `add` refuses more.
    `batch_invariant` (default True): each row computed as at b = 1, so every sequence's
    logits equal its solo run's; False computes the dense linears over the whole batch
    (faster, but rows then depend on their co-runners; never the default).
    `kv_tokens` (default None: each sequence up to the model's context): the most tokens
    the live sequences' KV caches hold together (the memory the caller has for KV). Never
    met by evicting a live sequence's KV. `add(prompt, max_new_tokens)` reserves the
    prompt plus its new tokens (within the context): one whose reservation exceeds the
    budget is refused (`KVBudgetExceeded`), one that does not fit beside the live
    sequences' reservations is refused until one leaves (`waits` says so beforehand), so
    the admitted sequences' steps always fit. Without max_new_tokens only the prompt is
    reserved and `add` takes it beside any: a queued prefill chunk that does not fit
    waits (until a sequence leaves), and a `feed` whose step would pass the budget is
    refused before anything changes (the safety net either way).
    `slab_slots` (default: min(the store's slots, max_batch x the solo slots)): the shared
    slab's slots per MoE layer (batch_slab.py), from the solo slots up to the store's
    (`batch_slots` at load); each sequence's logical cache keeps the solo slots.
    `prompt_cache` (default None): a `PromptCache` newcomers resume from and their
    prefills fill (module docstring); its budget must hold one prefill chunk's KV.
    """

    def __init__(
        self, model: OffloadedModel, max_batch: int, *, batch_invariant: bool = True,
        kv_tokens: int | None = None, slab_slots: int | None = None,
        prompt_cache: PromptCache | None = None,
    ) -> None:  # fmt: skip
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if kv_tokens is not None and (
            isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 1
        ):
            raise ValueError(f"kv_tokens must be an int >= 1 or None, got {kv_tokens!r}")
        if prompt_cache is not None and not isinstance(prompt_cache, PromptCache):
            raise TypeError(
                f"prompt_cache must be a psr PromptCache, got {type(prompt_cache).__name__}"
            )
        rt = model.runtime
        with rt.lock:
            model._check_open()
            _check_model(model)
            if prompt_cache is not None:
                model.check_prompt_cache(prompt_cache)
            self.model, self.rt = model, rt
            self.max_batch, self.kv_tokens = max_batch, kv_tokens
            self.batch_invariant = bool(batch_invariant)
            self.prompt_cache = prompt_cache
            size = slab_size(rt.capacity, rt.max_capacity, max_batch, slab_slots)
            self.slab = SharedSlab(rt.store, len(rt.layers), size)
            # The dense seam of the forward the model has now (row-invariant or not: which
            # modules run once for all rows); rebuilt when that changes (`_dense_seam`).
            self._seam = DenseSeam(model.hf, self.batch_invariant)
            self._seam_rows = model.row_invariant
            # Whether a step runs on psr's kernels, per (row-invariant, experts_on): both
            # can change between steps (`_dense_seam`).
            self._kernels_key = (model.row_invariant, model.experts_on)
            self._on_kernels = model.decodes_on_kernels()
            self._kv_name = cache_kwarg(model.hf)
            self._seqs: dict[int, _Seq] = {}
            self._next_id = 0
            self.stats: Counter[str] = Counter()
            self.trace: Trace | None = None  # record_trace

    # --- the public calls -------------------------------------------------------------
    @property
    def live(self) -> list[int]:
        """The live sequences' ids, oldest first."""
        return list(self._seqs)

    def add(
        self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int | None = None
    ) -> int:
        """Queue a prompt (one sequence's token ids); returns its sequence id. Its prefill
        runs in chunks after the next `feed`s (or in `ready`). Under kv_tokens it reserves
        `reservation(len(prompt), max_new_tokens)` KV tokens (class docstring)."""
        rt = self.rt
        with rt.lock:
            self.model._check_open()
            ids = self.model._ids(prompt_ids)
            if len(self._seqs) >= self.max_batch:
                raise ValueError(
                    f"the batch is full: {self.max_batch} live sequences (max_batch); remove one"
                )
            P = ids.shape[1]
            need = self.reservation(P, max_new_tokens)
            if self.kv_tokens is not None:
                if need > self.kv_tokens:
                    what = f"a prompt of {P} tokens" + (
                        "" if max_new_tokens is None else f" + max_tokens {max_new_tokens}"
                    )
                    raise KVBudgetExceeded(
                        f"{what} exceeds the batch's KV budget of {self.kv_tokens} tokens "
                        f"(kv_tokens)" + ("" if max_new_tokens is None else ": lower max_tokens")
                    )
                if self.waits(P, max_new_tokens):
                    raise ValueError(
                        f"{need} KV tokens do not fit beside the live sequences' "
                        f"{self.kv_reserved} of kv_tokens={self.kv_tokens}: wait until one leaves"
                    )
            C, E = rt.capacity, rt.spec.num_experts
            n = len(rt.layers)
            seq = _Seq(self._next_id, ids, [LogicalCache(C, E) for _ in range(n)],
                       [[] for _ in range(n)], reserved=need)  # fmt: skip
            self._next_id += 1
            self._seqs[seq.id] = seq
            return seq.id

    def ready(self) -> dict[int, torch.Tensor]:
        """Logits `[V]` of the sequences awaiting their next token. When none awaits one,
        queued prefills run (chunk by chunk) until one does or none is left."""
        with self.rt.lock:
            while not self._awaiting() and self._prefill_chunk():
                pass
            return {s.id: s.logits for s in self._awaiting() if s.logits is not None}

    def feed(self, tokens: Mapping[int, int]) -> None:
        """One batched decode step: each given sequence (awaiting a token) takes its token;
        afterwards one chunk of a queued prefill runs."""
        with self.rt.lock:
            self.model._check_open()
            seqs = [self._checked(sid, tok) for sid, tok in sorted(tokens.items())]
            held = self.kv_held
            if seqs and self.kv_tokens is not None and held + len(seqs) > self.kv_tokens:
                raise ValueError(
                    f"this step would hold {held + len(seqs)} KV tokens, beyond the batch's "
                    f"kv_tokens={self.kv_tokens}: remove a sequence (none was evicted)"
                )
            if seqs:
                self._step(seqs, [int(tokens[s.id]) for s in seqs])
            self._prefill_chunk()

    def remove(self, seq_id: int) -> None:
        """The sequence leaves (finished or cancelled): its KV, its logical caches and its
        references to slab slots are freed."""
        with self.rt.lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                raise KeyError(f"no live sequence {seq_id!r} in this batch")
            for i, cache in enumerate(seq.caches):
                self.slab.drop(i, cache.order())
                cache.reset()
            seq.kv = seq.logits = None

    def record_trace(self) -> Trace:
        """Record the batch's decode steps from now on: one trace token per batch step,
        each MoE layer's step the union of its rows' experts (read once for the batch;
        once per run of rows when the union does not fit the slab) with their slots, and
        the copies the shared slab issued during it (psr.eval.latency prices it)."""
        rt = self.rt
        self.trace = Trace(
            rt.num_decoder_layers, [L.decoder_index for L in rt.layers], rt.spec.top_k,
            rt.expert_bytes, rt.policy.describe(), bytes_ratio=rt.bytes_ratio,
        )  # fmt: skip
        self.slab.log, self.slab.reads = [], []
        return self.trace

    def prefilling(self, seq_id: int) -> bool:
        """Whether sequence `seq_id`'s prompt is not yet all prefilled."""
        with self.rt.lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise KeyError(f"no live sequence {seq_id!r} in this batch")
            return seq.prefilling

    def cached_tokens(self, seq_id: int) -> int:
        """Prompt tokens of live sequence `seq_id` resumed from the prompt cache (0 before
        its prefill begins, or without a hit)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"no live sequence {seq_id!r} in this batch")
        return seq.cached

    def seq_stats(self, seq_id: int) -> dict[str, int]:
        """Live sequence `seq_id`'s logical counts over its decode steps (`routed`, `hits`,
        `misses`, `prefetches`, `prefetch_used`, `substituted`, `cpu_experts`; absent: 0):
        its solo run's counts."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"no live sequence {seq_id!r} in this batch")
        return dict(seq.stats)

    @property
    def kv_held(self) -> int:
        """Tokens the live sequences' KV caches hold together."""
        return sum(s.length for s in self._seqs.values())

    @property
    def kv_reserved(self) -> int:
        """KV tokens the live sequences reserved together (`add`)."""
        return sum(s.reserved for s in self._seqs.values())

    def reservation(self, prompt_len: int, max_new_tokens: int | None = None) -> int:
        """The KV tokens `add` reserves for a prompt of `prompt_len` tokens and up to
        `max_new_tokens` new ones (None: the prompt only), within the model's context."""
        if max_new_tokens is None:
            return prompt_len
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int or None, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.model.context
        need = prompt_len + max_new_tokens
        return need if limit is None else min(need, limit)

    def waits(self, prompt_len: int, max_new_tokens: int | None = None) -> bool:
        """Whether such a request must wait for a live sequence to leave before `add` takes
        it: its reservation fits kv_tokens, but not beside the live sequences' now. False
        without kv_tokens or max_new_tokens (its prefill waits instead), and for one beyond
        kv_tokens (`add` refuses it at once)."""
        if self.kv_tokens is None or max_new_tokens is None:
            return False
        need = self.reservation(prompt_len, max_new_tokens)
        return need <= self.kv_tokens < need + self.kv_reserved

    # --- inside -------------------------------------------------------------------------
    def _awaiting(self) -> list[_Seq]:
        return [s for s in self._seqs.values() if s.logits is not None]

    def _checked(self, seq_id: int, token: int) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"no live sequence {seq_id!r} in this batch")
        if seq.logits is None:
            raise ValueError(f"sequence {seq_id} is not awaiting a token (see ready())")
        vocab = self.model.config.vocab_size
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"sequence {seq_id}: token {token!r} is not an id in [0, {vocab})")
        limit = self.model.context
        if limit is not None and seq.length + 1 > limit:
            raise ValueError(f"sequence {seq_id} is at the model's context of {limit} tokens")
        return seq

    def _step(self, seqs: list[_Seq], tokens: list[int]) -> None:
        dev = self.model.device
        ids = torch.tensor([[t] for t in tokens], device=dev)
        pos = torch.tensor([[s.length] for s in seqs], device=dev)
        kv = BatchKV([s.kv for s in seqs])
        step = BatchStep(self.rt, self, seqs)
        seam = self._dense_seam()
        # On psr's kernels, torch's own ops on one thread (cpu_kernels.torch_ops_threads).
        threads = cpu_kernels.torch_ops_threads(1 if self._on_kernels else None)
        with threads, self.rt.batch_forward(step), seam.active(self.model.config, kv):
            out = self.model.hf(input_ids=ids, position_ids=pos, use_cache=True,
                                **{self._kv_name: kv})  # fmt: skip
        if self.trace is not None:
            self._record(step)
        logits = out.logits[:, -1]
        for r, s in enumerate(seqs):
            s.logits, s.length = logits[r], s.length + 1
        self.stats["steps"] += 1
        self.stats["tokens"] += len(seqs)

    def _dense_seam(self) -> DenseSeam:
        """The seam for the model's forward as it is now (set_row_invariant may have
        switched it since the last step: its row-invariant modules run once for all rows)."""
        if self._seam_rows != self.model.row_invariant:
            self._seam = DenseSeam(self.model.hf, self.batch_invariant)
            self._seam_rows = self.model.row_invariant
        key = (self.model.row_invariant, self.model.experts_on)
        if key != self._kernels_key:  # set_row_invariant / set_experts_on since the last step
            self._kernels_key, self._on_kernels = key, self.model.decodes_on_kernels()
        return self._seam

    def _record(self, step: BatchStep) -> None:
        """The step's layer steps into the trace, each with the copies issued from its
        routing to the next layer's."""
        assert self.trace is not None and self.slab.log is not None
        log, tok = self.slab.log, []
        reads = self.slab.reads or []
        ends = [at for _, at in step.layer_steps[1:]] + [len(log)]
        for (i, at), end in zip(step.layer_steps, ends, strict=True):
            rows = step.routed[i]
            # The slab's reads (runs of rows: an expert two runs read is read twice), or,
            # read from the host rows (the CPU backend), the union of the members.
            runs = [(u, s) for j, u, s in reads if j == i]
            union = [e for u, _ in runs for e in u] or sorted({e for r in rows for e in r.members})
            slots = [x for _, s in runs for x in s]
            cpu = {e for r in rows for e in r.cpu}
            copies = [Copy(layer, slot, e, "prefetch" if why == CopyReason.PREFETCH else "miss")
                      for layer, slot, e, why in log[at:end]]  # fmt: skip
            misses = sum(c.kind == "miss" and c.layer == i for c in copies)
            tok.append(LayerStep(i, union, slots, len(union) - misses, copies,
                                 cpu_experts=len(cpu)))  # fmt: skip
        self.trace.tokens.append(tok)
        log.clear()
        reads.clear()

    def _prefill_chunk(self) -> bool:
        """One chunk of the oldest queued prefill (the solo prefill's chunks); False if none,
        or if it waits: the chunk does not fit the KV budget beside the others' KV."""
        seq = next((s for s in self._seqs.values() if s.prefilling), None)
        if seq is None:
            return False
        T, chunk = seq.prompt.shape[1], self.model.prefill_chunk
        cache, key = self.prompt_cache, self.model._prefill_key(False)
        start, entry = seq.done, None
        if cache is not None and seq.done == 0:  # its prefill begins: the longest hit
            start, entry = cache.lookup(key, seq.prompt[0], self.model.row_invariant)
        end = boundaries(start, T, chunk)[0]
        # A hit's tokens count too: they enter the KV cache with the first chunk.
        if self.kv_tokens is not None and self.kv_held + end - seq.done > self.kv_tokens:
            return False
        if cache is not None and seq.done == 0:
            if entry is not None:
                seq.kv, seq.history = entry.restore(length=start)
                seq.done = seq.length = seq.cached = start
            cache.count(start, T - start)
        rt = self.rt
        past = {} if seq.kv is None else {self._kv_name: seq.kv}
        rt.prefill_more = end < T
        try:
            with rt.batch_forward(BatchPrefill(rt, self.slab, seq)):
                # Only the last row's logits are read (as the solo prefill: logits_to_keep).
                out = self.model.hf(
                    input_ids=seq.prompt[:, seq.done : end],
                    use_cache=True,
                    logits_to_keep=1,
                    **past,
                )
        finally:
            rt.prefill_more = False
        self.stats["prefill_tokens"] += end - seq.done
        seq.kv, seq.done, seq.length = output_cache(out), end, end
        # No graphs in a batch: a row-invariant forward's hits resume at any length.
        if cache is not None and keeps(end, T, self.model.row_invariant):
            cache.keep(key, seq.prompt[0, :end], seq.kv, seq.history, self.model.row_invariant)
        if end == T:
            seq.logits = out.logits[0, -1]
        return True

    def track(self, layer: int, inserts: Sequence[Any]) -> None:
        """A sequence's logical insertions (and their evictions) in the slab's references."""
        self.slab.hold(layer, [x.expert for x in inserts])
        self.slab.drop(layer, [x.evicted for x in inserts if x.evicted is not None])

    def count(self, seq: _Seq, **counts: int) -> None:
        """A row's logical counts: the batch's and its sequence's own."""
        self.stats.update(counts)
        seq.stats.update(counts)

    def compute_experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        rows: list[_Row],
    ) -> torch.Tensor:  # fmt: skip
        from psr.runtime.batch_experts import batch_experts

        return batch_experts(self.rt, self.slab, layer, x, ids, weights, rows)


class KVBudgetExceeded(ValueError):
    """A request's KV reservation exceeds the batch's whole budget (kv_tokens): it can
    never run in this batch, however long it waits."""


def _check_model(model: OffloadedModel) -> None:
    """Refuse (one line) what batched decode does not run."""
    rt = model.runtime
    if model.drafter is not None or rt.block_k is not None:
        raise ValueError("batched decode does not support speculative decoding")
    if rt.policy.mask != "logical":
        raise ValueError(
            f"batched decode needs a logical-cache policy; {rt.policy.name} reads copy timing"
        )
    if not rt.steering.spec_rule:
        raise ValueError("batched decode steers by the spec's rule only")
    check_attention(model.config)


def generate_batch(
    model: OffloadedModel,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    settings: Any,
    seeds: Sequence[int],
    max_batch: int,
    batch_invariant: bool = True,
    prompt_cache: PromptCache | None = None,
) -> list[list[int]]:
    """`OffloadedModel.generate_batch`: each prompt's new tokens, chosen as
    psr.runtime.generate chooses them (greedy, or its warpers and a generator seeded by the
    prompt's seed), the prompts admitted in order as places free up."""
    from psr.runtime.generate import TokenChooser

    dec = BatchDecoder(model, max_batch, batch_invariant=batch_invariant, prompt_cache=prompt_cache)
    queue = list(range(len(prompts)))
    out: list[list[int]] = [[] for _ in prompts]
    choosers: dict[int, TokenChooser] = {}  # sequence -> its choices
    which: dict[int, int] = {}  # sequence -> prompt index
    if settings.max_new_tokens == 0:
        return out
    while queue or dec.live:
        while queue and len(dec.live) < max_batch:
            j = queue.pop(0)
            s = dec.add(prompts[j])
            which[s], choosers[s] = j, TokenChooser(model._ids(prompts[j]), settings, seeds[j])
        tokens: dict[int, int] = {}
        for s, logits in dec.ready().items():
            token = choosers[s].choose(logits)
            out[which[s]].append(token)
            if choosers[s].done:
                dec.remove(s)
            else:
                tokens[s] = token
        dec.feed(tokens)
    return out
