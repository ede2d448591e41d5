"""Prefill's per-expert CPU-vs-copy split (issue 36 item 1), on the CPU backend forced onto
CUDA's slab path: each chunk computes on the CPU exactly the experts its layer's threshold
picks (from the chunk's routed ids), the rest copied; results equal the all-copied path
within fp32 rounding; the routing, the logical caches' seed and the decode counts are
identical; fewer prefill copies; a split is part of the prompt cache's key; bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.machine import MachineProfile, PrefillSplit, ShapeCosts, fingerprint, shape_key
from psr.runtime.chunked import PromptCache
from psr.runtime.compute import ExpertCompute
from psr.runtime.prefill import split_experts

CHUNK = 8
PROMPT = torch.arange(40)[None] * 7 % 64  # 5 chunks of 8 tokens, top-2 of 8 experts
NEW = 5
COUNTS = ("tokens", "routed", "hits", "misses", "prefetches")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("split") / "olmoe")


def _model(ckpt: Path, split: PrefillSplit | None, **kw) -> psr.OffloadedModel:
    model = psr.load(ckpt, "psr", 0.5, lam=0.3, n=1, progress=False, **kw)
    model.set_prefill_chunk(CHUNK)
    model.runtime.prefill_reads = "slab"  # CUDA's path, on the CPU backend
    if split is not None:
        model.set_prefill_split(split)
    return model


def _run(model: psr.OffloadedModel):
    seen: list[torch.Tensor] = []

    def keep(_ids, scores):
        seen.append(scores.clone())
        return scores

    model.reset_stats()
    out = model.generate(PROMPT, max_new_tokens=NEW, logits_processor=keep)
    rt = model.runtime
    seeds = [L.cache.order() for L in rt.layers]
    hist = rt.histories()
    s = model.stats
    return out[0].tolist(), torch.stack(seen), seeds, hist, {k: s[k] for k in COUNTS}, s


def test_split_experts_by_threshold() -> None:
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # counts: 0:4, 1:2, 2:1, 3:1
    split = PrefillSplit((3, 0))
    assert split_experts(split, 0, ids, 6) == ([1, 2, 3], [0])
    assert split_experts(split, 1, ids, 6) == ([], [0, 1, 2, 3])


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_the_split_computes_the_chosen_experts_on_the_cpu_and_changes_no_routing(
    ckpt, monkeypatch, fmt
) -> None:
    monkeypatch.setenv("PSR_COPY_DELAY_US", "1000")
    base = _run(_model(ckpt, None, expert_format=fmt))
    split = PrefillSplit((3, 2, 0))  # layer 0: experts of 1-2 tokens on the CPU; 1: 1; 2: none
    calls: list[tuple[int, list[int]]] = []
    real = ExpertCompute.grouped_host

    def spy(self, x, ids, weights, host, bias=None, only=None, out_dtype=None):
        assert only is not None  # the host path is not taken: only the split's CPU part
        calls.append((ids.shape[0], torch.nonzero(only).flatten().tolist()))
        return real(self, x, ids, weights, host, bias, only=only, out_dtype=out_dtype)

    monkeypatch.setattr(ExpertCompute, "grouped_host", spy)
    model = _model(ckpt, split, expert_format=fmt)
    got = _run(model)
    monkeypatch.setattr(ExpertCompute, "grouped_host", real)
    # routing, the seed and the decode counts identical; tokens equal; logits within rounding
    assert got[3] == base[3] and got[2] == base[2] and got[4] == base[4]
    assert got[0] == base[0]
    torch.testing.assert_close(got[1], base[1], rtol=1e-4, atol=1e-4)
    assert got[5]["prefill_copies"] < base[5]["prefill_copies"]
    # the CPU computed exactly the experts the thresholds pick from each chunk's routed ids
    hist = base[3]
    want = []
    for start in range(0, PROMPT.shape[1], CHUNK):
        for layer, h in enumerate(hist):
            ids = torch.tensor(h[start : start + CHUNK])
            cpu, _ = split_experts(split, layer, ids, model.runtime.spec.num_experts)
            if cpu:
                want.append((ids.shape[0], cpu))
    assert calls == want and len(want) > 0


def test_the_split_is_reproducible_and_keys_the_prompt_cache(ckpt, monkeypatch) -> None:
    split = PrefillSplit((3, 3, 3))
    monkeypatch.setenv("PSR_COPY_DELAY_US", "0")
    a = _run(_model(ckpt, split))
    monkeypatch.setenv("PSR_COPY_DELAY_US", "3000")
    model = _model(ckpt, split)
    b = _run(model)
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and a[4] == b[4]
    cache = PromptCache(1 << 26)
    model.generate(PROMPT[:, :24], max_new_tokens=1, prompt_cache=cache)
    model.set_prefill_split(PrefillSplit.off(3))
    model.generate(PROMPT, max_new_tokens=1, prompt_cache=cache)
    assert cache.last_cached == 0  # another split: another configuration
    model.set_prefill_split(split)
    hit = _run_cached(model, cache)
    assert cache.last_cached == 16 and hit[0] == a[0] and torch.equal(hit[1], a[1])


def _run_cached(model: psr.OffloadedModel, cache: PromptCache):
    seen: list[torch.Tensor] = []

    def keep(_ids, scores):
        seen.append(scores.clone())
        return scores

    out = model.generate(PROMPT, max_new_tokens=NEW, logits_processor=keep, prompt_cache=cache)
    return out[0].tolist(), torch.stack(seen)


def test_the_split_from_a_profile_and_bad_input(ckpt) -> None:
    model = _model(ckpt, None)
    rt = model.runtime
    c = rt.spec
    dtype = str(rt.store.dtype).removeprefix("torch.")
    key = shape_key(c.hidden_size, c.ffn_size, dtype)
    prof = MachineProfile(
        fingerprint(1, "none", "0"), 1e-5, 1e10, {key: ShapeCosts(1, 1e-4, 2.5e-4)}
    )
    assert model.set_prefill_split(profile=prof) == PrefillSplit((3, 3, 3))
    assert rt.prefill_split == PrefillSplit((3, 3, 3))
    with pytest.raises(ValueError, match="2 thresholds for 3 MoE layers"):
        model.set_prefill_split(PrefillSplit((1, 2)))


def test_pageable_rows_are_copied_only(ckpt) -> None:
    """The CPU kernels read host rows in place: a layer with pageable rows takes no split
    (refused when asked for, off when chosen from the profile)."""
    ref = _model(ckpt, None)
    m = ref.memory(context=1)
    ref.close()
    budget = m["device_dense"] + m["device_slab"] + m["host_experts"] // 4
    paged = psr.load(ckpt, "psr", 0.5, lam=0.3, n=1, progress=False, host_memory=budget)
    assert paged.memory()["pageable_experts"] > 0
    with pytest.raises(ValueError, match="held in host memory"):
        paged.set_prefill_split(PrefillSplit((3, 3, 3)))
    c = paged.runtime.spec
    key = shape_key(c.hidden_size, c.ffn_size, str(paged.runtime.store.dtype)[6:])
    prof = MachineProfile(fingerprint(1, "none", "0"), 0.0, 1e10, {key: ShapeCosts(1, 1e-4, 1e-3)})
    assert paged.set_prefill_split(profile=prof) == PrefillSplit.off(3)


def test_a_failed_copy_beside_the_cpu_part_raises_and_recovers(ckpt) -> None:
    split = PrefillSplit((3, 3, 3))
    want = _run(_model(ckpt, split))[0]
    model = psr.load(ckpt, "psr", 0.5, lam=0.3, n=1, progress=False, copy_retries=0)
    model.set_prefill_chunk(CHUNK)
    model.runtime.prefill_reads = "slab"
    model.set_prefill_split(split)
    model.runtime.store.fail_next_copies(1)
    with pytest.raises(psr.CopyError):
        model.generate(PROMPT, max_new_tokens=NEW)
    model.runtime.store.fail_next_copies(0)
    assert _run(model)[0] == want
