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
from dataclasses import dataclass

import torch

from psr.cache import prefill_state
from psr.machine import PrefillSplit
from psr.runtime.context import StepContext
from psr.runtime.layer import MoELayer
from psr.runtime.slots import SlotMap
from psr.runtime.step import Routed, Step, non_finite
from psr.store import CopyReason, ExpertStore
from psr_kernels import NonFiniteError

# One expert's weighted FFN over some tokens: (its row, the tokens' x, its expert id, their
# gate weights) -> its contribution to y.
RowFFN = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]

# Slab path: experts whose copies are in flight ahead of the one computing (2: double
# buffering; a copy is issued only into a slot no pending read still needs).
LOOKAHEAD = 2


@dataclass
class PrefillPlan:
    reads: list[tuple[int, int, bool]]  # (expert, slot, copy it first?) in compute order
    seed: list[tuple[int, int]]  # (slot, expert): cache members prefill did not compute with
    init: list[int]  # the layer's initial logical cache, least recent first


def _stage_slot(slots: SlotMap, keep: set[int], here: dict[int, int]) -> int:
    """A slot to load a prefill expert into: empty, else not holding a `keep` expert
    (a duplicate copy of one counts as free), else any."""
    preds: tuple[Callable[[int, int], bool], ...] = (
        lambda s, e: e < 0,
        lambda s, e: e not in keep or here.get(e) != s,
        lambda s, e: True,
    )
    for pred in preds:
        for s in range(slots.capacity):
            if pred(s, slots.slot_expert[s]):
                return s
    raise AssertionError("unreachable")


def _put(slots: SlotMap, keep: set[int], here: dict[int, int], e: int) -> int:
    s = _stage_slot(slots, keep, here)
    if here.get(slots.slot_expert[s]) == s:
        del here[slots.slot_expert[s]]
    slots.slot_expert[s] = e
    here[e] = s
    return s


def plan_prefill(
    slots: SlotMap, history: Sequence[Sequence[int]], used: Sequence[int], final: bool = True
) -> PrefillPlan:
    """Stage the prefill's `used` experts and (`final`: the prompt's last chunk) seed the
    cache from `history` (the routed ids of each prompt token so far); `slots` then ends
    mapping exactly the seeded experts. A chunk before the last stages only (`seed` and
    `init` empty; the experts likely kept are still staged last)."""
    state = prefill_state(history, slots.capacity)
    keep = set(state)
    used = sorted(set(used))
    order = [e for e in used if e not in keep] + [e for e in used if e in keep]
    here = {e: s for s, e in enumerate(slots.slot_expert) if e >= 0}
    reads = []
    for e in order:
        fresh = e not in here
        if fresh:
            _put(slots, keep, here, e)
        reads.append((e, here[e], fresh))
    if not final:
        return PrefillPlan(reads, [], [])
    seed = [(_put(slots, keep, here, e), e) for e in state if e not in here]
    slots.slot_of = {e: here[e] for e in state}
    return PrefillPlan(reads, seed, state)


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


def _issue(
    store: ExpertStore, layer: int, reads: Sequence[tuple[int, int, bool]], at: int, issued: int
) -> int:
    """Issue the copies of reads `issued ..` while they are at most LOOKAHEAD ahead of read
    `at` and their slot is not one a read not yet computed (`at ..`) still needs. Returns
    the new `issued` (always > `at`)."""
    while issued < len(reads) and issued < at + LOOKAHEAD:
        e, slot, fresh = reads[issued]
        if any(reads[j][1] == slot for j in range(at, issued)):
            break  # written after read `at` releases it: issued on a later turn
        if fresh:
            store.enqueue_copies(layer, [slot], [e], reason=CopyReason.PREFILL)
        issued += 1
    return issued


def run_prefill(
    store: ExpertStore,
    layer: int,
    plan: PrefillPlan,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ffn: RowFFN,
    side: SidePart | None = None,
) -> torch.Tensor:
    """Exact experts of `x [T, H]` routed to `ids [T, k]` with `weights [T, k]`, by the
    plan: copies into the slab (the next ones in flight while one computes), each expert
    read from its slot; `side` (the CPU part of a split layer: its experts are not in the
    plan) beside them on a worker thread. Sums in fp32; returns x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    # The CPU part on a worker thread (the CPU kernels release the GIL) while this one
    # issues the copies and the device's experts; added last, so the sum's order is fixed.
    cpu = None if side is None else _side_worker().submit(side)
    issued = 0
    try:
        for i, (e, slot, _fresh) in enumerate(plan.reads):
            tok, pos = torch.where(ids == e)
            issued = _issue(store, layer, plan.reads, i, issued)
            with store.reading(layer, [slot], [e]) as slab:
                y = ffn(slab[slot], x[tok], e, weights[tok, pos])
            out.index_add_(0, tok, y.float())
    except BaseException:
        if cpu is not None:
            wait([cpu])  # never left running past the layer; the loop's error is raised
        raise
    if cpu is not None:
        out += cpu.result().to(out.device)
    seed_copies(store, layer, plan)
    return out.to(x.dtype)


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

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        rt = self.rt
        final = not rt.prefill_more
        if reads_host(rt, layer):
            compute, host = rt.computes[layer.index], rt.store.host(layer.index)
            out = compute.grouped_host(x, ids, weights, host, layer.expert_bias)
            plan = plan_prefill(layer.slots, layer.history, [], final) if final else None
            if plan is not None:
                seed_copies(rt.store, layer.index, plan)
        else:
            on_cpu, copied = split_experts(rt.prefill_split, layer.index, ids, rt.spec.num_experts)
            side = cpu_part(rt, layer, x, ids, weights, on_cpu) if on_cpu else None
            plan = plan_prefill(layer.slots, layer.history, copied, final)
            ffn = row_ffn(rt, layer)
            out = run_prefill(rt.store, layer.index, plan, x, ids, weights, ffn, side)
        if plan is not None and final:
            layer.cache.reset(plan.init)
            layer.seeded = True
            if rt.decoding:
                rt.acct.end_prefill()
        return out
