"""The shared slab of a batch sized apart from each sequence's cache (issue 38): a load's
`batch_slots` gives the store more slots than the solo `slots`, a BatchDecoder's slab takes
up to b x slots of them, and each sequence's logical cache keeps the solo capacity. Its
logits stay bit-identical (torch.equal) to its solo run for any slab size and batch,
copies per token fall as the slab grows, and no copy lands in a slot that is being read
or (while the live caches' union fits) one a live cache holds."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from batch_runs import solo
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.cli import build_parser
from psr.cli.generate import load_options
from psr.load_config import LoadConfig
from psr.runtime.batch import BatchDecoder

E, K, C = 8, 2, 2  # the tiny OLMoE: 8 experts per layer, top-2; residency 0.25: 2 slots


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("slab") / "olmoe")


@pytest.fixture(scope="module")
def model(ckpt) -> psr.OffloadedModel:
    """Solo slots 2, a store of 8 slots per layer; members read through the slab (as on
    CUDA: copies, runs of rows, spills)."""
    m = psr.load(ckpt, "psr", 0.25, batch_slots=E, lam=0.3, n=1, progress=False, dtype="float32")
    m.runtime.prefill_reads = "slab"
    return m


class _Watch:
    """The slab's store, watched: a copy never targets a slot being read, nor (while the
    live caches' union fits the slab) a slot whose expert a live cache holds; each read
    slot holds (or loads) the expert read from it."""

    def __init__(self, dec: BatchDecoder) -> None:
        self.dec, self.store = dec, dec.slab.store
        self.reading_now: dict[int, set[int]] = {}
        self.copies = self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def enqueue_copies(self, layer: int, slots: Sequence[int], experts: Sequence[int],
                       **kw: Any) -> None:  # fmt: skip
        assert not set(slots) & self.reading_now.get(layer, set())
        slab = self.dec.slab
        held, refs = slab.held(layer), slab.refs[layer]
        if len(refs) <= slab.size:
            first = slab.where(layer)
            for s in slots:  # empty, a second copy, or an expert no live cache holds
                assert held[s] < 0 or first[held[s]] != s or refs.get(held[s], 0) == 0
        self.copies += len(slots)
        self.store.enqueue_copies(layer, slots, experts, **kw)

    @contextmanager
    def reading(self, layer: int, slots: Sequence[int], experts: Sequence[int]) -> Iterator[Any]:
        held = self.store.slot_experts(layer)
        assert [held[s] for s in slots] == list(experts)
        self.reading_now[layer] = set(slots)
        self.reads += 1
        try:
            with type(self.store).reading(self.store, layer, slots, experts) as s:
                yield s
        finally:
            del self.reading_now[layer]


def _run(model, prompts, n, joins, max_batch, slab_slots=None, trace=False):
    """Greedy decoding in one watched BatchDecoder (prompt j joins at step joins[j] or when
    a place frees up, leaves after n[j] tokens): each one's tokens and logits, the decoder,
    and its watch."""
    dec = BatchDecoder(model, max_batch, slab_slots=slab_slots)
    watch = _Watch(dec)
    dec.slab.store = watch  # type: ignore[assignment]  # the slab's copies
    model.runtime.store.reading = watch.reading  # type: ignore[method-assign]  # every read
    try:
        return (*_decode(dec, prompts, n, joins, trace), dec, watch)
    finally:
        del model.runtime.store.reading


def _decode(dec, prompts, n, joins, trace):
    """Each waiting prompt joins once its step came and a place is free; each sequence
    takes its greedy tokens until it has n[j], then leaves."""
    seq_of: dict[int, int] = {}
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    waiting, step = list(range(len(prompts))), 0
    if trace:
        dec.record_trace()
    while waiting or dec.live:
        came = [j for j in waiting if joins[j] <= step]
        for j in came[: dec.max_batch - len(dec.live)]:
            waiting.remove(j)
            seq_of[dec.add(prompts[j])] = j
        got = {s: (seq_of[s], lg) for s, lg in dec.ready().items()}
        for j, lg in got.values():
            logits[j].append(lg)
        done = {s for s, (j, _) in got.items() if len(logits[j]) == n[j]}
        for s in done:
            dec.remove(s)
        dec.feed({s: int(lg.float().argmax()) for s, (_, lg) in got.items() if s not in done})
        step += 1
    stacked = [torch.stack(x) for x in logits]
    return [x.float().argmax(-1).tolist() for x in stacked], stacked


def _prompts(seed: int, count: int) -> tuple[list[list[int]], list[int], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 12))] for _ in range(count)]
    return prompts, [rng.randint(3, 9) for _ in prompts], [rng.randint(0, 4) for _ in prompts]


def test_the_store_has_batch_slots_and_each_cache_the_solo_ones(ckpt, model) -> None:
    """batch_slots sizes the store only: capacity, routing and solo tokens as without it."""
    rt = model.runtime
    assert (rt.capacity, rt.max_capacity, len(rt.store.slot_experts(0))) == (C, E, E)
    plain = psr.load(ckpt, "psr", 0.25, lam=0.3, n=1, progress=False, dtype="float32")
    plain.runtime.prefill_reads = "slab"
    assert plain.runtime.max_capacity == C
    for p in ([5, 6, 7, 8, 9], [42, 42, 1]):
        a, b = solo(model, p, 8), solo(plain, p, 8)
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert BatchDecoder(model, 3).slab.size == 3 * C  # default: b x slots, up to the store's
    assert BatchDecoder(model, 5).slab.size == E
    assert BatchDecoder(plain, 4).slab.size == C


@pytest.mark.parametrize(("b", "slab_slots"), [(2, 2), (3, 3), (3, 6), (4, 5), (4, 8)])
def test_rows_equal_solo_for_any_slab_size_under_copy_delays(model, b, slab_slots) -> None:
    prompts, n, joins = _prompts(b * 10 + slab_slots, b + 1)  # one waits for a place
    model.runtime.store.set_copy_delay(1500, seed=slab_slots)
    try:
        toks, logits, dec, watch = _run(model, prompts, n, joins, b, slab_slots)
    finally:
        model.runtime.store.set_copy_delay(0)
    assert dec.slab.size == slab_slots and watch.copies > 0 and watch.reads > 0
    for j, p in enumerate(prompts):
        st, sl = solo(model, p, n[j])
        assert toks[j] == st, f"prompt {j}"
        assert torch.equal(logits[j].float(), sl), f"prompt {j}"
    if slab_slots >= b * C:  # the union of the live caches always fits: nothing spilled
        assert dec.slab.counts["spilled"] == 0
    assert not any(dec.slab.refs)


def test_copies_per_token_fall_as_the_slab_grows(model) -> None:
    """The same 4 sequences decoded in slabs of 2 .. 8 slots: the same tokens, fewer copies
    per token; with 2 the layer steps read in runs (the union does not fit at once)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(64) for _ in range(6)] for _ in range(4)]
    n, joins = [10] * 4, [0] * 4
    copies, runs, tokens = {}, {}, []
    for size in (2, 4, 6, 8):
        toks, _, dec, _ = _run(model, prompts, n, joins, 4, size, trace=True)
        trace = dec.trace
        assert trace is not None
        steps = [s for tok in trace.tokens for s in tok]
        copies[size] = sum(len(s.copies) for s in steps) / sum(n)
        runs[size] = max(len(s.slots) for s in steps)
        tokens.append(toks)
    assert all(t == tokens[0] for t in tokens)
    sizes = sorted(copies)
    assert all(copies[a] >= copies[b] for a, b in itertools.pairwise(sizes))
    assert copies[8] < copies[2], copies
    assert runs[2] > 2  # a layer step read more experts than its 2 slots: in runs


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"batch_slots": 0}, r"^batch_slots must be an int >= 1 \(slots per layer\), got 0$"),
        ({"batch_slots": True}, r"^batch_slots must be an int >= 1 .* got True$"),
        ({"batch_slots": "8"}, r"^batch_slots must be an int >= 1 .* got '8'$"),
        ({"batch_slots": 4, "gpu_memory": "1GB"}, r"^batch_slots with gpu_memory needs slots"),
    ],
)
def test_nonsense_batch_slots_fail_in_one_line(options, error) -> None:
    with pytest.raises(ValueError, match=error) as e:
        LoadConfig(**options)
    assert "\n" not in str(e.value)


def test_batch_slots_against_the_checkpoint_and_slab_slots_against_the_store(ckpt, model):
    with pytest.raises(ValueError, match=r"^batch_slots=1 is fewer than the 2 solo slots"):
        psr.load(ckpt, "exact", 0.25, batch_slots=1, progress=False)
    with pytest.raises(ValueError, match=r"^batch_slots=9 exceeds the 8 experts per layer$"):
        psr.load(ckpt, "exact", 0.25, batch_slots=9, progress=False)
    for bad in (1, 9):
        with pytest.raises(ValueError, match=rf"^slab_slots={bad} is outside \[2, 8\]"):
            BatchDecoder(model, 2, slab_slots=bad)
    with pytest.raises(ValueError, match=r"^slab_slots must be an int"):
        BatchDecoder(model, 2, slab_slots=4.0)  # type: ignore[arg-type]


def test_the_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x", "--batch-slots", "32"])
    assert LoadConfig.of("load", **load_options(args)).batch_slots == 32


def test_a_slab_of_the_first_slots_frees_second_copies_first(model) -> None:
    """A slab of 4 of the store's 8 slots: slots past it untouched; a second copy of an
    expert (a newcomer's solo prefill stages its own) is taken first, then unheld experts,
    and a spill only when nothing else is left, never a slot read at once."""
    from psr.runtime.batch_slab import SharedSlab
    from psr.store import CopyReason

    store = model.runtime.store
    store.enqueue_copies(0, list(range(E)), list(range(E)))
    store.enqueue_copies(0, [3], [0])  # slots 0 and 3 both hold expert 0
    slab = SharedSlab(store, len(model.runtime.layers), size=4)
    assert slab.held(0) == [0, 1, 2, 0] and slab.where(0) == {0: 0, 1: 1, 2: 2}
    slab.hold(0, [1, 2])
    assert slab.ensure(0, [5], CopyReason.MISS)[5] == 3  # the second copy of 0
    assert slab.ensure(0, [6], CopyReason.MISS)[6] == 0  # 0 and 5 unheld: the first slot
    slab.hold(0, [5, 6])
    assert 7 not in slab.ensure(0, [7], CopyReason.PREFETCH, spill=False)  # all held: skipped
    where = slab.ensure(0, [7, 1], CopyReason.MISS)  # spills a held one, never 1 (read now)
    assert where[7] == 0 and where[1] == 1 and slab.counts["spilled"] == 1
    assert store.slot_experts(0)[4:] == [4, 5, 6, 7]
    assert slab.counts["copies"] == 3 and slab.counts["skipped_prefetches"] == 1
    slab.drop(0, [1, 2, 5, 6])
    assert not slab.refs[0]


def test_the_memory_plan_counts_the_batch_slots(tmp_path: Path, monkeypatch) -> None:
    """With gpu_memory and slots, the plan checks the store's batch_slots, before any
    weight is copied: a budget that holds 2 slots per layer refuses 4."""
    from gguf_files import gguf_tiny_model, write_gguf

    import psr.models.loader as loader
    from psr.models.memory_plan import Budget, MemoryPlanError

    path = tmp_path / "q.gguf"
    write_gguf(gguf_tiny_model("qwen3_moe"), path, {"experts": "Q4_K", "dense": "Q8_0"})
    budget = Budget(gpu_memory=2**40, slots=2, context=64, dense_format="native", cuda=False)
    need = psr.inspect(path, budget).plan
    assert need is not None and need.slots == 2
    opts = dict(device="cpu", gpu_memory=need.device_total + 64, context=64, progress=False)
    with psr.load(path, slots=2, **opts) as m:  # type: ignore[arg-type]
        assert m.runtime.store.layers[0].num_slots == 2
    monkeypatch.setattr(loader, "_build_model", lambda *a: pytest.fail("a weight was copied"))
    with pytest.raises(MemoryPlanError, match=r"slab of 4 slots"):
        psr.load(path, slots=2, batch_slots=4, **opts)  # type: ignore[arg-type]


def test_batch_sizes_the_slab_for_its_union_on_cuda_only(ckpt) -> None:
    """`batch` (psr serve --parallel N): on CUDA min(E, batch x slots) unless batch_slots is
    given or the plan chooses the slots; the CPU backend's batch reads host rows: solo."""
    cfg = LoadConfig(batch=3)
    assert cfg.batch_slab(2, E, cuda=True) == 6
    assert cfg.batch_slab(4, E, cuda=True) == E  # the union cannot pass the experts
    assert cfg.batch_slab(2, E, cuda=False) is None
    assert LoadConfig(batch=3, batch_slots=5).batch_slab(2, E, cuda=True) == 5
    assert LoadConfig(batch=1).batch_slab(2, E, cuda=True) is None
    assert LoadConfig(batch=3, gpu_memory="1GB").batch_slab(2, E, cuda=True) is None
    for bad in (0, True, "4"):
        with pytest.raises(ValueError, match=r"^batch must be an int >= 1 \(sequences\), got"):
            LoadConfig(batch=bad)  # type: ignore[arg-type]
    m = psr.load(ckpt, "exact", 0.25, batch=4, progress=False)
    assert m.runtime.store.layers[0].num_slots == C  # the CPU backend: no more slots
    m.close()
