"""The embedded default model and `psr demo` (the README's main job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import psr
from psr.cli import main


def test_default_model_is_an_ordinary_checkpoint() -> None:
    path = Path(psr.DEFAULT_MODEL)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "heldout.txt"):
        assert (path / f).is_file(), f
    cfg = json.loads((path / "config.json").read_text())
    # Shaped like OLMoE-1B-7B's routing: 64 experts, top-8, softmax without renormalising.
    assert cfg["model_type"] == "olmoe" and cfg["num_experts"] == 64
    assert cfg["num_experts_per_tok"] == 8 and cfg["norm_topk_prob"] is False
    assert 8 <= cfg["num_hidden_layers"] <= 12
    assert (path / "model.safetensors").stat().st_size < 16e6  # ships at 16 MB or less
    for drafter in ("drafter_block.safetensors", "drafter_ar/model.safetensors"):
        assert (path / drafter).is_file(), drafter
    info = json.loads((path / "train_info.json").read_text())
    assert info["heldout_loss"] < 4.5  # trained, not random (ln 2048 = 7.6)
    # The held-out spans cut heldout.txt into whole plays (sets A and B).
    text = (path / "heldout.txt").read_text(encoding="utf-8")
    for play, (a, b) in info["heldout_spans"].items():
        assert play.split("_")[0].upper() in text[a : a + 200].upper()
        assert b <= len(text) and text[b : b + 2] in ("", "\n\n")
    model = psr.load(psr.DEFAULT_MODEL, "psr", residency=0.5, dtype="float32", progress=False)
    ids = model.tokenizer("ROMEO. Good morrow, father.")["input_ids"]
    out = model.generate(ids, 8)
    assert out.shape[1] == len(ids) + 8


@pytest.mark.slow
def test_demo_quick_prints_the_table_and_writes_results(tmp_path, capsys) -> None:
    assert main(["demo", "--quick", "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for label in ("exact", "exact-prefetch(n=1)", "cache-prior(lam=", "psr(lam=", "+ int8"):
        assert label in out
    assert "operating points:" in out and "paired BCa 95% intervals" in out
    # The graph figure beside the eager one; the gpu / cpu / hybrid tables are psr eval's.
    assert "ms/tok (graph)" in out and "first decode token" in out
    assert "Experts on gpu / cpu / hybrid" not in out and "hybrid and the powered" in out
    res = json.loads((tmp_path / "demo.json").read_text())["results"]
    assert len(res) == 10 and (tmp_path / "demo.png").stat().st_size > 1000
    by = {
        (r["config"]["residency"], r["config"]["policy"], r["config"]["expert_format"]): r
        for r in res
    }
    for rho in (0.5, 0.25):
        exact, steer = by[rho, "exact", None], by[rho, "psr", None]
        int8 = by[rho, "psr", "int8"]
        assert steer["stats"]["misses"] < exact["stats"]["misses"]
        assert steer["speedup"]["rtx4090"] > 1.0
        # Same routing policy, half the bytes per copy: faster than PSR alone.
        assert int8["speedup"]["rtx4090"] > steer["speedup"]["rtx4090"]
        assert by[rho, "exact-prefetch", None]["greedy_agreement"] == 1.0
