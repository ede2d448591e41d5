"""The offloaded MoE engine: routing policies over the logical caches, and the physical
side that mirrors them through the expert store.

Per MoE layer and decode token (batch 1):
  route   biased top-k of the layer's router toward its logical cache (lam = 0: exact);
  use     logical `use`; each miss starts a copy into the evicted expert's slot;
  predict (n > 0) the next MoE layer's router on this layer's MoE input, normed as that
          layer norms it: logical `prefetch` into its cache, a copy per insertion;
  compute wait for this layer's routed slots only, run the experts from the slab.
Routing reads only the logical cache, never the copies, so outputs do not depend on copy
timing; copies affect latency alone. The `cache-prior-async` policy is the exception by
design: it biases toward slots whose copies have finished.

Each forward takes one step (`psr.runtime.step`), chosen once when it begins:
  prefill   a sequence's first forward: exact routing, the caches seeded (prefill.py);
  device    a decode token on device-resident caches, no host read (device_decode.py);
  host      a decode token on the host caches, copies issued by the host (host_decode.py):
            decode="host", cache-prior-async, steering variants, trace recording;
  verify    a speculative verify block, routed by the verify rule (verify.py,
            host_decode.py);
  window    a teacher-forced scoring window in one forward (window.py).
The engine owns the layers and the configuration; the sequence guard (guard.py), the
accounting (accounting.py), the expert compute (compute.py), the steering (steering.py)
and the host caches (bookkeeping.py) each do one job.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

import psr_kernels as pk
from psr.cache import LogicalCache
from psr.machine import PrefillSplit
from psr.policy import Policy
from psr.runtime.accounting import Accounting
from psr.runtime.bookkeeping import HostCaches
from psr.runtime.compute import ExpertCompute
from psr.runtime.device_decode import DeviceDecode
from psr.runtime.expert_placement import ExpertPlacement, GpuPlacement, make_placement
from psr.runtime.guard import SequenceGuard
from psr.runtime.host_decode import HostDecode, VerifyBlock
from psr.runtime.layer import MoELayer, Wiring, norm_eps, weight_of
from psr.runtime.prefill import PrefillStep
from psr.runtime.slots import SlotMap
from psr.runtime.spec import MoESpec, resolve_capacity
from psr.runtime.stats import Stats
from psr.runtime.steering import Steering
from psr.runtime.step import Routed, Step
from psr.runtime.trace import TraceRecorder
from psr.runtime.verify import VerifyRule
from psr.runtime.window import Scoring, ScoringWindow
from psr.store import ExpertStore
from psr.vocab import DECODE_MODES, decode_mode

__all__ = ["DECODE_MODES", "MoELayer", "OffloadRuntime", "Wiring", "norm_eps"]


class OffloadRuntime:
    """Logical caches, policy and store for all MoE layers of one model.

    Args:
        spec: the model's MoE routing semantics and expert shapes.
        layers: per MoE layer, its `Wiring` (the family says where each part lives).
        store: holds every expert; its slab has at least `capacity` slots per layer.
        compute: 'auto' | 'triton' | 'torch' (psr_kernels.kernel_ops).
        num_decoder_layers: all decoder layers, dense ones included (for traces).
        expert_format: the rows' `psr_kernels.RowFormat` or its word: None / native / bf16
            (rows in a float dtype: gate, up, down back to back), int8 / fp8 / int4 or a
            GGML row format ('gguf:Q4_K,Q4_K,Q6_K': a GGUF file's blocks): uint8 rows read
            by the dequantizing kernel; or one such format per MoE layer (a GGUF file
            mixes types across layers). `bytes_ratio`: mean row bytes over the same expert in
            bf16, how the latency model prices its copies (1.0 for float rows).
        decode: 'device' (default: the sync-free step wherever it applies) or 'host'
            (always the host-driven step).
    """

    def __init__(
        self,
        spec: MoESpec,
        layers: Sequence[Wiring],
        store: ExpertStore,
        policy: Policy,
        capacity: int,
        compute: str,
        num_decoder_layers: int,
        expert_format: pk.FormatLike | Sequence[pk.FormatLike] = None,
        group_size: int = 128,
        decode: str = "device",
    ) -> None:
        self.spec = spec
        self._set_formats(expert_format, len(layers))
        self.group_size = group_size
        self.store = store
        self.policy = policy
        self.capacity = capacity
        self.ops = pk.kernel_ops(compute, store.device)
        kinds = {
            f: ExpertCompute(spec, self.ops, f, group_size) for f in dict.fromkeys(self.row_formats)
        }
        self.computes = [kinds[f] for f in self.row_formats]  # per MoE layer
        self.compute = self.computes[0]
        self.num_decoder_layers = num_decoder_layers
        self.layers = _moe_layers(spec, layers, store, capacity)
        layer_bytes = store.expert_bytes[: len(layers)]
        # The mean row: what the latency model prices a copy at (rows differ per layer in
        # a mixed GGUF file); the statistics count each layer's own bytes.
        self.expert_bytes = round(sum(layer_bytes) / len(layer_bytes))
        bf16 = 3 * spec.hidden_size * spec.ffn_size * 2
        floats = all(f.is_float for f in self.row_formats)
        self.bytes_ratio = 1.0 if floats else self.expert_bytes / bf16
        self.max_capacity = store.layers[0].num_slots
        self.acct = Accounting(store, layer_bytes)
        self.book = HostCaches(store, self.acct, spec.num_experts)
        self.steering = Steering(self)
        self.guard = SequenceGuard()
        self.lock = self.guard.lock  # forwards and OffloadedModel methods hold it
        # Block mode (speculative verification): each decode forward, whatever its number of
        # tokens, is one verify block routed by this rule (runtime/verify.py).
        self.verify: VerifyRule | None = None
        self.decode_mode = "device"
        self.set_decode(decode)
        # Where misses are computed (set_experts_on): per MoE layer, at most how many of a
        # decode step's misses are copied (None: all, the spec's `use`).
        self.placement: ExpertPlacement = GpuPlacement([None] * len(self.layers))
        self._scoring: Scoring | None = None
        self._host = HostDecode(self)
        self._device = DeviceDecode(self)
        self._step: Step = PrefillStep(self)
        self._batch: Step | None = None  # a batch decoder's forward runs (batch_forward)
        self._call_t0: float | None = None
        # Chunked prefill (psr.runtime.chunked): True while the prefill forward running is
        # followed by more chunks of the same prompt (the caches are seeded after the last).
        self.prefill_more = False
        # Where prefill reads its experts (prefill.py): "host" rows on the CPU backend
        # (every expert held in memory), else staged through the "slab".
        held = not self.has_pageable_rows()
        self.prefill_reads = "host" if store.backend == "cpu" and held else "slab"
        # On the slab path, which of a chunk's experts prefill computes on the CPU from
        # their host rows instead of copying them (psr.machine.PrefillSplit; set_prefill_split).
        self.prefill_split = PrefillSplit.off(len(self.layers))

    def _set_formats(
        self, expert_format: pk.FormatLike | Sequence[pk.FormatLike], num_layers: int
    ) -> None:
        """Each MoE layer's row format, parsed once here, and the model's."""
        given = (
            [expert_format] * num_layers
            if expert_format is None or isinstance(expert_format, (str, pk.RowFormat))
            else list(expert_format)
        )
        formats = [pk.RowFormat.parse(f) for f in given]
        if len(formats) != num_layers:
            raise ValueError(f"{len(formats)} expert formats for {num_layers} MoE layers")
        self.row_formats = formats
        # The model's format where its layers share one, else the first layer's quantized
        # one (a mixed GGUF file); float only when every layer has float rows.
        uniform = len(set(formats)) == 1
        self.row_format = formats[0] if uniform else next(f for f in formats if not f.is_float)
        # Their words, as the kernels' `fmt` spells them (None: float rows), for reports.
        self.expert_formats = [f.kernel_fmt for f in formats]
        self.expert_format = self.row_format.kernel_fmt

    # --- configuration ---------------------------------------------------------------
    def set_decode(self, decode: str) -> None:
        """'device' (the sync-free step wherever it applies) or 'host'."""
        self.decode_mode = decode_mode(decode)

    def set_prefill_split(self, split: PrefillSplit) -> None:
        """Which experts a slab-path prefill chunk computes on the CPU (one threshold per
        MoE layer); a split with CPU thresholds needs host rows of every expert."""
        if len(split.cpu_below) != len(self.layers):
            raise ValueError(
                f"prefill split has {len(split.cpu_below)} thresholds for {len(self.layers)} "
                "MoE layers"
            )
        if split.active and any(s.num_held not in (None, s.num_experts) for s in self.store.layers):
            raise ValueError(
                "a prefill split computes experts on the CPU from their host rows: every "
                "expert must be held in host memory (no pageable tier)"
            )
        self.prefill_split = split

    def set_experts_on(self, experts_on: str, inserts: Sequence[int | None]) -> None:
        """Where decode steps compute misses: 'gpu' (all copied), 'cpu' / 'hybrid' with
        `inserts[l]`, the most misses of MoE layer l copied per step (the rest computed on
        the CPU from the host rows). The next forward starts a new sequence."""
        self.set_placement(make_placement(experts_on, inserts, self.spec.top_k, len(self.layers)))

    def set_placement(self, placement: ExpertPlacement) -> None:
        """`set_experts_on` with the placement object; the next forward starts a new
        sequence."""
        if not placement.capped and self.capacity < self.spec.top_k:
            raise ValueError(
                f"experts_on={placement.name!r} needs at least top_k={self.spec.top_k} slots per "
                f"layer, not {self.capacity}: use experts_on='cpu' / 'hybrid' (or more slots)"
            )
        if self.verify is not None:
            self.verify.check(self.spec.top_k, self.capacity, placement)
        if placement.capped:
            for i, c in enumerate(self.computes):
                c.check_host_experts(self.store.host(i))
        self._forget_sequence()
        self.placement = placement

    @property
    def block_k(self) -> int | None:
        """The verify rule's set size (verify='budget'; None: no set, or no block mode)."""
        return None if self.verify is None else self.verify.block_k

    @property
    def experts_on(self) -> str:
        """The placement's name: 'gpu', 'cpu' or 'hybrid'."""
        return self.placement.name

    @property
    def inserts(self) -> list[int | None]:
        """Per MoE layer, the most misses one decode step copies (None: all)."""
        return self.placement.caps

    def hands_off_cpu_experts(self) -> bool:
        """Whether the device step computes experts_on's CPU experts in stream order (CPU
        kernels for every layer's expert kind and format), so graphs can capture it."""
        return self._device.hands_off()

    def max_inserts(self, layer: MoELayer) -> int | None:
        """The most misses of `layer` one decode step copies (None: all)."""
        return self.placement.max_inserts(layer.index)

    def configure(self, policy: Policy, residency: float | None, slots: int | None) -> None:
        """Switch policy and slots per layer (at most the store's); the next forward starts
        a new sequence. Slot contents carry over physically, never logically."""
        capacity = resolve_capacity(
            self.spec, policy, residency, slots, self.max_capacity, self.experts_on
        )
        self._forget_sequence()  # the device caches hand back what the slots hold
        self.store.synchronize()
        self.policy, self.capacity = policy, capacity
        for L in self.layers:
            L.cache = LogicalCache(capacity, self.spec.num_experts)
        self._device = DeviceDecode(self)
        self._forget_sequence()

    def set_steering(self, steering: Steering) -> None:
        """Replace the spec's steering rule (research variants: bench/variants.py)."""
        if self.verify is not None and not steering.spec_rule:
            raise ValueError("block mode steers by the spec's rule only")
        self.steering = steering

    def set_block_mode(self, rule: VerifyRule | None) -> None:
        """Block mode on (each decode forward a verify block routed by `rule`) or off."""
        if rule is not None:
            rule.check(self.spec.top_k, self.capacity, self.placement)
            if rule.reads_host_rows and self.has_pageable_rows():
                raise ValueError(
                    f"verify={rule.name!r} computes experts from the host rows in place, but "
                    "some experts stay in the checkpoint file (host_memory): use verify="
                    "'budget', or a budget that holds every expert"
                )
            if not self.steering.spec_rule:
                raise ValueError("block mode steers by the spec's rule only")
            if self.spec.expert_bias:
                raise ValueError("block mode does not support experts with biases (gpt-oss)")
            if self.spec.scoring == "sparsemixer":
                raise ValueError("block mode does not support PhiMoE's sparsemixer router")
            if self.policy.mask != "logical":
                raise ValueError(f"block mode needs a logical-cache policy, not {self.policy.name}")
        self.verify = rule

    def has_pageable_rows(self) -> bool:
        """Whether some experts are not held in host memory (pageable rows)."""
        return not all(s.num_held in (None, s.num_experts) for s in self.store.layers)

    # --- statistics and traces -------------------------------------------------------
    @property
    def stats(self) -> Stats:
        """The decode statistics, the device step's counts read in first."""
        self.drain()
        return self.acct.stats

    @property
    def recorder(self) -> TraceRecorder | None:
        return self.acct.recorder

    @recorder.setter
    def recorder(self, rec: TraceRecorder | None) -> None:
        self.acct.recorder = rec

    def new_recorder(self, policy_label: str | None = None) -> TraceRecorder:
        """Start recording decode steps; the recorder's `.trace` feeds psr.eval.latency.
        Recording decodes with the host-driven step (the same routing and counts)."""
        self.acct.recorder = TraceRecorder(
            self.num_decoder_layers,
            [L.decoder_index for L in self.layers],
            self.spec.top_k,
            self.expert_bytes,
            policy_label or self.policy.describe(),
            self.bytes_ratio,
        )
        return self.acct.recorder

    def drain(self) -> None:
        """Read the device step's counts into the stats (one device read)."""
        if self._device.live:
            self._device.drain()

    def pull_caches(self) -> None:
        """Bring the current sequence's caches back to the host structures (each layer's
        `cache` and `slots`) and the store's slot bookkeeping, if the device step holds
        them (a device read; the next decode step hands them over again)."""
        self._device.pull()

    def reset_stats(self) -> None:
        self.drain()
        self.acct.stats.reset()

    def end_call(self, check: bool = True) -> None:
        """A public call (generate, decode_logits) ends: the device's counts are read, the
        decode wall time completed (CUDA: one device sync), and router inputs that were not
        finite raise the error a per-layer check would have raised."""
        if self._call_t0 is not None:
            if self.store.backend == "cuda":
                # The device step's forwards return before the GPU finishes them (a graph
                # replay in microseconds): their time is the wall clock from the first one's
                # start to the device's end, not the final wait alone (which counted a few
                # ms for a whole generate: 270k tok/s in the first GPU run's experts_on).
                torch.cuda.synchronize(self.store.device)
                self.acct.stats.totals["decode_s"] += time.perf_counter() - self._call_t0
            self._call_t0 = None
        self.drain()
        if check:
            self._device.check()
        else:
            self._device.bad_layers.clear()

    # --- sequence and forward boundaries ---------------------------------------------
    def _forget_sequence(self) -> None:
        """Logical state emptied; the slot maps re-read from the store (the store is the
        truth about what each slot holds, also after a failed copy)."""
        for step in (self._device, self._host):
            step.reset()
        for L in self.layers:
            L.cache.reset()
            L.slots.reset(self.store.slot_experts(L.index)[: self.capacity])
            L.history, L.seeded, L.residual = [], False, None

    def begin_sequence(self) -> None:
        """A new sequence: caches empty until its prefill seeds them."""
        self._forget_sequence()
        self.acct.begin_sequence()

    def histories(self) -> list[list[list[int]]]:
        """Each MoE layer's prefill history so far (the routed ids of each prompt token):
        with the KV cache, all a chunk boundary's state (the caches are seeded after the
        prompt's last chunk)."""
        return [list(L.history) for L in self.layers]

    def resume_prefill(self, kv: Any, histories: Sequence[list[list[int]]]) -> None:
        """Begin a sequence (under `lock`) at a chunk boundary of its prompt: `kv` holds the
        prompt up to it and `histories` the routed ids (psr.runtime.chunked's prompt
        cache); the next forward, with `kv`, prefills the following chunk."""
        if len(histories) != len(self.layers):
            raise ValueError(f"{len(histories)} prefill histories for {len(self.layers)} layers")
        self.guard.enter(kv, self.begin_sequence, new=True)
        for L, h in zip(self.layers, histories, strict=True):
            L.history = [list(ids) for ids in h]

    @property
    def device_step(self) -> DeviceDecode:
        """The sync-free decode step (replaced when the runtime is reconfigured)."""
        return self._device

    @property
    def device_live(self) -> bool:
        """Whether the device step holds the current sequence's caches."""
        return self._device.live

    @property
    def step(self) -> Step:
        """The step the current (or last) forward took (streamed.py diverts a prefill's)."""
        return self._step

    @property
    def step_name(self) -> str:
        """The step the current (or last) forward took: "prefill", "window", "host",
        "device", ... (enter_forward picks it)."""
        return self._step.name

    @property
    def decoding(self) -> bool:
        return bool(self.layers) and all(L.seeded for L in self.layers)

    def host_step_reasons(self) -> list[tuple[bool, str]]:
        """Why decode tokens take the host-driven step whatever the placement: (applies,
        why) in the order graphs_unavailable reports them."""
        p = self.policy
        return [
            (self.decode_mode != "device", "decode='host' (graphs need the device decode step)"),
            (p.mask != "logical", f"{p.name} reads copy timing (host-driven step)"),
            (not self.steering.spec_rule, "a steering variant beyond the spec (host-driven step)"),
            (self.acct.recorder is not None, "a trace is being recorded (host-driven step)"),
        ]

    def _choose_step(self) -> Step:
        """The step this forward takes (module docstring): the first row that applies."""
        if self._scoring is not None:
            return ScoringWindow(self, self._scoring)
        if not self.decoding:
            return PrefillStep(self)
        host = (
            self.verify is not None
            or any(bad for bad, _ in self.host_step_reasons())
            or not self.placement.runs_on_device_step(self._device)
        )
        if host:
            self._device.pull()
            return self._host if self.verify is None else VerifyBlock(self)
        if not self._device.live:
            self._device.begin()
        return self._device

    @contextmanager
    def batch_forward(self, step: Step) -> Iterator[None]:
        """The forwards inside run `step` (a batch decoder's, runtime/batch.py: sequences,
        caches and counts of its own). Under `lock`; the current solo sequence, if any,
        ends (its device caches handed back: the batch moves slots)."""
        with self.lock:
            self._device.pull()
            self.guard.end()
            self._batch = step
            try:
                yield
            finally:
                self._batch = None

    def enter_forward(self, kv: Any, new: bool | None = None) -> str:
        """Before a model forward (under `lock`), with its KV cache: begins a sequence or
        checks that this forward continues the current one (guard.py; `new` says which
        when the caller knows), then picks the step. Returns its name."""
        if self._batch is not None:
            self._step = self._batch
            return self._step.name
        self.guard.enter(kv, self.begin_sequence, new)
        self._step = self._choose_step()
        if self._step is self._device:
            # Counted here, outside the forward: a compiled decode step has no host state.
            self.acct.stats.count_token()
            self._device.snapshot()  # its per-token record, read with the counts
            if self._call_t0 is None:
                self._call_t0 = time.perf_counter()
        return self._step.name

    def exit_forward(self, output: Any, seconds: float, tokens: int) -> None:
        """After a model forward of `seconds` over `tokens` tokens."""
        if self._step is self._batch:
            return  # the batch decoder counts its own
        self.guard.exit(output)
        if self._step.name in ("prefill", "window"):
            self.count_prefill(tokens)
        elif self._step is self._device and self.store.backend == "cuda":
            # Asynchronous: the wall time is taken per call (end_call), not per forward.
            pass
        else:
            if self.store.backend == "cuda":  # the host path's per-token time is the GPU's
                torch.cuda.synchronize(self.store.device)
            elif self._step is self._device:
                self._device.token_time(seconds)
            self.end_step(seconds)

    def end_step(self, seconds: float) -> None:
        """After a decode forward of `seconds`: closes the token's record."""
        self.acct.end_step(seconds)

    def count_prefill(self, tokens: int) -> None:
        """A prefill forward of `tokens` (a scored window's prefill is its prompt)."""
        sc = self._scoring
        self.acct.stats.totals["prefill_tokens"] += tokens if sc is None else sc.prompt_len

    def capture_residual(self, L: MoELayer, h: torch.Tensor) -> None:
        """Input of the layer's post-attention norm: the state entering its MoE block."""
        if h.dim() == 3 and h.shape[0] != 1 and self._batch is None:
            raise ValueError(
                f"psr decodes one sequence at a time (batch 1); got batch {h.shape[0]}"
            )
        L.residual = h.reshape(-1, h.shape[-1])

    # --- the hooks: what the router and experts modules call ---------------------------
    def route(self, L: MoELayer, x: torch.Tensor) -> Routed:
        """The router's forward: (logits, top-k weights, top-k ids), as the model's router."""
        return self._step.route(L, x)

    def experts(
        self, L: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' forward: sum of routed experts' outputs, read from slab slots."""
        return self._step.experts(L, x, ids, weights)

    # --- teacher-forced scoring: a whole window in one forward ---------------------------
    def begin_scoring(self, prompt_len: int, length: int, block: int = 1) -> None:
        """The next forward scores `length` tokens: the first `prompt_len` as prefill, each
        later one as a decode step, or (`block` > 1, block mode) each run of `block`
        tokens as one verify block. Refused for timing-dependent masks."""
        if block > 1 and self.verify is None:
            raise ValueError("scoring in blocks needs block mode (set_block_mode)")
        if self.policy.mask != "logical":
            raise ValueError(
                f"teacher-forced scoring needs a logical-cache policy; {self.policy.name} "
                "reads copy timing (decode token by token instead)"
            )
        if not 1 <= prompt_len <= length:
            raise ValueError(f"prompt_len must be in [1, {length}], got {prompt_len}")
        rec = self.acct.recorder
        self._scoring = Scoring(
            prompt_len,
            length,
            first_record=len(self.acct.stats.per_token),
            first_trace=-1 if rec is None else len(rec.trace.tokens),
            block=block,
        )

    def end_scoring(self) -> None:
        """After the scoring forward: the sequence cannot be continued."""
        self._scoring = None
        self.guard.end()
        if self.acct.token is not None:
            self.acct.close_token()


def _moe_layers(
    spec: MoESpec, layers: Sequence[Wiring], store: ExpertStore, capacity: int
) -> list[MoELayer]:
    """Each MoE layer's router, logical cache and slot map, the slots as the store holds
    them."""
    out = [
        MoELayer(
            w.decoder_index,
            i,
            w.router,
            w.gate_weight,
            w.correction_bias,
            weight_of(w.norm),
            norm_eps(w.norm),
            LogicalCache(capacity, spec.num_experts),
            SlotMap([]),
            gate_bias=w.gate_bias,
            expert_bias=w.expert_bias,
        )
        for i, w in enumerate(layers)
    ]
    for L in out:
        L.slots.reset(store.slot_experts(L.index)[:capacity])
    return out
