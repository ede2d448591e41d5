"""Configurations routed alike measured with one forward (psr.eval.shared, harness.run_class):
every figure bit for bit what separate runs give."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

from psr.eval.harness import EvalData, RunConfig, run_class, run_config
from psr.eval.runs import routing_groups
from psr.policy import make_policy

TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York. "
    "And all the clouds that lowr'd upon our house in the deep bosom of the ocean buried. "
) * 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("sh") / "olmoe")
    write_tokenizer(path)
    return path


def _comparable(r: dict) -> dict:
    """A result with its trace as JSON (Trace objects compare by identity of nothing else)."""
    return {**r, "trace": r["trace"].to_json()}


def test_run_class_equals_separate_runs(ckpt) -> None:
    from transformers import AutoTokenizer

    data = EvalData.from_text(
        AutoTokenizer.from_pretrained(ckpt),
        TEXT,
        prompts=1,
        prompt_tokens=10,
        gen_tokens=4,
        windows=2,
        window_tokens=24,
        cloze=1,
    )
    exact, pre1, pre2 = (
        make_policy("exact-prefetch", n=n) if n else make_policy("exact") for n in (0, 1, 2)
    )
    configs = [
        RunConfig(exact, 0.5),
        RunConfig(pre1, 0.5),
        RunConfig(exact, 0.25),
        RunConfig(pre2, 0.25),
    ]
    shared = run_class(str(ckpt), configs, data)
    alone = [run_config(str(ckpt), rc, data) for rc in configs]
    for s, a in zip(shared, alone, strict=True):
        assert "routing" not in s
        assert _comparable(s) == _comparable(a), s["label"]
    # The replays did what the test is about: capacities differ and prefetches were counted.
    assert len({s["stats"]["misses"] for s in shared}) > 1
    assert shared[3]["stats"]["prefetches"] > 0 and shared[0]["stats"]["prefetches"] == 0
    assert shared[2]["mode_starts"] == alone[2]["mode_starts"]  # exact's modes replay input


def test_routing_classes_from_the_policies() -> None:
    exact, pre = make_policy("exact"), make_policy("exact-prefetch", n=1)
    psr, cp = make_policy("psr", 0.1, 2), make_policy("cache-prior", 0.1)
    assert not exact.routes_by_cache and not pre.routes_by_cache
    assert psr.routes_by_cache and cp.routes_by_cache
    assert not make_policy("psr", 0.0, 2).routes_by_cache  # lam 0: the exact top-k
    configs = [
        RunConfig(exact, 0.5),
        RunConfig(pre, 0.5),
        RunConfig(cp, 0.5),
        RunConfig(psr, 0.5),
        RunConfig(psr, 0.5, "int8"),
        RunConfig(exact, 0.25),
        RunConfig(exact, 0.25, "int8"),
        RunConfig(pre, 0.25, "int8"),
    ]
    assert routing_groups(configs) == [[0, 1, 5], [6, 7], [2], [3], [4]]
    assert routing_groups(configs, share=False) == [[i] for i in range(8)]
    with pytest.raises(ValueError, match="one routing class"):
        run_class("unused", configs[:3], EvalData([], 1))
