"""The substitution count: routed experts that are not in the layer's own exact (unbiased)
top-k. The kernel's count against its reference and an independent set difference; 0 for
the exact policies; rising with lam; equal between the decode steps and the compute paths;
shown in the stats table, the trace (old traces still load) and the server's metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
import psr_kernels as pk
from psr.runtime.trace import Trace

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
SPECS = [
    pk.RouteSpec(4, lam=0.5),
    pk.RouteSpec(3, lam=0.3, scoring="topk_softmax"),
    pk.RouteSpec(4, lam=0.4, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.scoring}-g{s.n_group}")
def test_kernel_count_equals_reference_and_set_difference(spec) -> None:
    g = torch.Generator().manual_seed(spec.top_k)
    T, E = 6, 16
    logits = torch.randn(T, E, generator=g)
    mask = torch.rand(T, E, generator=g) < 0.5
    bias = torch.randn(E, generator=g) * 0.1 if spec.scoring == "sigmoid" else None
    w, ids, sub = pk.route_counted(logits, spec, mask=mask, bias=bias)
    w_r, ids_r, sub_r = pk.route_counted_ref(logits, spec, mask=mask, bias=bias)
    assert torch.equal(ids, ids_r) and torch.equal(sub, sub_r) and sub.dtype == torch.int32
    torch.testing.assert_close(w, w_r)
    # the same ids and weights as `route`, and the count is the plain set difference with
    # the same router's exact routing (lam 0)
    w0, ids0 = pk.route(logits, spec, mask=mask, bias=bias)
    assert torch.equal(ids0, ids) and torch.equal(w0, w)
    _, exact = pk.route_ref(logits, dataclasses.replace(spec, lam=0.0), bias=bias)
    want = [len(set(a) - set(b)) for a, b in zip(ids.tolist(), exact.tolist(), strict=True)]
    assert sub.tolist() == want and sum(want) > 0
    # without a mask (nothing biases) and at lam 0: nothing substituted
    assert pk.route_counted(logits, spec, bias=bias)[2].tolist() == [0] * T
    lam0 = dataclasses.replace(spec, lam=0.0)
    assert pk.route_counted(logits, lam0, mask=mask, bias=bias)[2].tolist() == [0] * T


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("subst") / "olmoe")


def _counts(model: psr.OffloadedModel) -> tuple[float, float]:
    return model.stats["substituted"], model.stats["routed"]


def test_rate_is_zero_for_exact_and_rises_with_lam(ckpt) -> None:
    """Teacher-forced on one fixed sequence, so every policy sees the same tokens."""
    ids = torch.cat([PROMPT, PROMPT.flip(1), PROMPT.roll(3, 1)], dim=1)
    m = psr.load(ckpt, "exact", 0.5, progress=False)
    rates = {}
    for policy, lam, n in [("exact", None, None), ("exact-prefetch", None, 1)]:
        m.configure(policy, 0.5, lam=lam, n=n)
        m.reset_stats()
        m.score(ids, PROMPT.shape[1])
        assert _counts(m)[0] == 0 and _counts(m)[1] > 0
    for lam in (0.0, 0.05, 0.3, 1.0, 5.0):
        m.configure("psr", 0.5, lam=lam, n=1)
        m.reset_stats()
        m.score(ids, PROMPT.shape[1])
        sub, routed = _counts(m)
        assert m.stats["substitution_rate"] == sub / routed
        rates[lam] = m.stats["substitution_rate"]
    assert rates[0.0] == 0.0 and rates[5.0] > 0.1
    assert list(rates.values()) == sorted(rates.values()), rates


def test_equal_between_decode_steps_and_compute_paths(ckpt) -> None:
    """The device step's on-device counter, the host step's and a scored window's are the
    same count, per token too; the Triton kernel's (interpreter) equals the reference's."""
    got = {}
    for decode, compute in [("host", "torch"), ("device", "torch"), ("device", "triton")]:
        m = psr.load(ckpt, "psr", 0.5, lam=0.6, n=1, decode=decode, compute=compute, progress=False)
        tokens = m.generate(PROMPT, max_new_tokens=6)
        rows = [r["substituted"] for r in m.stats.per_token]
        got[decode, compute] = (tokens.tolist(), _counts(m), rows)
        # teacher-forced token by token, and the same tokens scored in one forward
        m.reset_stats()
        m.decode_logits(tokens, PROMPT.shape[1])
        forced = _counts(m)
        m.reset_stats()
        m.score(tokens, PROMPT.shape[1])
        assert _counts(m) == forced and forced[0] > 0
    first = got["host", "torch"]
    assert first[1][0] > 0 and sum(first[2]) == first[1][0]
    assert all(v == first for v in got.values()), got


def test_shown_in_table_trace_and_metrics(ckpt, tmp_path) -> None:
    m = psr.load(ckpt, "psr", 0.5, lam=0.6, n=1, decode="host", progress=False)
    rec = m.record_trace()
    m.generate(PROMPT, max_new_tokens=5)
    s = m.stats
    assert s["substituted"] > 0
    assert f"{s['substituted']:.0f} ({s['substitution_rate']:.3f} of routed)" in s.table()
    assert "substitution_rate" in s.report() and "substituted" in s.report()
    # the trace keeps it per token and layer, and its sum is the stats' count
    assert rec.trace.counts()["substituted"] == s["substituted"]
    path = tmp_path / "trace.json"
    rec.trace.save(path)
    assert Trace.load(path).counts() == rec.trace.counts()
    # a trace written before the count existed loads, with 0
    old = json.loads(path.read_text())
    for tok in old["tokens"]:
        for step in tok:
            del step["substituted"]
    path.write_text(json.dumps(old))
    assert Trace.load(path).counts()["substituted"] == 0
