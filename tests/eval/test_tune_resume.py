"""`psr tune`'s search (issue 42): coarse to fine over lam, every result saved as it
completes, an interrupted tune resumed to the same points as one run, --max-minutes ending
with the best point so far, and progress lines off a terminal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

import psr.eval.search as search
from psr.eval.harness import EvalData
from psr.eval.runs import choose, tune
from psr.eval.search import coarse_indices, next_index, screening, select
from psr.policy import make_policy

TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York. "
    "And all the clouds that lowr'd upon our house in the deep bosom of the ocean buried. "
) * 12


def each(fn):
    """select's batch form of a one-configuration function."""
    return lambda rcs: [fn(rc) for rc in rcs]


def test_screening_keeps_a_noisy_good_lam_and_measures_only_finalists_in_full() -> None:
    """Synthetic results (Δ nats rising with lam, latency falling). Screening (40 items of
    ±0.03 noise around a cost overestimated by 0.008) screens 6 of 9 lams coarse to fine;
    lam 0.2, whose screening mean is above the budget but whose interval's lower end is
    not, is kept, measured in full (no noise) and chosen: the grid's largest lam within
    budget, as the full grid gives. Only exact and that finalist are measured in full."""
    grid = [0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]
    screened: list[float] = []
    full: list[float] = []

    def fake(rc, noisy: bool):
        lam = rc.policy.lam or 0.0
        (screened if noisy else full).append(lam)
        cost = 0.0 if rc.policy.name == "exact" else lam / 10  # within 0.025: lam <= 0.2
        if noisy:
            items = [1.0 + (cost and cost + 0.008) + (-1) ** k * 0.03 for k in range(40)]
        else:
            items = [1.0 + cost] * 4
        return {
            "config": rc.as_dict(),
            "label": rc.label,
            "latency": {"rtx4090": {"ms_per_token": 10 - lam}},
            "generated": [],
            "nll_items": items if rc.policy.name != "exact" else [1.0] * len(items),
            "cloze_items": [],
        }

    kept: dict[float, dict] = {}

    def screen(rc):
        r = fake(rc, True)
        kept[rc.policy.lam or 0.0] = r
        return r

    results, finished = select(
        each(lambda rc: fake(rc, False)), each(screen), [0.5], grid, [0], 0.025, ["rtx4090"]
    )
    assert finished and screened == [0.0, 0.01, 0.15, 1.0, 0.3, 0.2]  # exact, coarse, bisect
    assert full == [0.0, 0.2]  # exact and the one finalist
    assert kept[0.2]["delta_nll"]["mean"] > 0.025 >= kept[0.2]["delta_nll"]["lo"]
    assert kept[0.3]["delta_nll"]["lo"] > 0.025  # dropped: clearly above the budget
    assert choose(results, 0.5, "cache-prior", 0.025, "rtx4090")[0]["config"]["lam"] == 0.2
    assert coarse_indices(9) == [0, 4, 8] and coarse_indices(2) == [0, 1]
    assert next_index({0: False}, 9) is None  # nothing within budget: nothing to refine
    assert next_index({0: True, 4: True, 8: True}, 9) is None  # all of it within budget
    assert next_index({0: True, 4: False, 8: False}, 9) == 2


def test_finalists_step_down_until_one_is_within_the_budget() -> None:
    """Screening keeps lams up to 0.3 but in full only 0.1 is within: 0.3, 0.2, 0.1 are
    measured in full, in that order, and 0.1 is chosen."""
    full: list[float] = []

    def fake(rc, cost_per_lam: float):
        lam = rc.policy.lam or 0.0
        if cost_per_lam == 0.05:
            full.append(lam)
        cost = 0.0 if rc.policy.name == "exact" else lam * cost_per_lam
        return {
            "config": rc.as_dict(),
            "label": rc.label,
            "latency": {"rtx4090": {"ms_per_token": 10 - lam}},
            "generated": [],
            "nll_items": [1.0 + cost] * 4,
            "cloze_items": [],
        }

    grid = [0.1, 0.2, 0.3, 0.5]
    results, finished = select(
        each(lambda rc: fake(rc, 0.05)),
        each(lambda rc: fake(rc, 0.015)),
        [0.5],
        grid,
        [0],
        0.006,
        ["rtx4090"],
    )
    assert finished and full == [0.0, 0.3, 0.2, 0.1]
    assert choose(results, 0.5, "cache-prior", 0.006, "rtx4090")[0]["config"]["lam"] == 0.1


def test_psr_finalists_are_measured_fastest_first_across_n() -> None:
    """PSR's n = 1 and n = 2 are one family: its candidates are measured in full fastest
    first (by their screened latency), whichever n, and the first within the budget ends
    the walk; n = 1's lams, slower here, are screened but never measured in full. Cache-
    Prior (n = 0) walks on its own. The points are those of the full grid: each family's
    fastest within budget."""
    full: list[tuple[int, float]] = []

    def fake(rc, screen: bool):
        lam, n = rc.policy.lam or 0.0, rc.policy.n or 0
        if not screen:
            full.append((n, lam))
        cost = 0.0 if rc.policy.name == "exact" else lam * (0.05 if screen else 0.06)
        return {
            "config": rc.as_dict(),
            "label": rc.label,
            "latency": {"rtx4090": {"ms_per_token": 10 - lam - n}},
            "generated": [],
            "nll_items": [1.0 + cost] * 4,
            "cloze_items": [],
        }

    grid = [0.05, 0.1, 0.2, 0.3]
    results, finished = select(
        each(lambda rc: fake(rc, False)), each(lambda rc: fake(rc, True)), [0.5], grid, [0, 1, 2],
        0.0125,
        ["rtx4090"],
    )  # fmt: skip
    # screening keeps lam <= 0.2 (0.05 x 0.2 = 0.01); in full only lam <= 0.2 holds (0.012)
    assert finished and full == [(0, 0.0), (0, 0.2), (2, 0.2)]
    for fam, n in (("cache-prior", 0), ("psr", 2)):
        best = choose(results, 0.5, fam, 0.0125, "rtx4090")[0]["config"]
        assert (best["lam"], best["n"] or 0) == (0.2, n)


def test_screening_takes_an_evenly_spread_eighth_of_the_windows_without_prompts() -> None:
    data = EvalData(
        windows=[[i] * 3 for i in range(160)], prompt_len=1, prompts=[[1]], gen_tokens=4
    )
    s = screening(data)
    assert (
        [w[0] for w in s.windows] == list(range(0, 160, 8))
        and s.prompts == []
        and s.gen_tokens == 0
    )
    assert len(screening(EvalData(windows=[[1, 2]] * 5, prompt_len=1)).windows) == 5  # at least 8


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
    # A screened: exact, both lams; A in full: exact and the finalist lam 3; B: 2.
    assert one["complete"] and (one["measured"], one["reused"]) == (7, 0)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("psr tune: ")]
    assert len(lines) == 7 and lines[0].startswith("psr tune: set A-screen 50.0% exact: measured")

    real, calls = search.run_config, []

    def interrupted(*a, **kw):
        if len(calls) == 5:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(search, "run_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tune(ckpt, tmp_path / "two")
    monkeypatch.setattr(search, "run_config", real)
    saved = sorted(p.name for p in (tmp_path / "two" / "runs").iterdir())
    assert saved == [
        "A-0.5-exact.json",
        "A-0.5-psr_lam=3_n=1_.json",
        "A-screen-0.5-exact.json",
        "A-screen-0.5-psr_lam=0.01_n=1_.json",
        "A-screen-0.5-psr_lam=3_n=1_.json",
    ]

    # --max-minutes spent: the saved results are read, nothing new starts, the best point
    # so far is reported as such and no points are written.
    capsys.readouterr()
    stopped = _tune(ckpt, tmp_path / "two", max_minutes=1e-9)
    assert not stopped["complete"] and (stopped["measured"], stopped["reused"]) == (0, 5)
    assert stopped["points"] == {"0.5": {"psr": make_policy("psr", 3.0, 1)}}
    assert not (tmp_path / "two" / "p.json").exists()
    out = capsys.readouterr().out
    assert "stopped at --max-minutes while replicating on B" in out
    assert "psr(lam=3, n=1)" in out and "(best so far)" in out

    resumed = _tune(ckpt, tmp_path / "two")
    assert resumed["complete"] and (resumed["measured"], resumed["reused"]) == (2, 5)
    assert resumed["points"] == one["points"] and resumed["replication"] == one["replication"]
    points = [json.loads((tmp_path / d / "p.json").read_text())["points"] for d in ("one", "two")]
    assert points[0] == points[1]
