"""The whole decode token as one graph (psr.runtime.graphs), proved on the CPU: the decode
forward over a static KV cache traces whole (no graph break) under every logical-cache
policy and expert format, compiles with torch.compile(fullgraph=True) (inductor), and gives
the eager tokens and counts; the host reads each new token once; graphs say when they are
not used, and why."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint
from torch.overrides import TorchFunctionMode

import psr
from psr.eval.host_probe import READS
from psr.runtime.graphs import MAX_GRAPHS, DecodeGraph, bucket

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
COUNTS = ("tokens", "routed", "hits", "misses", "prefetches", "prefetch_used", "copies")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("graphs") / "olmoe")


def _load(path: Path, policy: str, **kw) -> psr.OffloadedModel:
    return psr.load(path, policy, 0.5, progress=False, dtype="float32", **kw)


# Each policy and each expert format compiled once (an inductor compile is 20-40 s on the
# CPU), the copy delay on psr (its misses and prefetches both copied late). A compile
# with fullgraph=True fails on any graph break, so these pairs trace whole there; the
# other policy x format pairs are traced by test_the_decode_forward_traces_whole.
COMPILED = [  # (policy, policy kwargs, expert format, copy delay in µs)
    ("psr", {"lam": 0.5, "n": 2}, "native", 3000),
    ("exact", {}, "int8", 0),
    ("cache-prior", {"lam": 0.5}, "int8", 0),
]
POLICY_FORMATS = [
    (policy, kw, fmt)
    for policy, kw in [("exact", {}), ("cache-prior", {"lam": 0.5}), ("psr", {"lam": 0.5, "n": 2})]
    for fmt in ("native", "int8")
    if (policy, fmt) not in {(p, f) for p, _, f, _ in COMPILED}
]


@pytest.mark.parametrize(
    ("policy", "kw", "fmt"), POLICY_FORMATS, ids=[f"{p}-{f}" for p, _, f in POLICY_FORMATS]
)
def test_the_decode_forward_traces_whole(ckpt, policy, kw, fmt) -> None:
    """torch._dynamo.explain of a decode forward with the device step live: one graph, no
    break (a host read, an untraceable call or Python state read from the device would
    each break it)."""
    model = _load(ckpt, policy, expert_format=fmt, **kw)
    graph = DecodeGraph(model.hf, model.runtime, 32)
    with torch.no_grad(), model.runtime.lock:
        logits = graph.prefill(PROMPT)
        nxt = logits.argmax(-1).view(1, 1)
        logits = graph.step(nxt, PROMPT.shape[1])  # eager: hands the caches over
        nxt = logits.argmax(-1).view(1, 1)
        graph.tok.copy_(nxt)
        graph.pos.fill_(PROMPT.shape[1] + 1)
        explained = torch._dynamo.explain(lambda: graph._eager(graph.tok, graph.pos))()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
        b.reason for b in explained.break_reasons
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "kw", "fmt", "delay_us"),
    COMPILED,
    ids=[f"{p}-{f}" + (f"-delay{d}us" if d else "") for p, _, f, d in COMPILED],
)
def test_graphs_on_the_cpu_give_the_eager_tokens_and_counts(
    ckpt, monkeypatch, policy, kw, fmt, delay_us
) -> None:
    """graphs=True on the CPU: inductor compiles the decode forward (fullgraph) once per
    static-cache length; greedy and seeded sampling give eager's tokens, and the counts
    are eager's, also when every copy is delayed (the store's worker sleeps
    PSR_COPY_DELAY_US before each: copy timing changes, the output must not)."""
    eager = _load(ckpt, policy, expert_format=fmt, **kw)
    monkeypatch.setenv("PSR_COPY_DELAY_US", str(delay_us))
    graphed = _load(ckpt, policy, expert_format=fmt, graphs=True, **kw)
    for m in (eager, graphed):
        m.greedy = m.generate(PROMPT, max_new_tokens=10)
        m.sampled = m.generate(PROMPT, max_new_tokens=12, do_sample=True, top_k=20, seed=7)
    assert eager.graph_status.startswith("off") and graphed.graph_status.startswith("on")
    assert graphed.greedy.tolist() == eager.greedy.tolist()
    assert graphed.sampled.tolist() == eager.sampled.tolist()
    assert {k: graphed.stats[k] for k in COUNTS} == {k: eager.stats[k] for k in COUNTS}
    assert graphed.stats["captures"] == 1 and eager.stats["captures"] == 0  # reused
    if delay_us:  # the delay was felt: the graphed model waited for its copies
        assert graphed.stats["stall_s"] > eager.stats["stall_s"]


@contextmanager
def _uncompiled():
    """torch.compile as the identity: the graph path (static cache, capture bookkeeping,
    replay) runs the eager forward, in seconds rather than an inductor compile."""
    with mock.patch.object(torch, "compile", lambda fn=None, **kw: fn):
        yield


def test_a_capture_is_kept_per_length(ckpt, monkeypatch) -> None:
    """Requests of mixed lengths capture once per static-cache length, not once per
    switch; beyond MAX_GRAPHS lengths the least recently used one is dropped."""
    with _uncompiled():
        model = _load(ckpt, "psr", lam=0.5, n=2, graphs=True)
        captures = []
        for new in (4, 60, 4, 60, 4):  # 16, 72, ... tokens: static caches of 64 and 128
            model.generate(PROMPT, max_new_tokens=new)
            captures.append(model.stats["captures"])
        assert captures == [1, 2, 2, 2, 2]
        assert list(model._graphs) == [128, 64]  # least recently used first
        assert MAX_GRAPHS >= 2  # (the tiny model's context of 128 has only these two)
        monkeypatch.setattr("psr.runtime.model.MAX_GRAPHS", 1)
        for new in (60, 4, 60):  # one kept: each switch drops the other and captures
            model.generate(PROMPT, max_new_tokens=new)
            captures.append(model.stats["captures"])
        assert captures[5:] == [2, 3, 4] and list(model._graphs) == [128]


def _reads(model: psr.OffloadedModel, new: int) -> int:
    """Host reads of tensor data during one generate call."""
    n = 0

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            nonlocal n
            n += getattr(func, "__name__", "") in READS
            return func(*args, **(kwargs or {}))

    with Count():
        model.generate(PROMPT, max_new_tokens=new)
    return n


@pytest.mark.parametrize("sample", [False, True])
def test_the_host_reads_each_new_token_once(ckpt, sample) -> None:
    """Every read beyond a call's fixed cost (prefill, the hand-over to the device step,
    the counts at its end) is the loop's read of the new token: one per token."""
    model = _load(ckpt, "psr", lam=0.5, n=2)
    if sample:
        model.generate = (  # type: ignore[method-assign]
            lambda ids, max_new_tokens, g=model.generate: g(
                ids, max_new_tokens=max_new_tokens, do_sample=True, seed=1
            )
        )
    _reads(model, 2)  # so each measured call also retires a previous sequence
    short, long = _reads(model, 4), _reads(model, 12)
    assert long - short == 12 - 4


def test_the_host_reads_each_new_token_once_with_graphs(ckpt) -> None:
    """The same on the graph path (static cache, replays; the forward left uncompiled)."""
    with _uncompiled():
        model = _load(ckpt, "psr", lam=0.5, n=2, graphs=True)
        _reads(model, 2)
        short, long = _reads(model, 4), _reads(model, 12)
    assert model.graph_status == "on (static cache of 64 tokens)"
    assert model.stats["captures"] == 1  # the same capture replayed by all three calls
    assert long - short == 12 - 4


def test_graphs_say_why_they_are_off(ckpt) -> None:
    model = _load(ckpt, "psr", lam=0.5, n=2, graphs=True, decode="host")
    model.generate(PROMPT, max_new_tokens=2)
    assert model.graph_status == "off: decode='host' (graphs need the device decode step)"
    model = _load(ckpt, "cache-prior-async", lam=0.5, n=2, graphs=True)
    model.generate(PROMPT, max_new_tokens=2)
    assert model.graph_status.startswith("off: cache-prior-async reads copy timing")
    model = _load(ckpt, "psr", lam=0.5, n=2)  # auto: off on the CPU
    model.generate(PROMPT, max_new_tokens=2)
    assert model.graph_status == "off (graphs='auto': on for CUDA only)"
    model = _load(ckpt, "psr", lam=0.5, n=2, graphs=False)
    model.generate(PROMPT, max_new_tokens=2)
    assert model.graph_status == "off (graphs=False)"
    with pytest.raises(ValueError, match="graphs must be True, False or 'auto'; got 'yes'"):
        _load(ckpt, "psr", graphs="yes")


def test_a_model_without_a_static_cache_decodes_eagerly_and_says_why(ckpt, monkeypatch) -> None:
    """A family whose cache transformers cannot make static: graphs off with the reason,
    the eager device step's tokens."""
    import transformers

    want = _load(ckpt, "psr", lam=0.5, n=2, graphs=False).generate(PROMPT, max_new_tokens=3)

    def no_static(*args, **kwargs):
        raise ValueError("no static layer for linear attention")

    monkeypatch.setattr(transformers, "StaticCache", no_static)
    model = _load(ckpt, "psr", lam=0.5, n=2, graphs=True)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=3), want)
    assert model.graph_status == (
        "off: no static KV cache for this model (no static layer for linear attention)"
    )


def test_static_cache_lengths_come_in_buckets() -> None:
    assert [bucket(n, None) for n in (1, 64, 65, 200, 1000)] == [64, 64, 128, 256, 1024]
    assert bucket(300, 256) == 300 and bucket(100, 4096) == 128  # the context caps, not cuts
