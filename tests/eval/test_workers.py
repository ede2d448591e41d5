"""Configurations measured in worker processes (psr.eval.workers; issues 40, 42): the same
results, in the same order, whatever the worker count."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

from psr.cli import main
from psr.eval.harness import EvalData, RunConfig
from psr.eval.runs import run_all, tune
from psr.eval.workers import Workers, check_workers
from psr.machine import allowed_cpus
from psr.policy import make_policy

TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York. "
    "And all the clouds that lowr'd upon our house in the deep bosom of the ocean buried. "
) * 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("wk") / "olmoe")
    write_tokenizer(path)
    (path / "heldout.txt").write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def two() -> Workers:
    with Workers(2, 1) as w:  # one pool for the module: spawning costs seconds
        yield w


def test_run_all_on_two_workers_gives_the_serial_results_in_order(ckpt, two) -> None:
    from transformers import AutoTokenizer

    data = EvalData.from_text(
        AutoTokenizer.from_pretrained(ckpt),
        TEXT,
        prompts=1,
        prompt_tokens=16,
        gen_tokens=6,
        windows=2,
        window_tokens=40,
    )
    configs = [
        RunConfig(p, rho)
        for rho in (0.5, 0.25)
        for p in (make_policy("exact"), make_policy("psr", 0.8, 1))
    ]
    one = run_all(str(ckpt), configs, data, "t", progress=False)
    both = run_all(str(ckpt), configs, data, "t", progress=False, workers=two)
    assert [r["label"] for r in both] == [rc.label for rc in configs]
    assert both == one  # counts, traces, likelihoods, generations and comparisons alike
    assert one[1]["stats"]["misses"] < one[0]["stats"]["misses"]  # a real, differing run


def test_tune_on_two_workers_gives_the_points_of_one(ckpt, tmp_path, two) -> None:
    kw = {"budget": 1.0, "lams": [0.01, 3.0], "ns": [0, 1], "windows": 2}
    runs = {
        name: tune(str(ckpt), str(tmp_path / name), [0.5], progress=False,
                   write=str(tmp_path / name / "p.json"), window_tokens=64, workers=w, **kw)
        for name, w in (("one", None), ("two", two))
    }  # fmt: skip
    one, both = runs["one"], runs["two"]
    assert one["complete"] and both["complete"] and one["measured"] == both["measured"]
    assert both["points"] == one["points"] and both["replication"] == one["replication"]
    assert one["points"]["0.5"]  # points were chosen, not an empty agreement
    for f in ("select/sweep.md", "replicate/replicate.md", "p.json"):
        texts = [(tmp_path / name / f).read_text().replace(name, "X") for name in runs]
        assert texts[0] == texts[1], f


def test_a_worker_count_beyond_the_cpus_is_a_one_line_error(capsys, tmp_path) -> None:
    too_many = len(allowed_cpus()) + 1
    with pytest.raises(ValueError, match=f"workers={too_many}: only"):
        check_workers(too_many)
    with pytest.raises(ValueError, match="workers=0"):
        check_workers(0)
    with pytest.raises(SystemExit) as e:
        main(["demo", "--workers", str(too_many), "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--workers {too_many}: only" in err[0]
