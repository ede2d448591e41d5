"""The offloaded MoE runtime: routing policies over the logical cache, and the physical
side that mirrors it through the expert store.

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
recently (spec); its copies are counted separately.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import psr_kernels as pk
from psr.cache import LogicalCache, prefill_state
from psr.families import MoEConfig
from psr.policy import Policy
from psr.store import ExpertStore
from psr.trace import TraceRecorder

COUNT_KEYS = ("routed", "hits", "misses", "prefetches", "prefetch_used", "copies", "bytes_copied")


class Stats(Mapping):
    """Totals over decode steps (dict-like), plus per-token records and prefill counts."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {k: 0 for k in ("tokens", *COUNT_KEYS)}
        self.totals |= {
            "stall_s": 0.0,
            "decode_s": 0.0,
            "prefill_tokens": 0,
            "prefill_copies": 0,
            "prefill_bytes": 0,
            "prefill_stall_s": 0.0,
        }
        self.per_token: list[dict[str, float]] = []

    def new_token(self) -> dict[str, float]:
        rec = {k: 0 for k in COUNT_KEYS} | {"stall_s": 0.0, "time_s": 0.0}
        self.per_token.append(rec)
        self.totals["tokens"] += 1
        return rec

    def add(self, rec: dict[str, float] | None, key: str, value: float) -> None:
        self.totals[key] += value
        if rec is not None:
            rec[key] += value

    def summary(self) -> dict[str, float]:
        t = dict(self.totals)
        n = max(t["tokens"], 1)
        t["hit_rate"] = t["hits"] / t["routed"] if t["routed"] else 0.0
        t["misses_per_token"] = t["misses"] / n
        t["prefetch_used_frac"] = t["prefetch_used"] / t["prefetches"] if t["prefetches"] else 0.0
        t["tokens_per_s"] = t["tokens"] / t["decode_s"] if t["decode_s"] > 0 else 0.0
        return t

    def __getitem__(self, key: str) -> float:
        return self.summary()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.summary())

    def __len__(self) -> int:
        return len(self.summary())

    def table(self) -> str:
        s = self.summary()
        rows = [
            ("decode tokens", f"{s['tokens']:.0f}"),
            ("routed experts", f"{s['routed']:.0f}"),
            ("hits / misses", f"{s['hits']:.0f} / {s['misses']:.0f}"),
            ("hit rate", f"{s['hit_rate']:.3f}"),
            ("misses per token", f"{s['misses_per_token']:.2f}"),
            ("prefetch copies (used)", f"{s['prefetches']:.0f} ({s['prefetch_used']:.0f})"),
            ("bytes copied", f"{s['bytes_copied'] / 2**20:.1f} MiB"),
            ("stall time", f"{s['stall_s'] * 1e3:.1f} ms"),
            ("tokens / s", f"{s['tokens_per_s']:.1f}"),
            ("prefill copies", f"{s['prefill_copies']:.0f} ({s['prefill_bytes'] / 2**20:.1f} MiB)"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


@dataclass
class MoELayer:
    """Runtime state of one MoE layer."""

    decoder_index: int  # index among the model's decoder layers
    index: int  # index among MoE layers (= store layer)
    router: nn.Module  # the model's router (weight, e_score_correction_bias)
    norm: nn.Module  # this layer's post-attention RMSNorm (for predictions into it)
    cache: LogicalCache
    slot_expert: list[int]
    slot_of: dict[int, int] = field(default_factory=dict)
    history: list[list[int]] = field(default_factory=list)
    seeded: bool = False
    pending: list[int] | None = None  # routed ids of the current decode step
    pending_ids: torch.Tensor | None = None  # the same, as the tensor the router returned
    residual: torch.Tensor | None = None


class Ops:
    """The compute path: Triton kernels ('triton') or their torch references ('torch')."""

    def __init__(self, path: str) -> None:
        if path not in ("triton", "torch"):
            raise ValueError(f"compute must be 'auto', 'triton' or 'torch', got {path!r}")
        self.path = path
        k = path == "triton"
        self.route = pk.route if k else pk.route_ref
        self.predict_next = pk.predict_next if k else pk.predict_next_ref
        self.expert_ffn = pk.expert_ffn if k else pk.expert_ffn_ref


def _eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise TypeError(f"cannot find the epsilon of {type(norm).__name__}")


class OffloadRuntime:
    """Logical caches, policy and store for all MoE layers of one model."""

    def __init__(
        self,
        mcfg: MoEConfig,
        layers: list[tuple[int, nn.Module, nn.Module]],
        store: ExpertStore,
        policy: Policy,
        capacity: int,
        compute: str,
    ) -> None:
        self.cfg = mcfg
        self.store = store
        self.policy = policy
        self.capacity = capacity
        self.ops = Ops(compute)
        self.layers = [
            MoELayer(d, i, router, norm, LogicalCache(capacity, mcfg.num_experts), [-1] * capacity)
            for i, (d, router, norm) in enumerate(layers)
        ]
        self.expert_bytes = store.expert_bytes[0]
        self.max_capacity = store.layers[0].num_slots
        self.stats = Stats()
        self._tok: dict[str, float] | None = None
        self._stall_mark = 0.0
        self._prefill_mark: dict[str, float] | None = None
        self.recorder: TraceRecorder | None = None  # set to record decode traces

    def configure(self, policy: Policy, capacity: int) -> None:
        """Switch policy and slots per layer (at most the store's); the next forward starts
        a new sequence. Slot contents carry over physically, never logically."""
        if not self.cfg.top_k <= capacity <= self.max_capacity:
            raise ValueError(
                f"capacity {capacity} must be in [top_k={self.cfg.top_k}, "
                f"{self.max_capacity}] (the store's slots per layer)"
            )
        if policy.n > capacity:
            raise ValueError(f"n={policy.n} prefetches exceed the {capacity} slots per layer")
        self.store.synchronize()
        for L in self.layers:
            L.cache = LogicalCache(capacity, self.cfg.num_experts)
            L.slot_expert = self.store.slot_experts(L.index)[:capacity]
            L.slot_of, L.history, L.seeded, L.pending = {}, [], False, None
        self.policy, self.capacity = policy, capacity

    # --- sequence / token boundaries --------------------------------------------
    def begin_sequence(self) -> None:
        """A new sequence: caches empty until its prefill seeds them."""
        self._close_token()
        for L in self.layers:
            L.cache.reset()
            L.history, L.seeded, L.pending, L.residual = [], False, None, None
        self._prefill_mark = self.store.counters()

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
        if self.cfg.logits_fp32:
            return F.linear(x.float(), w.float())
        return F.linear(x, w)

    def _bias(self, L: MoELayer) -> torch.Tensor | None:
        return getattr(L.router, "e_score_correction_bias", None)

    def _route(self, L: MoELayer, logits: torch.Tensor, mask: torch.Tensor | None, lam: float):
        c = self.cfg
        return self.ops.route(
            logits,
            c.top_k,
            mask=mask,
            lam=lam,
            scoring=c.scoring,
            renormalize=c.renormalize,
            bias=self._bias(L),
            n_group=c.n_group,
            topk_group=c.topk_group,
            scaling=c.scaling,
        )

    def _mask(self, L: MoELayer, device: torch.device) -> torch.Tensor:
        if self.policy.mask == "physical":
            m = [False] * self.cfg.num_experts
            for slot, ok in enumerate(self.store.ready(L.index)):
                e = L.slot_expert[slot]
                if ok and e >= 0:
                    m[e] = True
        else:
            m = L.cache.mask()
        return torch.tensor(m, dtype=torch.bool, device=device)

    def route(self, L: MoELayer, x: torch.Tensor):
        """The router's forward: (logits, top-k weights, top-k ids), as the model's router."""
        logits = self._logits(L, x)
        if not L.seeded:  # prefill: exact routing
            w, ids = self._route(L, logits, None, 0.0)
            L.history.extend(ids.tolist())
        else:
            if x.shape[0] != 1:
                raise ValueError(f"decode steps take one token at a time, got {x.shape[0]}")
            if L.index == 0:
                if self._tok is not None:  # normally closed by end_step already
                    self._close_token()
                self._tok = self.stats.new_token()
                if self.recorder is not None:
                    self.recorder.new_token()
            lam = self.policy.lam
            w, ids = self._route(L, logits, self._mask(L, x.device) if lam > 0 else None, lam)
            self._use(L, ids[0].tolist())
            L.pending_ids = ids
            self._prefetch_next(L)
        if self.cfg.weights_in_logits_dtype:
            w = w.to(logits.dtype)
        return logits, w, ids

    def _load(self, L: MoELayer, inserts, kind: str) -> int:
        """Physical mirror of logical insertions: copy into the evicted expert's slot."""
        slots, experts = [], []
        for ins in inserts:
            if ins.evicted is not None:
                slot = L.slot_of.pop(ins.evicted)
            else:
                # A free place: a slot no logical member maps to (empty, or a leftover).
                slot = next(s for s in range(self.capacity) if L.slot_of.get(L.slot_expert[s]) != s)
            L.slot_expert[slot] = ins.expert
            L.slot_of[ins.expert] = slot
            slots.append(slot)
            experts.append(ins.expert)
            if self.recorder is not None:
                self.recorder.copy(L.index, slot, ins.expert, kind)
        if slots:
            self.store.load(L.index, slots, experts)
        return len(slots)

    def _use(self, L: MoELayer, routed: list[int]) -> None:
        r = L.cache.use(routed)
        if self.recorder is not None:
            self.recorder.routed(L.index, routed, r.hits)
        n = self._load(L, r.misses, "miss")
        s, t = self.stats, self._tok
        s.add(t, "routed", len(routed))
        s.add(t, "hits", r.hits)
        s.add(t, "misses", len(r.misses))
        s.add(t, "prefetch_used", r.prefetch_used)
        s.add(t, "copies", n)
        s.add(t, "bytes_copied", n * self.expert_bytes)
        L.pending = routed

    def _prefetch_next(self, L: MoELayer) -> None:
        n = self.policy.n
        if n == 0 or L.index + 1 >= len(self.layers):
            return
        nxt = self.layers[L.index + 1]
        if L.residual is None:
            raise RuntimeError(f"no residual captured for MoE layer {L.index}")
        c = self.cfg
        ids, _ = self.ops.predict_next(
            L.residual,
            nxt.norm.weight,
            nxt.router.weight,
            n,
            eps=_eps(nxt.norm),
            scoring=c.scoring,
            bias=self._bias(nxt),
            n_group=c.n_group,
            topk_group=c.topk_group,
        )
        inserts = nxt.cache.prefetch(ids[0].tolist(), n)
        k = self._load(nxt, inserts, "prefetch")
        s, t = self.stats, self._tok
        s.add(t, "prefetches", k)
        s.add(t, "copies", k)
        s.add(t, "bytes_copied", k * self.expert_bytes)

    # --- experts --------------------------------------------------------------------------
    def experts(
        self, L: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' forward: sum of routed experts' outputs, read from slab slots."""
        if not L.seeded:
            return self._prefill_experts(L, x, ids, weights)
        routed = L.pending
        # The model hands the router's ids tensor straight to its experts: identity, no sync.
        if routed is None or ids is not L.pending_ids:
            raise RuntimeError(f"MoE layer {L.index}: experts called without a matching route")
        L.pending, L.pending_ids = None, None
        slots = [L.slot_of[e] for e in routed]
        if self.recorder is not None:
            self.recorder.read(L.index, slots)
        c = self.cfg
        with self.store.reading(L.index, slots, routed) as slab:
            st = torch.tensor([slots], device=x.device)
            return self.ops.expert_ffn(
                x,
                slab,
                st,
                weights.float(),
                c.hidden_size,
                c.ffn_size,
                out_dtype=x.dtype,
                check_slots=False,
            )

    def _ffn_rows(self, slab_row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        H, Fd = self.cfg.hidden_size, self.cfg.ffn_size
        gate = slab_row[: Fd * H].view(Fd, H)
        up = slab_row[Fd * H : 2 * Fd * H].view(Fd, H)
        down = slab_row[2 * Fd * H :].view(H, Fd)
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    def _stage_slot(self, L: MoELayer, keep: set[int], here: dict[int, int]) -> int:
        """A slot to load a prefill expert into: empty, else not holding a `keep` expert
        (a duplicate copy of one counts as free), else any."""
        for pred in (
            lambda s, e: e < 0,
            lambda s, e: e not in keep or here.get(e) != s,
            lambda s, e: True,
        ):
            for s in range(self.capacity):
                if pred(s, L.slot_expert[s]):
                    return s
        raise AssertionError("unreachable")

    def _prefill_experts(
        self, L: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Exact experts for all prompt tokens, staged through the slab; then seed the cache."""
        init = prefill_state(L.history, self.capacity)
        keep = set(init)
        used = sorted(set(ids.flatten().tolist()))
        # Non-cached experts first, so the final ones stay resident.
        order = [e for e in used if e not in keep] + [e for e in used if e in keep]
        here = {e: s for s, e in enumerate(L.slot_expert) if e >= 0}
        out = torch.zeros_like(x)
        for e in order:
            if e not in here:
                s = self._stage_slot(L, keep, here)
                if here.get(L.slot_expert[s]) == s:
                    del here[L.slot_expert[s]]
                L.slot_expert[s] = e
                here[e] = s
                self.store.load(L.index, [s], [e])
            tok, pos = torch.where(ids == e)
            with self.store.reading(L.index, [here[e]], [e]) as slab:
                y = self._ffn_rows(slab[here[e]], x[tok]) * weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        missing = [e for e in init if e not in here]
        for e in missing:
            s = self._stage_slot(L, keep, here)
            if here.get(L.slot_expert[s]) == s:
                del here[L.slot_expert[s]]
            L.slot_expert[s] = e
            here[e] = s
        if missing:
            self.store.load(L.index, [here[e] for e in missing], missing)
        L.cache.reset(init)
        L.slot_of = {e: here[e] for e in init}
        L.seeded = True
        if self.decoding:
            self._end_prefill()
        return out


class PSRRouter(nn.Module):
    """Drop-in for a model's router module: returns (logits, weights, ids) like it."""

    def __init__(self, runtime: OffloadRuntime, layer: MoELayer) -> None:
        super().__init__()
        self.runtime = runtime
        self.layer = layer
        self.inner = layer.router  # keeps the router's parameters registered

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self.runtime.route(self.layer, x)


class OffloadedExperts(nn.Module):
    """Drop-in for a model's experts module; weights live in the expert store."""

    def __init__(self, runtime: OffloadRuntime, layer: MoELayer) -> None:
        super().__init__()
        self.runtime = runtime
        self.layer = layer

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.runtime.experts(self.layer, hidden_states, top_k_index, top_k_weights)
