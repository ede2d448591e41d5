"""The streamed layer-major prefill (issue 36 goal 3): every chunk of a prompt through a MoE
layer before any goes on, so a layer's used experts cross the link once per prompt.

Chunk-major prefill (chunked.py, one forward per chunk) copies each layer's used set again
for every chunk; at 512-token chunks a chunk already uses (nearly) every expert, so a long
prompt moves its chunk count times the bytes the copy bound moves. Here the prompt's
chunks run as one forward each, as before, but layer by layer: each chunk's forward runs on
its own thread and only one runs at a time, handing on at each MoE layer's experts, in the
order (layer, chunk). The last chunk to reach a layer computes it for every chunk
(`streamed_layer`): one streamed plan (stream_plan.plan_stream: each used expert copied
once, double-buffered, then later MoE layers' first experts, where the prompt is long
enough to use every expert, prefetched into their slots: stream_plan.prefetch_targets),
each expert computed from its slot over every chunk's tokens that chose it, the CPU
split's experts (per chunk, as the per-chunk path picks them) on the CPU worker beside.

Nothing computed changes. Each chunk's attention sees the same cache prefix (per layer the
chunks append in order), each expert runs over the same tokens, and each chunk's
contributions are summed in the order its per-chunk plan reads them, then its CPU part:
logits, KV and routed ids bit-identical to chunk-major prefill, whatever the copies'
timing; the caches are seeded from the routed ids alone. Layers the prefill reads from host
rows (the CPU backend) run their per-chunk code, chunk by chunk.

Its price: every chunk's hidden state held at once, and each layer's expert outputs
([T k, H]) held until summed. Not with a prompt cache (its boundaries' KV snapshots are
chunk-major) or CUDA graphs' static cache: those stay chunk-major.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from psr.runtime.chunked import boundaries
from psr.runtime.layer import MoELayer
from psr.runtime.prefill import (
    Inputs,
    PrefillStep,
    cpu_part,
    reads_host,
    row_ffn,
    run_beside,
    seeded,
)
from psr.runtime.stream_plan import (
    PREFETCH_TOKENS,
    LayerSchedule,
    plan_stream,
    prefetch_plan,
    prefetch_targets,
    schedule,
)


class Aborted(Exception):
    """Another chunk's forward raised: this one stops (the first error is re-raised)."""


class Baton:
    """One of n threads runs at a time, in turn 0, 1, .., n-1, 0, ..."""

    def __init__(self, n: int) -> None:
        self.n, self.turn = n, 0
        self.error: BaseException | None = None
        self.cv = threading.Condition()

    def wait(self, c: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == c or self.error is not None)
            if self.error is not None:
                raise Aborted

    def give(self, c: int) -> None:
        with self.cv:
            self.turn = (c + 1) % self.n
            self.cv.notify_all()

    def fail(self, e: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = e
            self.cv.notify_all()


def streamed_layer(
    rt: Any, step: PrefillStep, layer: MoELayer, chunks: Inputs
) -> tuple[list[torch.Tensor], LayerSchedule | None]:
    """`layer`'s experts for every chunk of the prompt (module docstring); the layer's
    cache seeded. Returns each chunk's output and the schedule issued (None: host reads)."""
    if reads_host(rt, layer):
        last = len(chunks) - 1
        outs = [step.chunk_experts(layer, *ch, final=c == last) for c, ch in enumerate(chunks)]
        return outs, None
    split = rt.prefill_split
    routed = [ids.tolist() for _, ids, _ in chunks]
    sp = plan_stream(layer.slots, layer.history, routed, lambda n: split.on_cpu(layer.index, n))
    tokens = sum(s.tokens for s in sp.chunks)
    ahead: list[tuple[int, int, int]] = []
    if tokens >= PREFETCH_TOKENS:  # every expert likely used: the later layers' first ones
        for p in prefetch_targets(layer.index, len(rt.layers)):
            later = rt.layers[p]
            if not reads_host(rt, later):
                experts = range(rt.spec.num_experts)
                ahead += [(p - layer.index, s, e) for s, e in prefetch_plan(later.slots, experts)]
    sched = schedule(layer.index, sp.plan, sp.chunks, ahead)
    ys: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in chunks]

    def keep(c: int, e: int, tok: torch.Tensor, y: torch.Tensor) -> None:
        ys[c][e] = (tok, y)

    parts = [
        cpu_part(rt, layer, x, ids, w, s.cpu) if s.cpu else None
        for (x, ids, w), s in zip(chunks, sp.chunks, strict=True)
    ]
    side = None
    if any(p is not None for p in parts):  # every chunk's CPU part, one after the other
        side = lambda: torch.cat([p() for p in parts if p is not None])  # noqa: E731
    cpu = run_beside(rt.store, sched, chunks, row_ffn(rt, layer), keep, side)
    outs, at = [], 0
    for c, (x, _, _) in enumerate(chunks):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in sp.orders[c]:
            tok, y = ys[c].pop(e)
            out.index_add_(0, tok, y.float())
        if parts[c] is not None:  # added last, as the per-chunk path does
            assert cpu is not None
            out += cpu[at : at + x.shape[0]].to(out.device)
            at += x.shape[0]
        outs.append(out.to(x.dtype))
    seeded(rt, layer, sp.plan)
    return outs, sched


# One chunk's model forward: (its ids [1, n], the shared KV cache) -> its logits [1, n, V].
ChunkForward = Callable[[torch.Tensor, Any], torch.Tensor]


class LayerMajor:
    """One prompt's layer-major prefill (module docstring): `run` drives it; `experts` is
    the prefill step's divert, called on each chunk's thread."""

    def __init__(self, rt: Any, step: PrefillStep, n_chunks: int) -> None:
        self.rt, self.step = rt, step
        self.baton = Baton(n_chunks)
        self.me = threading.local()
        self.inputs: list[Any] = [None] * n_chunks
        self.outs: list[torch.Tensor | None] = [None] * n_chunks
        self.schedules: list[LayerSchedule] = []  # what each layer issued, in order

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        c = self.me.chunk
        self.inputs[c] = (x, ids, weights)
        if c == self.baton.n - 1:  # the last chunk reached the layer: compute it for all
            chunks, self.inputs = self.inputs, [None] * self.baton.n
            outs, sched = streamed_layer(self.rt, self.step, layer, chunks)
            self.outs = list(outs)
            if sched is not None:
                self.schedules.append(sched)
        self.baton.give(c)
        self.baton.wait(c)
        out: torch.Tensor | None = self.outs[c]
        self.outs[c] = None
        assert out is not None
        return out

    def _chunk(self, c: int, part: torch.Tensor, kv: Any, forward: ChunkForward,
               logits: list[Any], modes: tuple[bool, bool], stream: Any) -> None:  # fmt: skip
        self.me.chunk = c
        grad, inference = modes  # the caller's autograd modes (per thread in torch)
        try:
            self.baton.wait(c)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), _stream(stream):
                logits[c] = forward(part, kv)
            self.baton.give(c)
        except Aborted:
            pass
        except BaseException as e:
            self.baton.fail(e)

    def run(self, ids: torch.Tensor, chunk: int, kv: Any, forward: ChunkForward) -> list[Any]:
        """Each chunk of `ids [1, T]` (at `chunk`'s boundaries) through `forward` on its own
        thread, layer by layer; their logits in order (the first error re-raised)."""
        ends = boundaries(0, ids.shape[1], chunk)
        starts = [0, *ends[:-1]]
        logits: list[Any] = [None] * len(ends)
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        stream = torch.cuda.current_stream() if ids.device.type == "cuda" else None
        threads = [
            threading.Thread(
                target=self._chunk,
                args=(c, ids[:, s:e], kv, forward, logits, modes, stream),
                name=f"psr-prefill-chunk{c}",
            )
            for c, (s, e) in enumerate(zip(starts, ends, strict=True))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.baton.error is not None:
            raise self.baton.error
        return logits


def _stream(stream: Any) -> Any:
    """The caller's CUDA stream on a chunk's thread (streams are per thread)."""
    import contextlib

    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def prefill_layer_major(
    rt: Any, ids: torch.Tensor, chunk: int, kv: Any, forward: ChunkForward
) -> tuple[list[Any], list[LayerSchedule]]:
    """Prefill prompt `ids [1, T]` from an empty KV cache `kv` layer-major, under the
    runtime's lock as one forward of T tokens (`forward`: the model's own forward, not its
    locked wrapper). Returns each chunk's logits and the schedules the layers issued."""
    with rt.lock:
        rt.prefill_more = False  # every layer sees the whole prompt: seeded after it
        rt.enter_forward(kv)
        step = rt.step
        if not isinstance(step, PrefillStep):
            raise RuntimeError(f"layer-major prefill: the runtime picked a {step.name} step")
        lm = LayerMajor(rt, step, len(boundaries(0, ids.shape[1], chunk)))
        step.divert = lm.experts
        t0 = time.perf_counter()
        try:
            logits = lm.run(ids, chunk, kv, forward)
        finally:
            step.divert = None
        rt.exit_forward(None, time.perf_counter() - t0, ids.shape[1])
    return logits, lm.schedules


def layer_major_prefill(model: Any, chunk: int) -> Callable[[torch.Tensor, bool], Any]:
    """OffloadedModel's prefill callable (`gen.generate`'s `prefill=`), layer-major: a
    fresh KV cache as the model's forward would make it, the schedules kept on the model
    (`prefill_schedules`). Returns the last position's logits (`keep_all`: every one)."""
    from transformers import DynamicCache

    from psr.runtime.kv import cache_kwarg

    hf, name = model.hf, cache_kwarg(model.hf)
    forward = type(hf).forward  # the model's own: the runtime's locked wrapper is entered once

    def run(ids: torch.Tensor, keep_all: bool) -> tuple[torch.Tensor, Any]:
        # The LM head over the last row only unless keep_all, as the chunk-major prefill
        # (model.py) computes it: the same row of the same matmul shape, the same bits.
        keep = {} if keep_all else {"logits_to_keep": 1}

        def one(part: torch.Tensor, kv: Any) -> torch.Tensor:
            out = forward(hf, input_ids=part, use_cache=True, **{name: kv}, **keep)
            logits: torch.Tensor = out.logits
            return logits

        packed = getattr(hf, "psr_kv_cache", None)  # a kv_format's (runtime/kv_quant.py)
        kv = packed(None) if packed is not None else DynamicCache(config=hf.config)
        logits, model.prefill_schedules = prefill_layer_major(model.runtime, ids, chunk, kv, one)
        return (torch.cat(logits, dim=1) if keep_all else logits[-1][:, -1:]), kv

    return run
