"""Prefill: exact experts for every prompt token, chunk by chunk, then the cache seed.

A prompt is prefilled in chunks at fixed absolute boundaries (`prefill_chunk` tokens,
psr.runtime.chunked drives them): each chunk is one forward. Prefill routes exactly; each
MoE layer appends the chunk's routed ids to its history, and after the prompt's last
chunk seeds its logical cache by the spec's rule (`prefill_state` over the whole history:
a function of the routed ids alone, whatever the chunking).

Per layer and chunk the experts run grouped: each expert once over the chunk's tokens
that chose it. Where they are read from:
  host  (the CPU backend) straight from the store's host rows, no copies: one call of the
        CPU expert kernels for the experts with few tokens, one dequantization and matmul
        for each expert with many (ExpertCompute.grouped_host); after the last chunk the
        seeded experts are copied into slots, so decode starts with them resident;
  slab  (CUDA) each expert staged through a slot, the experts the cache will not keep
        first (so the kept ones end resident), the next expert's copy issued before the
        current one computes (double-buffered slots; `run_prefill`); except the experts
        the runtime's `PrefillSplit` (psr.machine: per layer, from the machine profile's
        copy and CPU costs) puts on the CPU, those with fewer tokens in the chunk than the
        layer's threshold: computed from their host rows by the CPU kernels on a worker
        thread while this one issues the copies and the device's work (`split_experts`).
        Where an expert is computed never changes the routing or the seed: the plan
        seeds from the routed ids alone, and a seeded expert computed on the CPU is
        copied into its slot like any other seed.
The two round differently (the kernels' sums against one matmul per expert), each
deterministic; the tests force the slab path on the CPU under copy delays.
`plan_prefill` decides the slots (updating the slot map). Teacher-forced scoring plans the
same way (the slot map evolves as in decoding), issues no copies, and computes the prompt
as the host path does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from psr.machine import PrefillSplit
from psr.runtime.context import StepContext
from psr.runtime.layer import MoELayer
from psr.runtime.step import Routed, Step, non_finite
from psr.runtime.stream_plan import ChunkSplit, Event, LayerSchedule, PrefillPlan, schedule
from psr.runtime.stream_plan import plan_prefill as plan_prefill
from psr.store import CopyReason, ExpertStore
from psr_kernels import NonFiniteError

# One expert's weighted FFN over some tokens: (its row, the tokens' x, its expert id, their
# gate weights) -> its contribution to y.
RowFFN = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
# A chunk's experts diverted elsewhere (the streamed layer-major prefill, streamed.py):
# (layer, x, ids, weights) -> the layer's output for this chunk.
ExpertsFn = Callable[[MoELayer, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reads_host(rt: StepContext, layer: MoELayer) -> bool:
    """Whether prefill reads `layer`'s experts from the host rows: the CPU backend's, and any
    layer without slots to stage through (experts_on cpu with no slab: on CUDA each expert's
    row then goes to the device once per chunk, outside the store's copy counts)."""
    return rt.prefill_reads == "host" or layer.slots.capacity == 0


def row_ffn(rt: StepContext, layer: MoELayer) -> RowFFN:
    """`layer`'s experts one at a time from their rows, with their biases where they have
    them (prefill and scored windows)."""
    table, compute = layer.expert_bias, rt.computes[layer.index]
    return lambda row, x, e, w: compute.weighted_row(row, x, w, None if table is None else table[e])


def split_experts(
    split: PrefillSplit, layer: int, ids: torch.Tensor, num_experts: int
) -> tuple[list[int], list[int]]:
    """A chunk's used experts of MoE layer `layer` (`ids [T, k]` routed), split into
    (computed on the CPU, copied) by `split`: each ascending."""
    counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=num_experts).tolist()
    cpu = [e for e, n in enumerate(counts) if split.on_cpu(layer, n)]
    copied = [e for e, n in enumerate(counts) if n > 0 and not split.on_cpu(layer, n)]
    return cpu, copied


# The CPU part of a split layer: () -> its fp32 contribution [T, H] on the CPU.
SidePart = Callable[[], torch.Tensor]


def cpu_part(
    rt: StepContext,
    layer: MoELayer,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: list[int],
) -> SidePart:
    """The CPU experts `experts` of a split prefill layer over the chunk, from the host
    rows; its inputs are brought to the host now (the layer has routed: no stall), its
    compute runs when called (on run_prefill's worker thread)."""
    compute, host = rt.computes[layer.index], rt.store.host(layer.index)
    only = torch.zeros(rt.spec.num_experts, dtype=torch.bool)
    only[experts] = True
    xc, ic, wc = x.to("cpu"), ids.to("cpu"), weights.to("cpu")
    bias = layer.expert_bias
    bias = None if bias is None else bias.to("cpu")
    return lambda: compute.grouped_host(xc, ic, wc, host, bias, only=only, out_dtype=torch.float32)


# Where a read's contribution goes: (chunk, expert, its tokens, their y).
OnRead = Callable[[int, int, torch.Tensor, torch.Tensor], None]
Inputs = Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per chunk (x, ids, w)


def run_events(
    store: ExpertStore,
    sched: LayerSchedule,
    chunks: Inputs,
    ffn: RowFFN,
    on_read: OnRead,
) -> None:
    """Issue a layer's schedule (stream_plan.schedule) in order: its copies, its reads (each
    expert computed from its slot over every chunk's tokens that chose it, handed to
    `on_read`), the later layers' prefetch, the seed copies. The slots waited for are
    counted into `sched.waits`."""
    layer = sched.layer
    waits = store.counters().get("waits", 0)
    for ev in sched.events:
        if ev.kind == "read":
            _read(store, layer, ev, chunks, ffn, on_read)
        else:
            into = layer + ev.ahead  # MoE layers are the store's layers, in order
            store.enqueue_copies(into, [ev.slot], [ev.expert], reason=CopyReason.PREFILL)
    sched.waits = int(store.counters().get("waits", 0) - waits)


def _read(
    store: ExpertStore, layer: int, ev: Event, chunks: Inputs, ffn: RowFFN, on_read: OnRead
) -> None:
    """One read event: expert `ev.expert` from its slot over each chunk's tokens."""
    e, slot = ev.expert, ev.slot
    with store.reading(layer, [slot], [e]) as slab:
        for c, n in enumerate(ev.tokens):
            if n:
                x, ids, weights = chunks[c]
                tok, pos = torch.where(ids == e)
                on_read(c, e, tok, ffn(slab[slot], x[tok], e, weights[tok, pos]))


def run_prefill(
    store: ExpertStore,
    layer: int,
    plan: PrefillPlan,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ffn: RowFFN,
    split: ChunkSplit,
    side: SidePart | None = None,
) -> torch.Tensor:
    """Exact experts of `x [T, H]` routed to `ids [T, k]` with `weights [T, k]`, by the
    plan's schedule: copies into the slab (the next ones in flight while one computes),
    each expert read from its slot and summed as it is read; `side` (the CPU part of a
    split layer: its experts are not in the plan) beside them on a worker thread, added
    last. Sums in fp32; returns x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

    def add(_c: int, _e: int, tok: torch.Tensor, y: torch.Tensor) -> None:
        out.index_add_(0, tok, y.float())

    cpu = run_beside(store, schedule(layer, plan, [split]), [(x, ids, weights)], ffn, add, side)
    if cpu is not None:
        out += cpu.to(out.device)
    return out.to(x.dtype)


def run_beside(
    store: ExpertStore,
    sched: LayerSchedule,
    chunks: Inputs,
    ffn: RowFFN,
    on_read: OnRead,
    side: SidePart | None,
) -> torch.Tensor | None:
    """`run_events` with `side` (the CPU part of a split layer) on the worker thread beside
    it (the CPU kernels release the GIL); its result is returned, never left running past
    the layer."""
    cpu = None if side is None else _side_worker().submit(side)
    try:
        run_events(store, sched, chunks, ffn, on_read)
    except BaseException:
        if cpu is not None:
            wait([cpu])  # never left running past the layer; the loop's error is raised
        raise
    return None if cpu is None else cpu.result()


_SIDE: list[ThreadPoolExecutor] = []


def _side_worker() -> ThreadPoolExecutor:
    """The one thread split prefill layers compute their CPU part on (created once)."""
    if not _SIDE:
        _SIDE.append(ThreadPoolExecutor(1, thread_name_prefix="psr-prefill-cpu"))
    return _SIDE[0]


def seed_copies(store: ExpertStore, layer: int, plan: PrefillPlan) -> None:
    """Copy the seeded experts prefill did not stage into their slots."""
    if plan.seed:
        seeds = plan.seed
        store.enqueue_copies(
            layer, [s for s, _ in seeds], [e for _, e in seeds], reason=CopyReason.PREFILL
        )


class PrefillStep(Step):
    """A prefill chunk's forward: exact routing, the experts grouped (module docstring),
    and after the prompt's last chunk each layer's logical cache seeded (spec: the
    experts prefill used most recently)."""

    name = "prefill"

    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        rt = self.rt
        logits = self.logits(layer, x)
        try:
            w, ids = rt.ops.route(logits, rt.spec.route_spec(), bias=layer.bias)
        except NonFiniteError as e:
            raise non_finite([layer.index], "found in prefill") from e
        layer.history.extend(ids.tolist())
        return self.out(logits, w, ids)

    # The streamed layer-major prefill (streamed.py) diverts each chunk's experts to it.
    divert: ExpertsFn | None = None

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.divert is not None:
            return self.divert(layer, x, ids, weights)
        return self.chunk_experts(layer, x, ids, weights, final=not self.rt.prefill_more)

    def chunk_experts(
        self,
        layer: MoELayer,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        final: bool,
    ) -> torch.Tensor:
        """One chunk's experts of `layer` (`final`: the prompt's last chunk: then the
        layer's cache is seeded)."""
        rt = self.rt
        if reads_host(rt, layer):
            compute, host = rt.computes[layer.index], rt.store.host(layer.index)
            out = compute.grouped_host(x, ids, weights, host, layer.expert_bias)
            plan = plan_prefill(layer.slots, layer.history, [], final) if final else None
            if plan is not None:
                seed_copies(rt.store, layer.index, plan)
        else:
            split = rt.prefill_split
            chunk = ChunkSplit.of(ids.tolist(), lambda n: split.on_cpu(layer.index, n))
            side = cpu_part(rt, layer, x, ids, weights, chunk.cpu) if chunk.cpu else None
            plan = plan_prefill(layer.slots, layer.history, chunk.copied, final)
            ffn = row_ffn(rt, layer)
            out = run_prefill(rt.store, layer.index, plan, x, ids, weights, ffn, chunk, side)
        if plan is not None and final:
            seeded(rt, layer, plan)
        return out


def seeded(rt: StepContext, layer: MoELayer, plan: PrefillPlan) -> None:
    """After the prompt's last chunk: `layer`'s logical cache seeded by the plan."""
    layer.cache.reset(plan.init)
    layer.seeded = True
    if rt.decoding:
        rt.acct.end_prefill()
