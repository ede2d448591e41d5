"""The streamed layer-major prefill (issue 36 goal 3; psr.runtime.streamed) on the CPU
backend forced onto CUDA's slab path, under injected copy delays: logits, KV, routed ids,
the logical caches' seed and the decode after it are bit-identical to chunk-major prefill
(families, experts_on gpu / cpu / hybrid, the per-expert CPU split); each used expert is
copied at most once per layer and prompt; the schedule it issued is the pure planner's
(what psr.eval.ttft prices); an error in one chunk's forward is raised, no thread left."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.machine import PrefillSplit
from psr.runtime import streamed
from psr.runtime.slots import SlotMap
from psr.runtime.stream_plan import plan_stream, prefetch_plan, prefetch_targets, schedule

CHUNK = 8
PROMPT = torch.arange(37)[None] * 7 % 64  # 5 chunks: 4 of 8 tokens and one of 5
NEW = 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layer_major")
    # top-4: a sum of three or more contributions depends on its order (two commute)
    return {
        f: write_checkpoint(tiny_model(f, num_experts_per_tok=4), root / f)
        for f in ("olmoe", "qwen2_moe", "deepseek_v3", "mixtral")
    }


def _model(path: Path, layer_major: bool, experts_on: str = "gpu", split=None, reads="slab",
           **kw):  # fmt: skip
    model = psr.load(path, "psr", 0.5, lam=0.3, n=1, experts_on=experts_on, progress=False, **kw)
    model.set_prefill_chunk(CHUNK)
    model.runtime.prefill_reads = reads  # "slab": CUDA's path, on the CPU backend
    if split is not None:
        model.set_prefill_split(split)
    model.set_layer_major(layer_major)
    return model


def _run(model: psr.OffloadedModel):
    """Prefill's logits of every position and KV, then a generate's tokens and scores."""
    logits, kv = model._prefill(None, None)(PROMPT, True)
    keys = [layer.keys.clone() for layer in kv.layers]
    seen: list[torch.Tensor] = []

    def keep(_ids, scores):
        seen.append(scores.clone())
        return scores

    out = model.generate(PROMPT, max_new_tokens=NEW, logits_processor=keep)
    rt = model.runtime
    seeds = [L.cache.order() for L in rt.layers]
    return logits, keys, out, torch.stack(seen), rt.histories(), seeds


def _same(a, b) -> None:
    assert torch.equal(a[0], b[0])  # prefill logits, every position
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))  # KV keys
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])  # tokens, decode scores
    assert a[4] == b[4] and a[5] == b[5]  # routed ids, seeded caches


@pytest.mark.parametrize(
    ("family", "experts_on"),
    [
        ("olmoe", "gpu"), ("olmoe", "cpu"), ("olmoe", "hybrid:1"), ("qwen2_moe", "gpu"),
        ("deepseek_v3", "gpu"), ("mixtral", "gpu"),
    ],
)  # fmt: skip
def test_layer_major_is_bit_identical_under_copy_delays(ckpts, monkeypatch, family, experts_on):
    base = _run(_model(ckpts[family], False, experts_on))
    monkeypatch.setattr(streamed, "PREFETCH_TOKENS", 16)  # later layers prefetched too
    monkeypatch.setenv("PSR_COPY_DELAY_US", "2000")
    for seed in ("1", "2"):
        monkeypatch.setenv("PSR_COPY_DELAY_SEED", seed)
        model = _model(ckpts[family], True, experts_on)
        _same(_run(model), base)
        scheds = model.prefill_schedules
        assert len(scheds) == len(model.runtime.layers)
        for s in scheds:  # the whole prompt per layer; each used expert copied once at most
            assert sum(s.chunk_tokens) == PROMPT.shape[1]
            copied = [ev.expert for ev in s.events if ev.kind == "copy"]
            assert len(copied) == len(set(copied))


def test_layer_major_on_the_host_path_is_bit_identical(ckpts) -> None:
    """The CPU backend's own prefill (host rows, no slab) runs each chunk's code in turn."""
    base = _run(_model(ckpts["olmoe"], False, reads="host"))
    model = _model(ckpts["olmoe"], True, reads="host")
    _same(_run(model), base)
    assert model.prefill_schedules == []  # nothing staged: no schedule issued


def test_layer_major_with_the_cpu_split_is_bit_identical(ckpts, monkeypatch) -> None:
    split = PrefillSplit((3, 2, 0))  # layer 0: experts of 1-2 tokens of a chunk on the CPU
    monkeypatch.setenv("PSR_COPY_DELAY_US", "1000")
    base = _run(_model(ckpts["olmoe"], False, split=split))
    model = _model(ckpts["olmoe"], True, split=split)
    _same(_run(model), base)
    assert sum(model.prefill_schedules[0].cpu_tokens) > 0  # the split took some experts
    assert sum(model.prefill_schedules[2].cpu_tokens) == 0


def test_fewer_copies_than_chunk_major(ckpts) -> None:
    counts = []
    for lm in (False, True):
        model = _model(ckpts["olmoe"], lm)
        model.generate(PROMPT, max_new_tokens=1)
        counts.append(model.stats["prefill_copies"])
    assert counts[1] < counts[0]


def test_the_issued_schedule_is_the_planners(ckpts, monkeypatch) -> None:
    """Replaying the pure planner over the recorded routing gives exactly the events the
    runtime issued (what psr.eval.ttft prices), prefetch into the next layer included."""
    monkeypatch.setattr(streamed, "PREFETCH_TOKENS", 16)  # the tiny prompt prefetches
    model = _model(ckpts["olmoe"], True)
    slots = [SlotMap(L.slots.slot_expert) for L in model.runtime.layers]
    model.generate(PROMPT, max_new_tokens=1)
    hist = model.runtime.histories()
    ends = [0, *range(CHUNK, PROMPT.shape[1], CHUNK), PROMPT.shape[1]]
    E = model.runtime.spec.num_experts
    for i, rec in enumerate(model.prefill_schedules):
        h = hist[i][: PROMPT.shape[1]]
        chunks = [h[s:e] for s, e in itertools.pairwise(ends)]
        sp = plan_stream(slots[i], h, chunks, lambda n: False)
        ahead = [
            (p - i, s, e)
            for p in prefetch_targets(i, len(slots))
            for s, e in prefetch_plan(slots[p], range(E))
        ]
        assert rec.events == schedule(i, sp.plan, sp.chunks, ahead).events
    first = model.prefill_schedules[0].events  # the first layer fills the next two
    assert {ev.ahead for ev in first if ev.kind == "prefetch"} == {1, 2}


def test_an_error_in_a_chunk_is_raised_and_no_thread_is_left(ckpts, monkeypatch) -> None:
    model = _model(ckpts["olmoe"], True)
    real = streamed.streamed_layer

    def boom(rt, step, layer, chunks):
        if layer.index == 1:
            raise RuntimeError("injected at layer 1")
        return real(rt, step, layer, chunks)

    monkeypatch.setattr(streamed, "streamed_layer", boom)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="injected at layer 1"):
        model.generate(PROMPT, max_new_tokens=1)
    assert threading.active_count() == before
    monkeypatch.setattr(streamed, "streamed_layer", real)
    model.generate(PROMPT, max_new_tokens=1)  # the model still prefills afterwards


def test_set_layer_major_refuses_a_non_bool(ckpts) -> None:
    model = _model(ckpts["olmoe"], False)
    with pytest.raises(ValueError, match="set_layer_major: on must be a bool"):
        model.set_layer_major("yes")  # type: ignore[arg-type]


def _prefill(model: psr.OffloadedModel):
    """A prompt's prefill alone: its logits, KV keys, routed ids and seeded caches."""
    logits, kv = model._prefill(None, None)(PROMPT.to(model.device), True)
    rt = model.runtime
    keys = [layer.keys.clone() for layer in kv.layers]
    return logits, keys, rt.histories(), [L.cache.order() for L in rt.layers]


def test_the_device_path_s_grouped_kernel_is_bit_identical_too(ckpts, monkeypatch) -> None:
    """CUDA's prefill experts (compute="triton": the grouped Triton GEMM, here under the
    interpreter on CPU tensors): layer-major prefill equals chunk-major bit for bit (logits,
    KV, routed ids, seeds), each computing every (chunk, expert) with the same call; and
    it computes what the reference path does."""
    import psr_kernels as pk

    calls: list[int] = []
    real = pk.grouped_expert_ffn

    def spy(x, *a, **kw):
        calls.append(x.shape[0])
        return real(x, *a, **kw)

    monkeypatch.setattr(pk, "grouped_expert_ffn", spy)
    monkeypatch.setenv("PSR_COPY_DELAY_US", "1000")
    ckpt = ckpts["qwen2_moe"]  # the smallest family; every token routed to 4 experts
    base = _prefill(_model(ckpt, False, compute="triton"))
    pairs = PROMPT.shape[1] * 4 * len(base[2])  # every layer's routed pairs
    assert sum(calls) == pairs
    got = _prefill(_model(ckpt, True, compute="triton"))
    assert sum(calls) == 2 * pairs
    assert torch.equal(got[0], base[0]) and got[2:] == base[2:]
    assert all(torch.equal(a, b) for a, b in zip(got[1], base[1], strict=True))
    ref = _prefill(_model(ckpt, False, compute="torch"))
    torch.testing.assert_close(base[0], ref[0], rtol=1e-4, atol=1e-4)
    assert ref[2] == base[2]  # the same routing


@pytest.mark.gpu
def test_layer_major_on_cuda_is_bit_identical(tmp_path) -> None:
    """On a GPU (the grouped GEMM compiled, copies really in flight): layer-major prefill
    equals chunk-major bit for bit. (tmp_path only: the mini GPU runner runs it too.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = write_checkpoint(tiny_model("olmoe", num_experts_per_tok=4), tmp_path / "olmoe")
    base = _prefill(_model(path, False, device="cuda"))
    got = _prefill(_model(path, True, device="cuda"))
    assert torch.equal(got[0], base[0]) and got[2:] == base[2:]
    assert all(torch.equal(a, b) for a, b in zip(got[1], base[1], strict=True))
