"""psr.load's threads= and context= (issue 42): the thread count reaches torch and psr's
CPU expert kernels and shows in the stats; the context bounds prompts, the graphs' static
cache and the KV bytes; bad values are one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_models import Stubborn, tiny_model, write_checkpoint

import psr
import psr.store
from psr import _C

PROMPT = [5, 17, 33, 2, 9, 41, 12, 60]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("thr") / "olmoe")


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("decode", ["device", "host"])
def test_threads_reach_torch_and_the_cpu_expert_kernels(ckpt, monkeypatch, decode) -> None:
    seen: list[int] = []
    real = _C.cpu_expert_ffn

    def spy(*args):
        seen.append(args[14])  # threads (psr.store's cpu_expert_ffn call)
        return real(*args)

    monkeypatch.setattr(_C, "cpu_expert_ffn", spy)  # the module: wherever psr.store calls it
    setups: list[int] = []
    real_setup = psr.store.ExpertStore.cpu_experts_setup

    def spy_setup(self, *a, **kw):
        setups.append(kw["threads"])
        return real_setup(self, *a, **kw)

    monkeypatch.setattr(psr.store.ExpertStore, "cpu_experts_setup", spy_setup)
    n = len(os.sched_getaffinity(0))  # every CPU: not what the suite's OMP_NUM_THREADS=1 gives
    torch.set_num_threads(1)
    model = psr.load(ckpt, "exact", 0.25, experts_on="cpu", decode=decode, threads=n,
                     progress=False)  # fmt: skip
    assert torch.get_num_threads() == n and model.threads == n
    model.generate(PROMPT, max_new_tokens=4)
    assert model.stats["cpu_experts"] > 0
    assert set(seen + setups) == {n} and seen + setups  # every CPU-experts call took n
    assert model.stats["threads"] == n and "CPU threads" in model.stats.table()
    model.close()


def test_threads_default_and_errors(ckpt, monkeypatch) -> None:
    monkeypatch.setenv("PSR_THREADS", "1")
    with psr.load(ckpt, "exact", 0.5, progress=False) as model:
        assert model.threads == 1 == torch.get_num_threads()
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"^threads={too_many}: only .* CPUs are available"):
        psr.load(ckpt, "exact", 0.5, threads=too_many, progress=False)


def test_context_bounds_prompts_graphs_and_kv(ckpt) -> None:
    with psr.load(ckpt, "exact", 0.5, progress=False) as full:
        assert full.context == 128  # the config's max_position_embeddings
        kv_full = full.memory()["device_kv"]
    model = psr.load(ckpt, "exact", 0.5, context=12, progress=False)
    assert model.context == 12
    assert model.memory()["device_kv"] * 128 == kv_full * 12  # sized by the context
    model.generate(PROMPT, max_new_tokens=4)  # 8 + 4 = 12: fits
    with pytest.raises(ValueError, match=r"^prompt of 8 tokens \+ 5 new exceeds the model's "
                       r"context of 12 tokens$"):  # fmt: skip
        model.generate(PROMPT, max_new_tokens=5)
    from psr.runtime.graphs import bucket

    assert bucket(12, model.context) == 12  # the static cache is capped at the context
    model.close()
    for bad, match in [(129, "exceeds the model's context of 128"), (0, "int >= 1")]:
        with pytest.raises(ValueError, match=match):
            psr.load(ckpt, "exact", 0.5, context=bad, progress=False)


def test_torch_ops_threads_keeps_the_kernels_count() -> None:
    """Inside `torch_ops_threads(1)` torch's ops run on one thread and psr's kernels keep the
    count they had; nested and restored on the way out, also after an error; a count at or
    above torch's changes nothing."""
    from psr.store import cpu_kernels

    n = min(2, len(os.sched_getaffinity(0)))
    torch.set_num_threads(n)
    with cpu_kernels.torch_ops_threads(1):
        assert torch.get_num_threads() == 1 and cpu_kernels.kernel_threads() == n
        with cpu_kernels.torch_ops_threads(1):
            assert torch.get_num_threads() == 1 and cpu_kernels.kernel_threads() == n
        assert cpu_kernels.kernel_threads() == n
    assert torch.get_num_threads() == n == cpu_kernels.kernel_threads()
    with pytest.raises(RuntimeError), cpu_kernels.torch_ops_threads(1):
        raise RuntimeError
    assert torch.get_num_threads() == n == cpu_kernels.kernel_threads()
    with cpu_kernels.torch_ops_threads(n):
        assert torch.get_num_threads() == n
    with cpu_kernels.torch_ops_threads(None):  # None: as they are
        assert torch.get_num_threads() == n == cpu_kernels.kernel_threads()


def test_a_model_decoding_on_the_kernels_keeps_torch_to_one_thread(tmp_path, ckpt, monkeypatch):
    """A GGUF model's decode steps (dense blocks and experts on psr's kernels) run torch's
    own ops on one thread while the kernels take every thread: torch's idle OpenMP workers
    then never spin on the kernels' cores. Same tokens, greedy and sampled; the prompt's
    prefill keeps torch's threads. A float checkpoint (dense layers in torch) keeps them
    throughout, until its forward is row-invariant (RowLinears on the kernels)."""
    from gguf_files import gguf_tiny_model, write_gguf

    from psr.store import cpu_kernels

    n = min(2, len(os.sched_getaffinity(0)))
    path = tmp_path / "olmoe.gguf"
    write_gguf(gguf_tiny_model("olmoe"), path, {"experts": "Q4_K", "dense": "Q8_0"})
    seen: list[tuple[int, int]] = []  # (torch's threads, the kernels') at each dense call
    real = cpu_kernels.LinearPlan.__call__

    def spy(self, x, **kw):
        seen.append((torch.get_num_threads(), cpu_kernels.kernel_threads()))
        return real(self, x, **kw)

    monkeypatch.setattr(cpu_kernels.LinearPlan, "__call__", spy)
    with psr.load(path, "exact", 1.0, device="cpu", threads=n, progress=False) as model:
        assert model.decodes_on_kernels()
        prompt = list(range(3, 40))
        runs = []
        for on in (True, False):
            monkeypatch.setattr(model, "decodes_on_kernels", lambda on=on: on)
            seen.clear()
            greedy = model.generate(prompt, max_new_tokens=6)
            sampled = model.generate(prompt, max_new_tokens=6, do_sample=True, seed=3)
            runs.append((greedy, sampled, list(seen)))
        (g1, s1, seen_on), (g0, s0, seen_off) = runs
        assert torch.equal(g1, g0) and torch.equal(s1, s0)
        assert set(seen_off) == {(n, n)}
        if n > 1:  # decode steps on one torch thread, the prompt's forward on n
            assert (1, n) in seen_on and (n, n) in seen_on
        assert torch.get_num_threads() == n
    with psr.load(ckpt, "exact", 1.0, device="cpu", progress=False) as model:
        assert not model.decodes_on_kernels()  # float nn.Linear layers: torch's work
        model.set_row_invariant(True)
        assert model.decodes_on_kernels()


def test_speculative_verify_blocks_keep_torch_to_one_thread(tmp_path, monkeypatch) -> None:
    """Speculative decoding of a GGUF model: its verify blocks run torch's own ops on one
    thread, the kernels on every thread, as generate's decode steps; the drafter and the
    prompt's prefill keep torch's threads; the same tokens either way."""
    from gguf_files import gguf_tiny_model, write_gguf

    from psr.store import cpu_kernels

    n = min(2, len(os.sched_getaffinity(0)))
    path = tmp_path / "olmoe.gguf"
    write_gguf(gguf_tiny_model("olmoe"), path, {"experts": "Q4_K", "dense": "Q8_0"})
    seen: list[tuple[int, int]] = []
    real = cpu_kernels.LinearPlan.__call__

    def spy(self, x, **kw):
        seen.append((torch.get_num_threads(), cpu_kernels.kernel_threads()))
        return real(self, x, **kw)

    drafted: list[int] = []

    class Drafter(Stubborn):
        def propose(self, tokens, hidden):
            drafted.append(torch.get_num_threads())
            return super().propose(tokens, hidden)

    monkeypatch.setattr(cpu_kernels.LinearPlan, "__call__", spy)
    with psr.load(path, "exact", 1.0, device="cpu", threads=n, progress=False) as model:
        model.set_speculative(Drafter(), verify="cpu")
        prompt = list(range(3, 40))
        runs = []
        for on in (True, False):
            monkeypatch.setattr(model, "decodes_on_kernels", lambda on=on: on)
            seen.clear()
            runs.append((model.generate(prompt, max_new_tokens=8), list(seen)))
        (t1, seen_on), (t0, seen_off) = runs
        assert torch.equal(t1, t0) and model.spec_stats.blocks > 0
        assert set(seen_off) == {(n, n)} and set(drafted) == {n}
        if n > 1:  # verify blocks on one torch thread, the prompt's forward on n
            assert (1, n) in seen_on and (n, n) in seen_on
        assert torch.get_num_threads() == n
