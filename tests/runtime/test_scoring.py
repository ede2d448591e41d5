"""OffloadedModel.score (a teacher-forced window in one forward) against decode_logits
(token by token): the same routing, counts, per-token records and trace, and logits equal
to floating-point rounding, for every family and policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, KV_KWARG, bench_module, tiny_model, write_checkpoint

import psr
from psr.runtime.kv import output_cache
from psr.runtime.verify import BudgetSet

AheadTwo = bench_module("variants").AheadTwo  # a steering variant beyond the spec

IDS = torch.tensor([[(7 * i + 3) % 64 for i in range(60)]])
KEYS = ("routed", "hits", "misses", "prefetches", "prefetch_used", "copies", "bytes_copied")
POLICIES = [
    ("exact", {}),
    ("exact-prefetch", {"n": 1}),
    ("cache-prior", {"lam": 0.5}),
    ("psr", {"lam": 0.5, "n": 2}),
]
KV = KV_KWARG  # the KV-cache keyword of the installed transformers


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("score")
    return {f: write_checkpoint(tiny_model(f), root / f) for f in FAMILIES}


def _run(path: Path, policy: str, kw: dict, how: str, prompt_len: int = 16, ahead2: int = 0):
    model = psr.load(path, policy, 0.5, progress=False, **kw)
    if ahead2:
        model.runtime.set_steering(AheadTwo(model.runtime, ahead2))
    rec = model.record_trace()
    if how == "score":
        logits = model.score(IDS, prompt_len)
    else:
        logits = model.decode_logits(IDS, prompt_len)
    per_token = [{k: r[k] for k in KEYS} for r in model.stats.per_token]
    return logits, rec.trace.to_json(), per_token, model


@pytest.mark.parametrize(("policy", "kw"), POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_score_equals_token_by_token_decoding(ckpts, family, policy, kw) -> None:
    la, ta, pa, a = _run(ckpts[family], policy, kw, "decode")
    lb, tb, pb, b = _run(ckpts[family], policy, kw, "score")
    assert tb == ta  # every routed id, hit, copy (slot, expert, kind) and read, in order
    assert pb == pa
    assert b.stats["tokens"] == a.stats["tokens"] == IDS.shape[1] - 16
    assert b.stats["prefill_tokens"] == 16
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_two_ahead_prefetch_scores_as_it_decodes(ckpts, family) -> None:
    """The experimental two-layers-ahead variant (bench/variants.py's AheadTwo steering): a
    window's queued
    predictions from two issuers reach each layer in decode order, traced at their issuer."""
    kw = {"lam": 0.5, "n": 1}
    la, ta, pa, _ = _run(ckpts[family], "psr", kw, "decode", ahead2=2)
    lb, tb, pb, _ = _run(ckpts[family], "psr", kw, "score", ahead2=2)
    assert tb == ta and pb == pa
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=2e-5)
    # It does what it says: layer 0 now issues prefetch copies into layer 2 (MoE index).
    into = {(s["layer"], c["layer"]) for tok in ta["tokens"] for s in tok for c in s["copies"]}
    # (issuing layer, written layer): misses, next-layer and two-ahead prefetches.
    assert {t - s for s, t in into} == {0, 1, 2} and (0, 2) in into
    _, t1, p1, _ = _run(ckpts[family], "psr", kw, "score")
    assert (0, 2) not in {
        (s["layer"], c["layer"]) for tok in t1["tokens"] for s in tok for c in s["copies"]
    }
    assert sum(r["prefetches"] for r in pa) > sum(r["prefetches"] for r in p1)
    model = psr.load(ckpts[family], "psr", 0.5, progress=False, **kw)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="ahead2 must be an int >= 0"):
            AheadTwo(model.runtime, bad)
    model.runtime.set_steering(AheadTwo(model.runtime, 1))
    with pytest.raises(ValueError, match="block mode steers by the spec's rule only"):
        model.runtime.set_block_mode(BudgetSet(model.runtime.spec.top_k))


def test_scoring_issues_no_copies_and_leaves_the_model_usable(ckpts) -> None:
    path = ckpts["olmoe"]
    model = psr.load(path, "psr", 0.5, lam=0.5, n=2, progress=False)
    before = model.runtime.store.counters()["copies"]
    model.score(IDS, 8)
    assert model.runtime.store.counters()["copies"] == before
    fresh = psr.load(path, "psr", 0.5, lam=0.5, n=2, progress=False)
    prompt = IDS[0, :12].tolist()
    assert model.generate(prompt, 8).tolist() == fresh.generate(prompt, 8).tolist()
    # A scored window cannot be continued as a sequence.
    with pytest.raises(RuntimeError, match="never began"):
        model.hf(input_ids=IDS[:, :1], use_cache=True, **{KV: _nonempty_cache(model)})


def _nonempty_cache(model):
    out = model.hf(input_ids=IDS[:, :4], use_cache=True)
    model.runtime.end_scoring()  # forget that sequence's owner, as after a scored window
    return output_cache(out)


def test_scoring_refuses_a_timing_dependent_policy(ckpts) -> None:
    model = psr.load(ckpts["olmoe"], "cache-prior-async", 0.5, progress=False)
    with pytest.raises(ValueError, match="logical-cache policy"):
        model.score(IDS, 8)
    with pytest.raises(ValueError, match=r"prompt_len must be in \[1, 60\]"):
        psr.load(ckpts["olmoe"], "psr", 0.5, progress=False).score(IDS, 61)
