"""Prefill's staging plans and the schedules they issue, torch-free (issue 36 goal 3).

Two plans stage a MoE layer's used experts through its slab slots:
  per chunk   (`plan_prefill`, psr.runtime.prefill): one chunk's used experts, each read
              once for that chunk; a prompt of n chunks copies a layer's used set n times;
  streamed    (`plan_stream`, psr.runtime.streamed, layer-major): every chunk of the prompt
              has reached the layer, so each used expert is copied once and read once for
              all the chunks that use it.
Either plan reads the experts the cache will not keep first (so the kept ones end resident)
and ends with the layer's slots mapping exactly the seeded experts. `schedule` turns a
plan's reads into the events the runtime issues, in issue order: up to LOOKAHEAD copies
in flight ahead of the compute (double-buffered slots), a copy never overwrites a slot a read
not yet done still needs; then the later layers' prefetch (streamed) and the seed copies.
The runtime executes exactly these events (and records them), and psr.eval.ttft prices
them on the GPU profiles, so a modeled TTFT comes from the schedule psr issues.

Where a chunk's expert is computed (`ChunkSplit`: the CPU below the layer's token
threshold, else copied) and in which order each chunk's contributions are summed
(`chunk_order`: its per-chunk plan's read order) are functions of the routed ids alone:
the streamed plan sums each chunk exactly as the per-chunk plan does, so its outputs are
bit-identical whatever the copies' timing or the staging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from psr.cache import prefill_state
from psr.runtime.slots import SlotMap

# Copies in flight ahead of the read computing (2: double buffering; a copy is issued
# only into a slot no pending read still needs; reads of resident experts between them
# do not count).
LOOKAHEAD = 2
# Above this many prompt tokens a streamed layer prefetches the next MoE layer's experts
# during its own (uniform top-8 routing over 64-128 experts uses every one by ~100 tokens).
PREFETCH_TOKENS = 256
# How many MoE layers ahead a streamed layer's prefetch reaches: the first layer fills the
# next PREFETCH_DEPTH, each later one the layer PREFETCH_DEPTH ahead, so while a layer's
# dense part runs (its routing unknown) the link copies a later layer's experts.
PREFETCH_DEPTH = 2


def prefetch_targets(position: int, layers: int) -> list[int]:
    """The MoE layers (positions) the streamed layer at `position` prefetches into."""
    ahead = range(1, PREFETCH_DEPTH + 1) if position == 0 else [PREFETCH_DEPTH]
    return [position + a for a in ahead if position + a < layers]


@dataclass
class PrefillPlan:
    reads: list[tuple[int, int, bool]]  # (expert, slot, copy it first?) in compute order
    seed: list[tuple[int, int]]  # (slot, expert): cache members prefill did not compute with
    init: list[int]  # the layer's initial logical cache, least recent first


def read_order(history: Sequence[Sequence[int]], capacity: int, used: Sequence[int]) -> list[int]:
    """The order a plan reads `used`: the experts the cache seeded from `history` would not
    keep first, then the kept ones, each ascending (a function of the routed ids alone)."""
    keep = set(prefill_state(history, capacity))
    used = sorted(set(used))
    return [e for e in used if e not in keep] + [e for e in used if e in keep]


def _stage_slot(
    slots: SlotMap, keep: set[int], here: dict[int, int], later: set[int], last: dict[int, int]
) -> int:
    """A slot to load an expert into: empty, else holding neither a `keep` expert (a
    duplicate copy of one counts as free) nor one read `later`, else not read later, else
    any; of those, the one read longest ago (`last`: slot -> its last read's position), so
    a copy goes where the compute finished first (double buffering, not one slot reused)."""
    preds: tuple[Callable[[int, int], bool], ...] = (
        lambda s, e: e < 0,
        lambda s, e: (e not in keep or here.get(e) != s) and e not in later,
        lambda s, e: e not in later,
        lambda s, e: True,
    )
    for pred in preds:
        ok = [s for s in range(slots.capacity) if pred(s, slots.slot_expert[s])]
        if ok:
            return min(ok, key=lambda s: last.get(s, -1))
    raise AssertionError("unreachable")


def _put(
    slots: SlotMap, keep: set[int], here: dict[int, int], e: int, later: set[int],
    last: dict[int, int],
) -> int:  # fmt: skip
    s = _stage_slot(slots, keep, here, later, last)
    if here.get(slots.slot_expert[s]) == s:
        del here[slots.slot_expert[s]]
    slots.slot_expert[s] = e
    here[e] = s
    return s


def plan_prefill(
    slots: SlotMap, history: Sequence[Sequence[int]], used: Sequence[int], final: bool = True
) -> PrefillPlan:
    """Stage the prefill's `used` experts, each read once, and (`final`: the prompt's last
    chunk) seed the cache from `history` (the routed ids of each prompt token so far);
    `slots` then ends mapping exactly the seeded experts. Before the last chunk it stages
    only (`seed` and `init` empty; the experts likely kept are still staged last)."""
    state = prefill_state(history, slots.capacity)
    keep = set(state)
    order = read_order(history, slots.capacity, used)
    here = {e: s for s, e in enumerate(slots.slot_expert) if e >= 0}
    reads: list[tuple[int, int, bool]] = []
    last: dict[int, int] = {}  # slot -> the position of its last read
    for i, e in enumerate(order):
        fresh = e not in here
        if fresh:
            _put(slots, keep, here, e, set(order[i + 1 :]), last)
        reads.append((e, here[e], fresh))
        last[here[e]] = i
    if not final:
        return PrefillPlan(reads, [], [])
    seed = [(_put(slots, keep, here, e, set(), last), e) for e in state if e not in here]
    slots.slot_of = {e: here[e] for e in state}
    return PrefillPlan(reads, seed, state)


def prefetch_plan(slots: SlotMap, experts: Sequence[int]) -> list[tuple[int, int]]:
    """The next layer's predicted experts staged ahead of its routing: (slot, expert) for
    those not resident, into empty slots first, at most one per slot (the slot map
    updated; the logical cache is untouched: the layer's plan re-stages by its routing)."""
    here = {e: s for s, e in enumerate(slots.slot_expert) if e >= 0}
    want = [e for e in experts if e not in here]
    free = sorted(range(slots.capacity), key=lambda s: (slots.slot_expert[s] >= 0, s))
    free = [s for s in free if slots.slot_expert[s] not in want]
    out = list(zip(free, want, strict=False))
    for s, e in out:
        slots.slot_expert[s] = e
    return out


@dataclass
class ChunkSplit:
    """One chunk of a layer: its routed ids' counts, split by the layer's threshold into
    the experts computed on the CPU and those copied (each ascending)."""

    tokens: int
    counts: dict[int, int]
    cpu: list[int]
    copied: list[int]

    @classmethod
    def of(cls, routed: Sequence[Sequence[int]], on_cpu: Callable[[int], bool]) -> ChunkSplit:
        counts: dict[int, int] = {}
        for row in routed:
            for e in row:
                counts[e] = counts.get(e, 0) + 1
        used = sorted(counts)
        cpu = [e for e in used if on_cpu(counts[e])]
        return cls(len(routed), counts, cpu, [e for e in used if not on_cpu(counts[e])])


@dataclass
class StreamPlan:
    """A layer's streamed (layer-major) plan over the chunks that reached it."""

    plan: PrefillPlan  # each copied expert read once, for every chunk that uses it
    chunks: list[ChunkSplit]
    orders: list[list[int]]  # per chunk: its copied experts in its per-chunk read order


def plan_stream(
    slots: SlotMap,
    history: Sequence[Sequence[int]],
    chunks: Sequence[Sequence[Sequence[int]]],
    on_cpu: Callable[[int], bool],
) -> StreamPlan:
    """Stage and seed a layer for the prompt's last `chunks` (routed ids per chunk; their
    tokens are the last of `history`): the union of what each chunk copies, each expert
    once; each chunk summed in its per-chunk plan's order (`read_order` of the history up
    to its end)."""
    splits = [ChunkSplit.of(c, on_cpu) for c in chunks]
    end = len(history) - sum(s.tokens for s in splits)
    orders = []
    for s in splits:
        end += s.tokens
        orders.append(read_order(history[:end], slots.capacity, s.copied))
    used = sorted({e for s in splits for e in s.copied})
    return StreamPlan(plan_prefill(slots, history, used), splits, orders)


# --- the schedule: what the runtime issues, in order ------------------------------------------
@dataclass(frozen=True)
class Event:
    """One thing a layer's prefill issues: `copy` (expert into slot, this layer),
    `read` (compute expert from slot over `tokens` per chunk), `prefetch` (a copy into
    the slot of the MoE layer `ahead` after this one), `seed` (a seeded expert's copy
    after the reads)."""

    kind: str
    expert: int
    slot: int
    tokens: tuple[int, ...] = ()
    ahead: int = 0  # prefetch: into the MoE layer this many after this one


@dataclass
class LayerSchedule:
    """A layer's issued events, and beside them its CPU part (tokens per chunk on the CPU)
    and what the store saw (slots waited for; filled by the runtime, not the planner)."""

    layer: int
    chunk_tokens: tuple[int, ...]
    events: list[Event] = field(default_factory=list)
    cpu_tokens: tuple[int, ...] = ()
    waits: int = 0

    def count(self, kind: str) -> int:
        return sum(ev.kind == kind for ev in self.events)


def schedule(
    layer: int,
    plan: PrefillPlan,
    chunks: Sequence[ChunkSplit],
    prefetch: Sequence[tuple[int, int, int]] = (),
) -> LayerSchedule:
    """The events a plan issues: up to LOOKAHEAD copies in flight ahead of the read
    computing, never into a slot a pending read still needs; `prefetch` ((layers ahead,
    slot, expert), prefetch_plan's) once this layer's copies are all issued; the seed
    copies last."""
    reads = plan.reads
    out = LayerSchedule(layer, tuple(c.tokens for c in chunks))
    out.cpu_tokens = tuple(sum(c.counts[e] for e in c.cpu) for c in chunks)
    issued = 0
    for at, (e, slot, _fresh) in enumerate(reads):
        while issued < len(reads):
            ei, si, fresh = reads[issued]
            if fresh and sum(r[2] for r in reads[at:issued]) >= LOOKAHEAD:
                break  # LOOKAHEAD copies already in flight ahead of read `at`
            if any(reads[j][1] == si for j in range(at, issued)):
                break  # written after read `at` releases it: issued on a later turn
            if fresh:
                out.events.append(Event("copy", ei, si))
            issued += 1
        if issued == len(reads) and prefetch and not out.count("prefetch"):
            out.events += [Event("prefetch", ex, sx, (), a) for a, sx, ex in prefetch]
        tokens = tuple(c.counts[e] if e in c.copied else 0 for c in chunks)
        out.events.append(Event("read", e, slot, tokens))
    if not reads:
        out.events += [Event("prefetch", ex, sx, (), a) for a, sx, ex in prefetch]
    out.events += [Event("seed", e, s) for s, e in plan.seed]
    return out
