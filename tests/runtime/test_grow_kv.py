"""kv_format="auto" grows full-attention layers in place (runtime/kv_quant.py `GrowLayer`):
a decode step writes its token into a buffer instead of copying the whole cache. Pinned
here: the logits are bit-identical to transformers' DynamicLayer (torch.cat) on every
attention kind, the buffers regrow (a small GROW_MIN), and copies sharing a buffer (the
prompt cache's snapshots) never see each other's writes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint
from transformers.cache_utils import DynamicCache, DynamicLayer

import psr
import psr.runtime.kv_quant as kvq
from psr.runtime.chunked import kv_snapshot
from psr.runtime.kv import kv_bytes, output_cache
from psr.runtime.kv_quant import GrowLayer, new_cache

FAMILIES = ("qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")  # GQA, GQA, MLA, sliding + full


@torch.no_grad()
def _greedy(model: Any, cache: Any, steps: int) -> torch.Tensor:
    """Logits `[steps + 1, V]` of a greedy decode after a 6-token prompt (two chunks)."""
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids[:, :4], cache=cache, use_cache=True)
    logits = model(input_ids=ids[:, 4:], cache=cache, use_cache=True).logits[0, -1]
    seen = [logits]
    for _ in range(steps):
        step = logits.argmax().view(1, 1)
        logits = model(input_ids=step, cache=cache, use_cache=True).logits[0, -1]
        seen.append(logits)
    return torch.stack(seen)


@pytest.mark.parametrize("family", FAMILIES)
def test_grown_cache_gives_dynamic_cache_logits_bit_for_bit(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvq, "GROW_MIN", 3)  # regrow every few tokens
    model = tiny_model(family)
    want = _greedy(model, DynamicCache(config=model.config), 20)
    cache = new_cache(model.config, "auto")
    got = _greedy(model, cache, 20)
    assert torch.equal(got, want)
    grown = [x for x in cache.layers if isinstance(x, GrowLayer)]
    assert grown, "no full-attention layer grown in place"
    for x in grown:  # views of a buffer with room past them
        assert x.room is not None and x.room.k.shape[-2] > x.keys.shape[-2] == 26


def _kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, t, 4, generator=g), torch.randn(1, 2, t, 3, generator=g)


def test_copies_sharing_a_buffer_never_see_each_others_writes() -> None:
    live, ref = GrowLayer(), DynamicLayer()
    for x in (live, ref):
        x.update(*_kv(5, 0))
    snap = copy.copy(live)  # the prompt cache's snapshot: shares the buffer
    seen = snap.keys.clone(), snap.values.clone()
    live.update(*_kv(2, 1))  # at the fill: in place
    assert live.room is snap.room
    resumed = copy.copy(snap)  # a hit restored from the snapshot, then decoding on
    k, v = resumed.update(*_kv(1, 2))
    assert resumed.room is not live.room  # below the fill: copied first
    assert torch.equal(snap.keys, seen[0]) and torch.equal(snap.values, seen[1])
    ref_snap = copy.copy(ref)
    ref.update(*_kv(2, 1))
    assert torch.equal(live.keys, ref.keys) and torch.equal(live.values, ref.values)
    rk, rv = ref_snap.update(*_kv(1, 2))
    assert torch.equal(k, rk) and torch.equal(v, rv)
    live.crop(-3)  # a shorter view of the same buffer: the next write copies
    ref.crop(-3)
    assert torch.equal(live.update(*_kv(4, 3))[0], ref.update(*_kv(4, 3))[0])
    assert live.keys.shape[-2] == 8


def test_offloaded_generate_grows_its_cache() -> None:
    """psr's forward makes (or converts transformers' empty) caches with grown layers: the
    tokens of transformers' generate on the offloaded model and of psr's agree."""
    hf = tiny_model("olmoe")
    om = psr.offload(hf)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(3))
    out = hf.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert {type(x) for x in output_cache(out).layers} == {GrowLayer}
    assert torch.equal(out.sequences, om.generate(ids, max_new_tokens=5))


def test_a_snapshot_counts_the_buffers_it_keeps() -> None:
    """The prompt cache's budget: a snapshot of grown layers holds their whole buffers
    (the room included), each counted once."""
    model = tiny_model("olmoe")
    cache = new_cache(model.config, "auto")
    model(input_ids=torch.arange(5)[None], cache=cache, use_cache=True)
    got = kv_snapshot(cache, 5)
    assert got is not None
    rooms = [x.room for x in cache.layers]
    assert got[1] == sum(r.k.nbytes + r.v.nbytes for r in rooms if r is not None)
    assert got[1] > sum(x.keys.nbytes + x.values.nbytes for x in cache.layers)


@pytest.mark.parametrize("family", ("olmoe", "deepseek_v3"))  # GQA; MLA
def test_a_cache_decoded_to_its_context_holds_the_planned_kv_bytes(
    family: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room stops at psr.load's context: decoded to it, the grown buffers hold exactly
    the KV bytes the memory plan counts (kv_by_kind at the context), however they regrew."""
    monkeypatch.setattr(kvq, "GROW_MIN", 3)  # regrow every few tokens
    context = 27  # 6 prompt + 21 new: room rounded down at the last regrowth
    path = write_checkpoint(tiny_model(family), tmp_path / family)
    model = psr.load(path, "exact", 1.0, device="cpu", context=context, progress=False)
    cache = model.hf.psr_kv_cache(None)
    step = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for _ in range(context - 6 + 1):  # the prompt, then one token a step to the context
            logits = model.hf(input_ids=step, cache=cache, use_cache=True).logits
            step = logits[:, -1:].argmax(-1)
    grown = [x for x in cache.layers if isinstance(x, GrowLayer)]
    assert len(grown) == len(cache.layers)
    assert {x.room.k.shape[-2] for x in grown} == {context}
    held = sum(x.room.k.nbytes + x.room.v.nbytes for x in grown)
    itemsize = next(model.hf.parameters()).element_size()
    assert held == kv_bytes(model.config, itemsize, context, "auto")


def test_room_never_passes_the_context() -> None:
    assert kvq.grow_capacity(100, None) == 100 + kvq.GROW_MIN
    assert kvq.grow_capacity(100, 120) == 120  # room cut at the context
    assert kvq.grow_capacity(130, 120) == 130  # past it (transformers' generate): no room
    assert kvq.grow_capacity(4096, 8192) == 4096 + 512  # an eighth
