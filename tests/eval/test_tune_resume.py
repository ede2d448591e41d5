"""`psr tune`'s search (issue 42): coarse to fine over lam, every result saved as it
completes, an interrupted tune resumed to the same points as one run, --max-minutes ending
with the best point so far, and progress lines off a terminal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

import psr.eval.search as search
from psr.eval.runs import choose, tune
from psr.eval.search import coarse_indices, next_index, select
from psr.policy import make_policy

TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York. "
    "And all the clouds that lowr'd upon our house in the deep bosom of the ocean buried. "
) * 12


def test_coarse_then_bisection_finds_the_largest_lam_within_budget() -> None:
    """Synthetic results (Δ nats rising with lam, latency falling): 5 of 9 lams measured,
    and the choice is the grid's largest lam within budget, as the full grid gives."""
    grid = [0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]
    runs: list[float] = []

    def fake(rc):
        lam = rc.policy.lam or 0.0
        runs.append(lam)
        cost = 0.0 if rc.policy.name == "exact" else lam / 10  # within 0.025: lam <= 0.2
        return {
            "config": rc.as_dict(),
            "label": rc.label,
            "latency": {"rtx4090": {"ms_per_token": 10 - lam}},
            "generated": [],
            "nll_items": [1.0 + cost] * 4,
            "cloze_items": [],
        }

    results, finished = select(fake, [0.5], grid, [0], 0.025, ["rtx4090"])
    assert finished and runs == [0.0, 0.01, 0.15, 1.0, 0.3, 0.2]  # exact, coarse, bisect
    assert choose(results, 0.5, "cache-prior", 0.025, "rtx4090")[0]["config"]["lam"] == 0.2
    assert coarse_indices(9) == [0, 4, 8] and coarse_indices(2) == [0, 1]
    assert next_index({0: False}, 9) is None  # nothing within budget: nothing to refine
    assert next_index({0: True, 4: True, 8: True}, 9) is None  # all of it within budget
    assert next_index({0: True, 4: False, 8: False}, 9) == 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("tr") / "olmoe")
    write_tokenizer(path)
    (path / "heldout.txt").write_text(TEXT)
    return path


def _tune(ckpt: Path, out: Path, **kw):
    kw |= {"budget": 1.0, "lams": [0.01, 3.0], "ns": [1], "windows": 2, "window_tokens": 64}
    return tune(str(ckpt), str(out), [0.5], progress=False, write=str(out / "p.json"), **kw)


def test_an_interrupted_tune_resumes_to_the_points_of_one_run(ckpt, tmp_path, capsys, monkeypatch):
    one = _tune(ckpt, tmp_path / "one")
    assert one["complete"] and (one["measured"], one["reused"]) == (5, 0)  # A: 3, B: 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("psr tune: ")]
    assert len(lines) == 5 and lines[0].startswith("psr tune: set A 50.0% exact: measured in")

    real, calls = search.run_config, []

    def interrupted(*a, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(search, "run_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tune(ckpt, tmp_path / "two")
    monkeypatch.setattr(search, "run_config", real)
    saved = sorted(p.name for p in (tmp_path / "two" / "runs").iterdir())
    assert saved == ["A-0.5-exact.json", "A-0.5-psr_lam=0.01_n=1_.json"]

    # --max-minutes spent: the saved results are read, nothing new starts, the best point
    # so far is reported as such and no points are written.
    capsys.readouterr()
    stopped = _tune(ckpt, tmp_path / "two", max_minutes=1e-9)
    assert not stopped["complete"] and (stopped["measured"], stopped["reused"]) == (0, 2)
    assert stopped["points"] == {"0.5": {"psr": make_policy("psr", 0.01, 1)}}
    assert not (tmp_path / "two" / "p.json").exists()
    out = capsys.readouterr().out
    assert "stopped at --max-minutes while selecting on set A" in out
    assert "psr(lam=0.01, n=1)" in out and "(best so far)" in out

    resumed = _tune(ckpt, tmp_path / "two")
    assert resumed["complete"] and (resumed["measured"], resumed["reused"]) == (3, 2)
    assert resumed["points"] == one["points"] and resumed["replication"] == one["replication"]
    points = [json.loads((tmp_path / d / "p.json").read_text())["points"] for d in ("one", "two")]
    assert points[0] == points[1]
