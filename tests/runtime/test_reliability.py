"""Reliability of a loaded model: copy failures, threads, bad input, resources, a soak run."""

from __future__ import annotations

import gc
import json
import math
import threading
from pathlib import Path

import pytest
import torch
from procfs import copy_threads, rss_bytes
from safetensors.torch import load_file, save_file
from tiny_models import KV_KWARG, tiny_model, write_checkpoint

import psr
from psr.runtime.kv import output_cache

PROMPT = [5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]
NEW = 12
POLICY = dict(policy="psr", residency=0.5, lam=0.5, n=2)
KV = KV_KWARG  # the KV-cache keyword of the installed transformers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("rel") / "olmoe")


def load(path, **kw) -> psr.OffloadedModel:
    return psr.load(path, **{**POLICY, "progress": False, **kw})


def consistent(model: psr.OffloadedModel) -> None:
    """Counts that must add up whatever happened."""
    s = model.stats
    assert s["hits"] + s["misses"] == s["routed"]
    assert s["copies"] == s["misses"] + s["prefetches"]
    assert s["bytes_copied"] == s["copies"] * model.runtime.expert_bytes
    assert s["prefetch_used"] <= s["prefetches"]
    st = model.runtime.store
    for L in model.runtime.layers:
        assert st.readers(L.index) == [0] * len(st.readers(L.index))  # nothing held


# --------------------------------------------------------------------------- 1. copy failure


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_failed_copy_raises_then_the_model_recovers_by_itself(ckpt, when) -> None:
    fresh = load(ckpt).generate(PROMPT, NEW).tolist()
    model = load(ckpt, copy_retries=0)
    if when == "decode":
        model.generate(PROMPT, 2)  # decode steps under way; the next copies fail
        with pytest.raises(psr.CopyError):
            for _ in range(5):  # some decode step will copy
                model.runtime.store.fail_next_copies(1)
                model.generate([3, 1, 4, 1, 5, 9, 2, 6], 8)
    else:
        model.runtime.store.fail_next_copies(1)
        with pytest.raises(psr.CopyError):
            model.generate(PROMPT, NEW)
    consistent(model)
    model.runtime.store.fail_next_copies(0)
    assert model.generate(PROMPT, NEW).tolist() == fresh
    assert model.decode_logits(torch.tensor([PROMPT]), 4).shape[1] == len(PROMPT)
    consistent(model)


def test_transient_copy_failures_are_retried_within_the_call(ckpt) -> None:
    clean = load(ckpt)
    want = clean.generate(PROMPT, NEW).tolist()
    model = load(ckpt, copy_retries=3)
    model.runtime.store.fail_next_copies(3)  # absorbed by the retries of one acquire
    assert model.generate(PROMPT, NEW).tolist() == want
    c = model.runtime.store.counters()
    assert c["failed_copies"] == 3 and c["retried_copies"] == 3
    # Logical counts do not see physical retries; the store counts every issued copy.
    assert model.stats["copies"] == clean.stats["copies"]
    consistent(model)


# --------------------------------------------------------------------------- 2. threads


def test_threads_sharing_a_model_wait_for_each_other_and_get_right_tokens(ckpt) -> None:
    prompts = [PROMPT, [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 8], [60, 61, 62, 63, 0, 1, 2], [9, 8]]
    solo = load(ckpt)
    want = {i: solo.generate(p, NEW).tolist() for i, p in enumerate(prompts)}
    shared = load(ckpt)
    got: dict[tuple[int, int], list] = {}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for r in range(6):
                i = (t + r) % len(prompts)
                got[t, r] = (i, shared.generate(prompts[i], NEW).tolist())
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(got) == 36
    for i, toks in got.values():
        assert toks == want[i]
    consistent(shared)


def test_interleaved_sequences_are_refused_never_mixed(ckpt) -> None:
    """Raw forwards (as transformers' generate makes them) of two sequences interleaved:
    the superseded one is refused with a clear error, the current one stays right."""
    model = load(ckpt)
    hf = model.hf
    a = hf(input_ids=torch.tensor([PROMPT]), use_cache=True)
    b = hf(input_ids=torch.tensor([[3, 1, 4, 1]]), use_cache=True)  # a second sequence
    with pytest.raises(RuntimeError, match="KV cache is not the current sequence's"):
        hf(input_ids=torch.tensor([[1]]), use_cache=True, **{KV: output_cache(a)})
    hf(input_ids=torch.tensor([[1]]), use_cache=True, **{KV: output_cache(b)})  # still fine

    def other_thread() -> None:
        try:
            hf(input_ids=torch.tensor([[2]]), use_cache=True, **{KV: output_cache(b)})
        except RuntimeError as e:
            seen.append(str(e))

    seen: list[str] = []
    th = threading.Thread(target=other_thread)
    th.start()
    th.join()
    assert seen and "belongs to another thread" in seen[0]
    consistent(model)


# --------------------------------------------------------------------------- 3-5. bad input


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.tensor([5.7, 6.2]), "integer tensor, got torch.float32"),
        (torch.tensor([True, False]), "integer tensor, got torch.bool"),
        ([5.7, 6.2], "token ids must be ints, got 5.7"),
        ([True, 3], "token ids must be ints, got True"),
        ([[5, 6.0]], "token ids must be ints, got 6.0"),
    ],
)
def test_prompts_that_are_not_integers_are_refused(ckpt, ids, match) -> None:
    model = load(ckpt)
    with pytest.raises(TypeError, match=match):
        model.generate(ids, 2)


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"max_new_tokens": 1.5}, TypeError, "max_new_tokens must be an int >= 0, got 1.5"),
        ({"max_new_tokens": math.nan}, TypeError, "max_new_tokens must be an int >= 0"),
        ({"max_new_tokens": "3"}, TypeError, "max_new_tokens must be an int >= 0, got '3'"),
        ({"max_new_tokens": -1}, TypeError, "max_new_tokens must be an int >= 0, got -1"),
        ({"do_sample": True, "temperature": 0.0}, ValueError, "finite temperature > 0"),
    ],
)
def test_generation_arguments_are_checked(ckpt, kw, err, match) -> None:
    model = load(ckpt)
    with pytest.raises(err, match=match):
        model.generate(PROMPT, **{"max_new_tokens": 2, **kw})


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"slots": 4.7}, TypeError, "slots must be an int, got 4.7"),
        ({"slots": True}, TypeError, "slots must be an int"),
        ({"residency": "abc"}, ValueError, "residency must be a number in"),
        ({"residency": math.nan}, ValueError, "residency must be a number in"),
        ({"compute": "fast"}, ValueError, "compute must be one of auto, triton, torch"),
    ],
)
def test_load_arguments_name_the_problem(ckpt, kw, err, match) -> None:
    with pytest.raises(err, match=match):
        load(ckpt, **kw)


@pytest.mark.parametrize("bad", [torch.int8, torch.bool])
def test_non_float_expert_tensors_are_refused(ckpt, tmp_path, bad) -> None:
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    for f in ckpt.iterdir():
        (bad_dir / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(bad_dir / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    sd[name] = sd[name].to(bad)
    save_file(sd, str(bad_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(psr.CheckpointError, match=rf"{name}.*must be floating point"):
        load(bad_dir)


def _copy_ckpt(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_experts": None, "num_local_experts": None}, "lacks 'num_experts'"),
        ({"num_experts": 0}, "num_experts must be a positive int, got 0"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 experts per token exceeds"),
        ({"num_experts_per_tok": 1.5}, "num_experts_per_tok must be a positive int"),
    ],
)
def test_bad_configs_name_the_key(ckpt, tmp_path, changes, match) -> None:
    path = _copy_ckpt(ckpt, tmp_path / "c")
    _edit_config(path, **changes)
    with pytest.raises(psr.CheckpointError, match=match):
        load(path)


def test_shard_index_cannot_leave_the_checkpoint_folder(ckpt, tmp_path) -> None:
    path = _copy_ckpt(ckpt, tmp_path / "c")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT " * 10)
    index = {"weight_map": {"model.norm.weight": "../secret.txt"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(psr.CheckpointError, match="not a file in the checkpoint folder") as e:
        load(path)
    assert "TOP-SECRET" not in str(e.value)
    index["weight_map"]["model.norm.weight"] = "/etc/passwd"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(psr.CheckpointError, match="not a file in the checkpoint folder"):
        load(path)


def _write_header(path: Path, header: object) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 64)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ([1, 2, 3], "header is not a JSON object"),
        ({"w": {"dtype": "F32", "shape": [4]}}, "'w' lacks a valid dtype, shape or data_offsets"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0]}}, "'w' lacks a valid"),
        ({"w": "x"}, "'w' lacks a valid"),
    ],
)
def test_corrupt_safetensors_headers_name_the_file(ckpt, tmp_path, header, match) -> None:
    path = _copy_ckpt(ckpt, tmp_path / "c")
    _write_header(path / "model.safetensors", header)
    with pytest.raises(psr.CheckpointError, match=match) as e:
        load(path)
    assert "model.safetensors" in str(e.value)


def test_broken_index_and_file_paths_are_clear(ckpt, tmp_path) -> None:
    path = _copy_ckpt(ckpt, tmp_path / "c")
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(psr.CheckpointError, match=r"corrupt shard index .*index\.json"):
        load(path)
    with pytest.raises(psr.CheckpointError, match="is a file, not a folder"):
        load(path / "config.json")
    with pytest.raises(psr.CheckpointError, match="does not exist"):
        load(tmp_path / "nowhere")


def test_offload_refuses_what_it_cannot_offload() -> None:
    with pytest.raises(TypeError, match="needs a transformers causal LM"):
        psr.offload(torch.nn.Linear(2, 2))
    hf = tiny_model("olmoe")
    psr.offload(hf, progress=False)
    with pytest.raises(RuntimeError, match="already offloaded"):
        psr.offload(hf, progress=False)


# --------------------------------------------------------------------------- 7. resources


def test_close_and_the_context_manager_free_the_store(ckpt) -> None:
    gc.collect()  # stores of models dropped by earlier tests
    base = copy_threads()
    with load(ckpt) as model:
        assert copy_threads(base + 1) == base + 1  # the copy worker
        model.generate(PROMPT, 2)
    assert model.closed and copy_threads(base) == base
    with pytest.raises(psr.StoreError, match="closed"):
        model.generate(PROMPT, 2)
    model.close()  # idempotent


def test_dropped_models_free_threads_and_memory_without_the_garbage_collector(ckpt) -> None:
    """30 load / decode / drop cycles with the collector off: no reference cycle keeps a
    model's store (host memory, slab, copy thread) alive."""
    load(ckpt).generate(PROMPT, 2)  # warm caches (tokenizer, transformers modules)
    gc.collect()
    base_threads, base_rss = copy_threads(), rss_bytes() / 2**20
    gc.disable()
    try:
        for _ in range(30):
            model = load(ckpt)
            model.generate(PROMPT, 2)
            del model
            assert copy_threads(base_threads) == base_threads
        grown = rss_bytes() / 2**20 - base_rss
    finally:
        gc.enable()
    print(f"threads {base_threads} -> {copy_threads()}, RSS +{grown:.1f} MiB over 30 cycles")
    assert grown < 40, f"RSS grew {grown:.1f} MiB over 30 cycles"


def test_offloaded_hf_model_frees_its_store_when_dropped() -> None:
    base = copy_threads()
    gc.disable()
    try:
        hf = tiny_model("olmoe")
        om = psr.offload(hf, progress=False)
        store = om.runtime.store
        del om  # the wrapper goes; the transformers model still uses the store
        assert not store.closed and copy_threads(base + 1) == base + 1
        hf.generate(torch.tensor([PROMPT]), max_new_tokens=2, do_sample=False)
        del hf, store
        assert copy_threads(base) == base
    finally:
        gc.enable()


# --------------------------------------------------------------------------- 8. soak


@pytest.mark.slow
def test_soak_2000_decode_steps_with_delays_and_failures(ckpt, monkeypatch) -> None:
    """2,000 decode steps over 25 sequences, random copy delays and an injected failure
    every few sequences (absorbed by retries, and once beyond them): tokens identical to a
    clean run, nothing held, counts that add up."""
    prompts = [[(7 * s + 3 * i) % 64 for i in range(4 + s % 5)] for s in range(25)]
    steps = 80
    clean = load(ckpt)
    want = [clean.generate(p, steps + 1).tolist() for p in prompts]
    monkeypatch.setenv("PSR_COPY_DELAY_US", "300")
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", "11")
    model = load(ckpt, copy_retries=2)
    got, raised = [], 0
    for s, p in enumerate(prompts):
        if s % 4 == 1:
            model.runtime.store.fail_next_copies(2)  # within the retries
        if s == 10:
            # Beyond them: CopyError, then recover. Every copy fails until an acquire gives
            # up (prefill issues its seed copies as one batch per layer, so a few failures
            # would spread over several slots, each absorbed by its retries); the one
            # CopyError names every slot that gave up.
            model.runtime.store.fail_next_copies(1000)
            with pytest.raises(psr.CopyError) as err:
                model.generate(p, steps + 1)
            model.runtime.store.fail_next_copies(0)
            raised += str(err.value).count("; ") + 1
        got.append(model.generate(p, steps + 1).tolist())
    assert got == want
    assert model.stats["tokens"] >= 2000
    c = model.runtime.store.counters()
    assert c["failed_copies"] - c["retried_copies"] == raised
    consistent(model)
