"""The offloaded MoE engine: routing policies over the logical caches, and the physical
side that mirrors them through the expert store.

Per MoE layer and decode token (batch 1):
  route   biased top-k of the layer's router toward its logical cache (lam = 0: exact);
  use     logical `use`; each miss starts a copy into the evicted expert's slot;
  predict (n > 0) the next MoE layer's router on this layer's MoE input, normed as that
          layer norms it: logical `prefetch` into its cache, a copy per insertion;
  compute wait for this layer's routed slots only, run the experts from the slab, release.
Routing reads only the logical cache, never the store, so outputs do not depend on copy
timing; the store's copies affect latency alone. The `cache-prior-async` policy is the
exception by design: it biases toward slots whose copies have finished.

Prefill routes exactly and seeds each layer's cache with the experts it used most
recently (spec: docs/PSR.md); its copies are counted separately (`prefill.py`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import psr_kernels as pk
from psr.cache import Insertion, LogicalCache
from psr.policy import Policy
from psr.runtime.generate import output_cache
from psr.runtime.prefill import PrefillPlan, plan_prefill, run_prefill
from psr.runtime.slots import SlotMap
from psr.runtime.spec import MoESpec, resolve_capacity
from psr.runtime.stats import Stats
from psr.runtime.trace import TraceRecorder
from psr.store import ExpertStore


@dataclass
class Scoring:
    """A teacher-forced window scored in one forward (`OffloadRuntime.scoring`): tokens
    before `prompt_len` are prefill, each later one a decode step under the policy."""

    prompt_len: int
    length: int
    first_record: int  # index of its first decode step in stats.per_token
    first_trace: int  # ... and in the recorder's trace (-1: not recording)
    block: int = 1  # decode tokens per step: 1, or a verify block's size in block mode
    # MoE layer -> the predictions into it, in issue order: (issuing MoE layer, at most how
    # many to insert, per step the predicted ids).
    queued: dict[int, list[tuple[int, int, list[list[int]]]]] = field(default_factory=dict)

    @property
    def steps(self) -> list[tuple[int, int]]:
        """(first, end) token positions of each decode step after the prompt."""
        P, T, b = self.prompt_len, self.length, self.block
        return [(t, min(t + b, T)) for t in range(P, T, b)]


@dataclass
class MoELayer:
    """Runtime state of one MoE layer."""

    decoder_index: int  # index among the model's decoder layers
    index: int  # index among MoE layers (= store layer)
    router: nn.Module  # the model's router (weight, e_score_correction_bias)
    # This layer's post-attention RMSNorm, for predictions into it: its weight and eps,
    # not the module (the module's residual hook refers to the runtime: no cycle).
    norm_weight: torch.Tensor
    norm_eps: float
    cache: LogicalCache
    slots: SlotMap
    history: list[list[int]] = field(default_factory=list)  # prefill's routed ids per token
    seeded: bool = False
    pending: list[int] | None = None  # routed ids of the current decode step
    pending_ids: torch.Tensor | None = None  # the same, as the tensor the router returned
    residual: torch.Tensor | None = None
    plan: PrefillPlan | None = None  # a scored window's prefill staging

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.router, "e_score_correction_bias", None)


def norm_eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise TypeError(f"cannot find the epsilon of {type(norm).__name__}")


class OffloadRuntime:
    """Logical caches, policy and store for all MoE layers of one model.

    Args:
        spec: the model's MoE routing semantics and expert shapes.
        layers: per MoE layer, `(decoder index, router module, post-attention norm)`.
        store: holds every expert; its slab has at least `capacity` slots per layer.
        compute: 'auto' | 'triton' | 'torch' (psr_kernels.kernel_ops).
        num_decoder_layers: all decoder layers, dense ones included (for traces).
        expert_format: None (rows in a float dtype: gate, up, down back to back) or a
            psr_kernels.quant format ('int8', 'fp8', 'int4'): uint8 rows read by the
            dequantizing kernel. `bytes_ratio`: row bytes over the same expert in bf16,
            how the latency model prices its copies (1.0 for float rows).
    """

    def __init__(
        self,
        spec: MoESpec,
        layers: Sequence[tuple[int, nn.Module, nn.Module]],
        store: ExpertStore,
        policy: Policy,
        capacity: int,
        compute: str,
        num_decoder_layers: int,
        expert_format: str | None = None,
        group_size: int = 128,
    ) -> None:
        self.spec = spec
        self.expert_format = expert_format
        self.group_size = group_size
        self.bytes_ratio = (
            1.0
            if expert_format is None
            else pk.bytes_ratio(expert_format, spec.hidden_size, spec.ffn_size, group_size)
        )
        self.store = store
        self.policy = policy
        self.capacity = capacity
        self.ops = pk.kernel_ops(compute, store.device)
        self.num_decoder_layers = num_decoder_layers
        self.layers = [
            MoELayer(
                d,
                i,
                router,
                norm.weight,
                norm_eps(norm),
                LogicalCache(capacity, spec.num_experts),
                SlotMap([]),
            )
            for i, (d, router, norm) in enumerate(layers)
        ]
        for L in self.layers:
            L.slots.reset(store.slot_experts(L.index)[:capacity])
        self.expert_bytes = store.expert_bytes[0]
        self.max_capacity = store.layers[0].num_slots
        self.stats = Stats()
        self._tok: dict[str, float] | None = None
        self._stall_mark = 0.0
        self._prefill_mark: dict[str, float] | None = None
        self.recorder: TraceRecorder | None = None  # set to record decode traces
        # One sequence at a time: forwards hold the lock; a sequence belongs to the thread
        # that began it and to its KV-cache object (see enter_forward).
        self.lock = threading.RLock()
        self._owner: int | None = None
        self._kv_ref: Any = None
        self._scoring: Scoring | None = None
        # Block mode (speculative verification): one expert set of `block_k` per layer and
        # decode forward, whatever its number of tokens.
        self.block_k: int | None = None
        self._ahead2 = 0

    @property
    def ahead2(self) -> int:
        """Experimental steering variant beyond the spec (bench/variants.py, "ahead2"): per
        layer and decode token, also insert up to this many experts predicted by the router
        of the MoE layer two ahead (on this layer's MoE input), before that layer's own
        next-layer prediction. 0 (the spec, the default): the next layer only."""
        return self._ahead2

    @ahead2.setter
    def ahead2(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"ahead2 must be an int >= 0, got {n!r}")
        if n and self.block_k is not None:
            raise ValueError("block mode predicts the next layer only (ahead2 must be 0)")
        self._ahead2 = n

    def configure(self, policy: Policy, residency: float | None, slots: int | None) -> None:
        """Switch policy and slots per layer (at most the store's); the next forward starts
        a new sequence. Slot contents carry over physically, never logically."""
        capacity = resolve_capacity(self.spec, policy, residency, slots, self.max_capacity)
        self.store.synchronize()
        self.policy, self.capacity = policy, capacity
        for L in self.layers:
            L.cache = LogicalCache(capacity, self.spec.num_experts)
        self._forget_sequence()

    def new_recorder(self, policy_label: str | None = None) -> TraceRecorder:
        """Start recording decode steps; the recorder's `.trace` feeds psr.eval.latency."""
        self.recorder = TraceRecorder(
            self.num_decoder_layers,
            [L.decoder_index for L in self.layers],
            self.spec.top_k,
            self.expert_bytes,
            policy_label or self.policy.describe(),
            self.bytes_ratio,
        )
        return self.recorder

    # --- sequence / token boundaries --------------------------------------------
    def _forget_sequence(self) -> None:
        """Logical state emptied; the slot maps re-read from the store (the store is the
        truth about what each slot holds, also after a failed copy)."""
        for L in self.layers:
            L.cache.reset()
            L.slots.reset(self.store.slot_experts(L.index)[: self.capacity])
            L.history, L.seeded, L.pending, L.pending_ids, L.residual = [], False, None, None, None

    def begin_sequence(self) -> None:
        """A new sequence: caches empty until its prefill seeds them."""
        self._close_token()
        self._forget_sequence()
        self._prefill_mark = self.store.counters()

    def enter_forward(self, kv: Any) -> None:
        """Called (under `lock`) before each model forward with its KV cache: an empty or
        absent cache begins a new sequence; otherwise the forward must continue the
        current sequence, from the thread and with the cache object that began it, or it
        is refused (interleaved sequences would route on each other's caches)."""
        if kv is None or (hasattr(kv, "get_seq_length") and kv.get_seq_length() == 0):
            self.begin_sequence()
            self._owner = threading.get_ident()
            try:
                self._kv_ref = None if kv is None else weakref.ref(kv)
            except TypeError:  # a cache type without weakref support: thread check only
                self._kv_ref = None
            return
        if self._owner is None:
            raise RuntimeError(
                "psr: this forward continues a sequence the runtime never began "
                "(start decoding with an empty KV cache)"
            )
        if self._owner != threading.get_ident():
            raise RuntimeError(
                "psr: this model's current sequence belongs to another thread; psr decodes "
                "one sequence at a time: serialise calls (OffloadedModel methods wait for "
                "each other) or use one model per thread"
            )
        if self._kv_ref is not None and self._kv_ref() is not kv:
            raise RuntimeError(
                "psr: this forward's KV cache is not the current sequence's; psr decodes "
                "one sequence at a time (finish or restart the other sequence)"
            )

    def exit_forward(self, output: Any) -> None:
        """After a forward: a sequence begun without a cache object adopts the one the
        model returned (what the next forward must pass back)."""
        if self._kv_ref is None and self._owner is not None:
            kv = output_cache(output)
            if kv is not None:
                try:
                    self._kv_ref = weakref.ref(kv)
                except TypeError:
                    pass

    @property
    def decoding(self) -> bool:
        return bool(self.layers) and all(L.seeded for L in self.layers)

    def end_step(self, seconds: float) -> None:
        """After a decode forward of `seconds`: closes the token's record."""
        self.stats.totals["decode_s"] += seconds
        if self._tok is not None:
            self._tok["time_s"] = seconds
            self._close_token()

    def _close_token(self) -> None:
        stall = self.store.counters()["stall_s"]
        if self._tok is not None:
            self.stats.add(self._tok, "stall_s", stall - self._stall_mark)
        self._stall_mark = stall
        self._tok = None

    def _open_token(self) -> None:
        if self._tok is not None:  # normally closed by end_step already
            self._close_token()
        self._tok = self.stats.new_token()
        if self.recorder is not None:
            self.recorder.new_token()

    def _end_prefill(self) -> None:
        c, m = self.store.counters(), self._prefill_mark or {}
        self.stats.totals["prefill_copies"] += c["copies"] - m.get("copies", 0)
        self.stats.totals["prefill_bytes"] += c["bytes_copied"] - m.get("bytes_copied", 0)
        self.stats.totals["prefill_stall_s"] += c["stall_s"] - m.get("stall_s", 0.0)
        self._stall_mark = c["stall_s"]

    def capture_residual(self, L: MoELayer, h: torch.Tensor) -> None:
        """Input of the layer's post-attention norm: the state entering its MoE block."""
        if h.dim() == 3 and h.shape[0] != 1:
            raise ValueError(
                f"psr decodes one sequence at a time (batch 1); got batch {h.shape[0]}"
            )
        L.residual = h.reshape(-1, h.shape[-1])

    # --- routing ---------------------------------------------------------------------
    def _logits(self, L: MoELayer, x: torch.Tensor) -> torch.Tensor:
        w = L.router.weight
        if self.spec.logits_fp32:
            return F.linear(x.float(), w.float())
        return F.linear(x, w)

    def _mask(self, L: MoELayer, device: torch.device) -> torch.Tensor:
        if self.policy.mask == "physical":  # timing-dependent by design (the strawman)
            m = [False] * self.spec.num_experts
            for slot, ok in enumerate(self.store.ready(L.index)):
                e = L.slots.slot_expert[slot]
                if ok and e >= 0:
                    m[e] = True
        else:
            m = L.cache.mask()
        return torch.tensor(m, dtype=torch.bool, device=device)

    def route(
        self, L: MoELayer, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's forward: (logits, top-k weights, top-k ids), as the model's router."""
        logits = self._logits(L, x)
        c = self.spec
        kw = dict(bias=L.bias, **c.route_kwargs())
        if self._scoring is not None:
            w, ids = self._route_window(L, logits, kw)
        elif not L.seeded:  # prefill: exact routing
            w, ids = self.ops.route(logits, c.top_k, **kw)
            L.history.extend(ids.tolist())
        elif self.block_k is not None:  # a verify block: one expert set for its tokens
            if L.index == 0:
                self._open_token()
            w, ids = self._route_block(L, logits, kw)
            if L.residual is None:
                raise RuntimeError(f"no residual captured for MoE layer {L.index}")
            predicted = self._predict_block(L, L.residual)
            if predicted is not None:
                self._insert_prefetch(self.layers[L.index + 1], predicted, self.policy.n)
        else:
            if x.shape[0] != 1:
                raise ValueError(f"decode steps take one token at a time, got {x.shape[0]}")
            if L.index == 0:
                self._open_token()
            lam = self.lam_of(L)
            mask = self._mask(L, x.device) if lam > 0 else None
            w, ids = self.ops.route(logits, c.top_k, mask=mask, lam=lam, **kw)
            self._use(L, ids[0].tolist())
            L.pending_ids = ids
            self._prefetch_next(L)
        if c.weights_in_logits_dtype:
            w = w.to(logits.dtype)
        return logits, w, ids

    def _copy(
        self,
        L: MoELayer,
        inserts: list[Insertion],
        kind: str,
        at: tuple[int, int] | None = None,
    ) -> int:
        """Physical mirror of logical insertions: one batch of copies into their slots
        (while scoring: the slot map and the trace only). `at`: the trace step that
        issued them, when not the current one."""
        slots, experts = L.slots.place(inserts)
        if self.recorder is not None:
            for s, e in zip(slots, experts, strict=True):
                self.recorder.copy(L.index, s, e, kind, at)
        if slots and self._scoring is None:
            self.store.enqueue_copies(L.index, slots, experts)
        return len(slots)

    def _count(self, **counts: int) -> None:
        for key, value in counts.items():
            self.stats.add(self._tok, key, value)

    def _use(self, L: MoELayer, routed: list[int], trace_token: int = -1) -> None:
        r = L.cache.use(routed)
        if self.recorder is not None:
            self.recorder.routed(L.index, routed, r.hits, trace_token)
        n = self._copy(L, r.misses, "miss")
        self._count(
            routed=len(routed),
            hits=r.hits,
            misses=len(r.misses),
            prefetch_used=r.prefetch_used,
            copies=n,
            bytes_copied=n * self.expert_bytes,
        )
        L.pending = routed

    def lam_of(self, L: MoELayer) -> float:
        """The bias strength of a layer's routing: the policy's lam (one place to vary it
        per layer)."""
        return self.policy.lam

    def _predict_next(self, L: MoELayer, residual: torch.Tensor) -> list[list[int]] | None:
        """Per `residual` row of this layer, the ids the next MoE layer's router predicts
        (None when there is nothing to predict)."""
        return self._predict(L, residual, 1, self.policy.n)

    def _predict(
        self, L: MoELayer, residual: torch.Tensor, ahead: int, n: int
    ) -> list[list[int]] | None:
        """Per `residual` row of layer L, the `n` ids the router of MoE layer L + `ahead`
        predicts on it, normed as that layer norms its input (None: nothing to predict)."""
        if n == 0 or L.index + ahead >= len(self.layers):
            return None
        nxt = self.layers[L.index + ahead]
        c = self.spec
        ids, _ = self.ops.predict_next(
            residual,
            nxt.norm_weight,
            nxt.router.weight,
            n,
            eps=nxt.norm_eps,
            scoring=c.scoring,
            bias=nxt.bias,
            n_group=c.n_group,
            topk_group=c.topk_group,
        )
        return ids.tolist()

    def _insert_prefetch(
        self, nxt: MoELayer, predicted: list[int], n: int, at: tuple[int, int] | None = None
    ) -> None:
        """Spec `prefetch` of at most `n` ids into `nxt`'s cache, mirrored by copies."""
        inserts = nxt.cache.prefetch(predicted, n)
        k = self._copy(nxt, inserts, "prefetch", at)
        self._count(prefetches=k, copies=k, bytes_copied=k * self.expert_bytes)

    def _predictions(self, L: MoELayer, residual: torch.Tensor) -> list[tuple[int, int, list]]:
        """Layer L's prefetch predictions per `residual` row, in the order they are
        inserted: (target MoE layer, at most how many, per row the ids)."""
        out = []
        ids = self._predict_next(L, residual)
        if ids is not None:
            out.append((L.index + 1, self.policy.n, ids))
        ids2 = self._predict(L, residual, 2, self.ahead2)
        if ids2 is not None:
            out.append((L.index + 2, self.ahead2, ids2))
        return out

    def _prefetch_next(self, L: MoELayer) -> None:
        if L.residual is None:
            raise RuntimeError(f"no residual captured for MoE layer {L.index}")
        for target, n, ids in self._predictions(L, L.residual):
            self._insert_prefetch(self.layers[target], ids[0], n)

    # --- experts --------------------------------------------------------------------------
    def experts(
        self, L: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' forward: sum of routed experts' outputs, read from slab slots."""
        if self._scoring is not None:
            return self._experts_window(L, x, ids, weights)
        if not L.seeded:
            return self._prefill(L, x, ids, weights)
        routed = L.pending
        # The model hands the router's ids tensor straight to its experts: identity, no sync.
        if routed is None or ids is not L.pending_ids:
            raise RuntimeError(f"MoE layer {L.index}: experts called without a matching route")
        L.pending, L.pending_ids = None, None
        slots = L.slots.slots(routed)  # the experts this step reads: its routed ids or set
        if self.recorder is not None:
            self.recorder.read(L.index, slots)
        c = self.spec
        if ids.shape[0] == 1 and self.block_k is None:
            st = torch.tensor([slots], device=x.device)
        else:  # a verify block: each token's ids (inside the set) to slots, on the device
            table = torch.full((c.num_experts,), -1, dtype=torch.long)
            table[torch.tensor(routed)] = torch.tensor(slots)
            st = table.to(ids.device)[ids]
        with self.store.reading(L.index, slots, routed) as slab:
            return self._slab_ffn(x, slab, st, weights.float())

    def _slab_ffn(
        self, x: torch.Tensor, slab: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts of `x` read from slab rows, float or quantized."""
        c = self.spec
        if self.expert_format is None:
            return self.ops.expert_ffn(
                x,
                slab,
                slots,
                weights,
                c.hidden_size,
                c.ffn_size,
                out_dtype=x.dtype,
                check_slots=False,
            )
        return self.ops.expert_ffn_quant(
            x,
            slab,
            slots,
            weights,
            c.hidden_size,
            c.ffn_size,
            self.expert_format,
            group_size=self.group_size,
            out_dtype=x.dtype,
            check_slots=False,
        )

    def _row_ffn(self, row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One expert of `x` from its slab (or host) row: prefill and scoring on the CPU."""
        H, Fd = self.spec.hidden_size, self.spec.ffn_size
        if self.expert_format is None:
            gate, up, down = pk.unpack_expert(row, H, Fd)
            if row.dtype == x.dtype:
                return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
            gate, up, down = gate.float(), up.float(), down.float()  # e.g. bf16 rows
        else:
            gate, up, down = pk.dequantize_expert(
                row, H, Fd, self.expert_format, group_size=self.group_size
            )
        xf = x.float()  # fp32 weights, as the kernels compute
        return F.linear(F.silu(F.linear(xf, gate)) * F.linear(xf, up), down).to(x.dtype)

    # --- teacher-forced scoring: a whole window in one forward ---------------------------
    def begin_scoring(self, prompt_len: int, length: int, block: int = 1) -> None:
        """The next forward scores `length` tokens: the first `prompt_len` as prefill, each
        later one as a decode step, or (`block` > 1, block mode) each run of `block`
        tokens as one verify block. Refused for timing-dependent masks."""
        if block > 1 and self.block_k is None:
            raise ValueError("scoring in blocks needs block mode (set_block_mode)")
        if self.policy.mask != "logical":
            raise ValueError(
                f"teacher-forced scoring needs a logical-cache policy; {self.policy.name} "
                "reads copy timing (decode token by token instead)"
            )
        if not 1 <= prompt_len <= length:
            raise ValueError(f"prompt_len must be in [1, {length}], got {prompt_len}")
        self._scoring = Scoring(
            prompt_len,
            length,
            first_record=len(self.stats.per_token),
            first_trace=-1 if self.recorder is None else len(self.recorder.trace.tokens),
            block=block,
        )

    def count_prefill(self, tokens: int) -> None:
        """A prefill forward of `tokens` (a scored window's prefill is its prompt)."""
        sc = self._scoring
        self.stats.totals["prefill_tokens"] += tokens if sc is None else sc.prompt_len

    def end_scoring(self) -> None:
        """After the scoring forward: the sequence cannot be continued."""
        self._scoring = None
        self._owner = None
        if self._tok is not None:
            self._close_token()

    def _route_window(
        self, L: MoELayer, logits: torch.Tensor, kw: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route a window layer by layer: exact over the prompt (then the cache seed, the
        slot map staged as prefill stages it), then token by token under the policy, each
        token's prefetches from earlier layers (the previous one; with ahead2 also the one
        before, first) inserted just before it routes, exactly the order token-by-token
        decoding applies them in. This layer's predictions for all decode tokens are made
        here, in one batch, and queued for the layers they go to."""
        sc = self._scoring
        assert sc is not None
        P, T = sc.prompt_len, logits.shape[0]
        if T != sc.length:
            raise ValueError(f"scoring expected {sc.length} tokens, the forward has {T}")
        k, lam = self.spec.top_k, self.lam_of(L)
        if not bool(torch.isfinite(logits).all()):  # once for the window, not per token
            raise ValueError(f"MoE layer {L.index}: router logits contain NaN or inf")
        kw = dict(kw, check_finite=False)
        w_p, ids_p = self.ops.route(logits[:P], k, **kw)
        L.history.extend(ids_p.tolist())
        L.plan = plan_prefill(L.slots, L.history, ids_p.flatten().tolist())
        L.cache.reset(L.plan.init)
        L.seeded = True
        ws, idss = [w_p], [ids_p]
        queued = sc.queued.pop(L.index, [])
        steps = sc.steps
        for j, (t0, t1) in enumerate(steps):
            if L.index == 0:
                self._open_token()
            self._tok = self.stats.per_token[sc.first_record + j]
            trace_token = sc.first_trace + j if self.recorder is not None else -1
            for issuer, n, preds in queued:  # issued by earlier layers' steps of this token
                self._insert_prefetch(L, preds[j], n, (trace_token, issuer))
            if sc.block > 1:
                w, ids = self._route_block(L, logits[t0:t1], kw, trace_token)
            else:
                mask = self._mask(L, logits.device) if lam > 0 else None
                w, ids = self.ops.route(logits[t0:t1], k, mask=mask, lam=lam, **kw)
                self._use(L, ids[0].tolist(), trace_token)
            if self.recorder is not None:
                self.recorder.read(L.index, L.slots.slots(L.pending or []))
            ws.append(w)
            idss.append(ids)
        if L.residual is None:
            raise RuntimeError(f"no residual captured for MoE layer {L.index}")
        if sc.block > 1:
            preds = [self._predict_block(L, L.residual[t0:t1]) for t0, t1 in steps]
            if preds and preds[0] is not None:
                entry = (L.index, self.policy.n, [p or [] for p in preds])
                sc.queued.setdefault(L.index + 1, []).append(entry)
        else:
            for target, n, pred in self._predictions(L, L.residual[P:]):
                sc.queued.setdefault(target, []).append((L.index, n, pred))
        ids_all = torch.cat(idss)
        L.pending, L.pending_ids = None, ids_all
        return torch.cat(ws), ids_all

    # --- block mode: speculative verification ----------------------------------------
    def set_block_mode(self, block_k: int | None) -> None:
        """Block mode on (`block_k` experts per layer and verify block) or off (None)."""
        if block_k is not None:
            k, C = self.spec.top_k, self.capacity
            if isinstance(block_k, bool) or not isinstance(block_k, int) or not k <= block_k <= C:
                raise ValueError(
                    f"block_k={block_k!r} must be an int in [top_k={k}, slots per layer={C}]"
                )
            if self.ahead2:
                raise ValueError("block mode predicts the next layer only (ahead2 must be 0)")
            if self.spec.n_group > 1:
                raise ValueError("block mode does not support group-limited routers")
            if self.policy.mask != "logical":
                raise ValueError(f"block mode needs a logical-cache policy, not {self.policy.name}")
        self.block_k = block_k

    def _route_block(
        self, L: MoELayer, logits: torch.Tensor, kw: dict[str, Any], trace_token: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert set for a block's tokens (psr_kernels.block_routing), biased toward
        the logical cache; the set is `use`d as one routing (its misses copy now)."""
        assert self.block_k is not None
        lam = self.lam_of(L)
        mask = self._mask(L, logits.device) if lam > 0 else None
        chosen, w, ids = pk.route_block(
            logits,
            self.spec.top_k,
            self.block_k,
            mask=mask,
            lam=lam,
            scoring=kw["scoring"],
            renormalize=kw["renormalize"],
            bias=kw["bias"],
            scaling=kw["scaling"],
        )
        self._use(L, chosen.tolist(), trace_token)
        L.pending_ids = ids
        return w, ids

    def _predict_block(self, L: MoELayer, residual: torch.Tensor) -> list[int] | None:
        """The next MoE layer's `n` experts of largest summed score over a block's rows
        (its router, unbiased, on this layer's MoE input normed as it norms it)."""
        n = self.policy.n
        if n == 0 or L.index + 1 >= len(self.layers):
            return None
        nxt = self.layers[L.index + 1]
        h = pk.rms_norm_ref(residual, nxt.norm_weight, nxt.norm_eps)
        score = pk.block_scores_ref(h @ nxt.router.weight.float().t(), self.spec.scoring, nxt.bias)
        # Ties to the lower id, as everywhere.
        return torch.sort(score, descending=True, stable=True).indices[:n].tolist()

    def _experts_window(
        self, L: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Experts of a scored window, read from the host copies (no copies issued): the
        prompt as prefill computes it, then every decode token as a decode step does."""
        sc = self._scoring
        assert sc is not None
        if ids is not L.pending_ids:
            raise RuntimeError(f"MoE layer {L.index}: experts called without a matching route")
        L.pending_ids = None
        P = sc.prompt_len
        assert L.plan is not None
        head = run_prefill(
            self.store, L.index, L.plan, x[:P], ids[:P], weights[:P], self._row_ffn, False
        )
        L.plan = None
        if x.shape[0] == P:
            return head
        c = self.spec
        host = self.store.host(L.index)
        dec_ids, dec_w, xs = ids[P:], weights[P:].float(), x[P:]
        if self.ops.path == "torch":
            # CPU: each expert once over the tokens that chose it (as prefill computes);
            # equal to per-token decode steps up to floating-point rounding.
            tail = torch.zeros_like(xs)
            for e in torch.unique(dec_ids).tolist():
                tok, pos = torch.where(dec_ids == e)
                y = self._row_ffn(host[e].to(x.device), xs[tok]) * dec_w[tok, pos, None]
                tail.index_add_(0, tok, y.to(tail.dtype))
            return torch.cat([head, tail])
        used = torch.unique(dec_ids)
        rows = host[used].to(x.device)  # the experts this window decodes with, as a slab
        local = torch.full((c.num_experts,), -1, dtype=torch.long, device=x.device)
        local[used.to(x.device)] = torch.arange(len(used), device=x.device)
        slots = local[dec_ids.to(x.device)]
        tail = torch.cat(
            [
                self._slab_ffn(xs[i : i + 64], rows, slots[i : i + 64], dec_w[i : i + 64])
                for i in range(0, xs.shape[0], 64)
            ]
        )
        return torch.cat([head, tail])

    def _prefill(
        self, L: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        plan = plan_prefill(L.slots, L.history, ids.flatten().tolist())
        out = run_prefill(self.store, L.index, plan, x, ids, weights, self._row_ffn)
        L.cache.reset(plan.init)
        L.seeded = True
        if self.decoding:
            self._end_prefill()
        return out
