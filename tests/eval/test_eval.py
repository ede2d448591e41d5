"""Quality harness pieces and evaluation runs on a tiny checkpoint (lm_eval: test_lm_eval.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

from psr.eval.harness import EvalData, RunConfig, compare, run_class, run_config
from psr.eval.labels import pareto
from psr.eval.quality import chunks, cloze_items, greedy_agreement, paired_bootstrap
from psr.eval.report import save
from psr.eval.runs import routing_groups
from psr.policy import make_policy

TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York. "
    "And all the clouds that lowr'd upon our house in the deep bosom of the ocean buried. "
) * 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("ev") / "olmoe")
    write_tokenizer(path)
    (path / "heldout.txt").write_text(TEXT)
    return path


def test_paired_bootstrap_against_known_differences() -> None:
    ref = [0.0] * 50
    assert paired_bootstrap([1.0] * 50, ref).as_dict() == {
        "mean": 1.0,
        "lo": 1.0,
        "hi": 1.0,
        "n": 50,
    }
    pol = [float(i % 2) for i in range(50)]  # differences 0/1: mean 0.5
    c = paired_bootstrap(pol, ref, iters=4000, seed=1)
    assert c.mean == pytest.approx(0.5)
    assert 0.3 < c.lo < 0.5 < c.hi < 0.7  # normal approx: 0.5 +- 1.96 * 0.5 / sqrt(50)
    # Pairing: a constant offset on noisy items has a tight interval.
    noisy = [float(i * 37 % 11) for i in range(40)]
    c = paired_bootstrap([x + 0.1 for x in noisy], noisy)
    assert c.lo == pytest.approx(0.1) and c.hi == pytest.approx(0.1)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_bootstrap([1.0], [1.0, 2.0])


def test_greedy_agreement_and_first_divergence() -> None:
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 2)
    assert greedy_agreement([1, 2], [1, 2]) == (1.0, 2)


def test_chunks_and_cloze_items() -> None:
    ids = list(range(1000))
    w = chunks(ids, 100, 5)
    assert len(w) == 5 and all(len(x) == 100 for x in w)
    assert len({x[0] for x in w}) == 5  # non-overlapping
    items = cloze_items(ids, 3, context=20, cont=5, distractors=3)
    assert len(items) == 3
    for it in items:
        true = it.choices[it.answer]
        assert true[0] == it.context[-1] + 1  # the real continuation
        assert sum(c[0] == it.context[-1] + 1 for c in it.choices) == 1
    with pytest.raises(ValueError, match="shorter than one chunk"):
        chunks(ids[:10], 20, 1)


def test_pareto_front() -> None:
    pts = [(1.0, 0.5, "a"), (2.0, 0.1, "b"), (1.5, 0.6, "c"), (3.0, 0.0, "d"), (2.5, 0.2, "e")]
    assert pareto(pts) == ["a", "b", "d"]


def test_runs_compare_and_save(ckpt, tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    data = EvalData.from_text(
        tok, TEXT, prompts=2, prompt_tokens=16, gen_tokens=8, windows=3, window_tokens=40, cloze=2
    )
    res = [
        run_config(str(ckpt), RunConfig(make_policy("exact"), 0.5), data),
        run_config(str(ckpt), RunConfig(make_policy("psr", 0.8, 1), 0.5), data),
    ]
    compare(res)
    ex, ps = res
    assert ex["greedy_agreement"] == 1.0 and ex["speedup"]["rtx4090"] == 1.0
    assert ex["delta_nll"]["mean"] == 0.0
    assert len(ps["nll_items"]) == 3 and len(ps["cloze_items"]) == 2
    # Counts and the modeled latency come from the scored (likelihood) stream itself.
    assert ps["stats"]["tokens"] == data.scored_tokens == 3 * (40 - 16)
    assert ps["latency"]["rtx4090"]["tokens"] == data.scored_tokens
    assert ps["stats"]["misses"] < ex["stats"]["misses"]  # lam=0.8 steers toward the cache
    # Speedup is the ratio of the two modeled latencies.
    assert ps["speedup"]["h200"] == pytest.approx(
        ex["latency"]["h200"]["ms_per_token"] / ps["latency"]["h200"]["ms_per_token"]
    )
    paths = save(res, tmp_path, "t")
    assert paths["png"].stat().st_size > 1000
    md = paths["md"].read_text()
    assert "psr(lam=0.8, n=1)" in md and "Δ nats/tok" in md
    assert json.loads(paths["json"].read_text())["results"][1]["label"] == "psr(lam=0.8, n=1)"
    assert "trace" not in json.loads(paths["json"].read_text())["results"][1]
    # With traces kept, the saved trace replays to the same modeled latency.
    from psr.eval.latency import simulate
    from psr.runtime.trace import Trace

    saved = json.loads(save(res, tmp_path / "tr", "t", traces=True)["json"].read_text())
    back = Trace.from_json(saved["results"][1]["trace"])
    assert simulate(back, "rtx4090").as_dict() == ps["latency"]["rtx4090"]


def test_tune_selects_on_a_replicates_on_b_and_load_uses_the_points(ckpt, tmp_path) -> None:
    import psr
    from psr.eval.runs import tune
    from psr.points import operating_points_with_source, user_points_file

    res = tune(
        str(ckpt),
        str(tmp_path),
        residencies=[0.5],
        budget=10.0,  # everything fits: the fastest candidate on A must be kept
        lams=[0.3, 1.0],
        ns=[0, 1],
        windows=2,
        window_tokens=64,
        progress=False,
    )
    log = res["replication"]
    assert [row["replicated"] for row in log] == [True, True]
    # beside Δ nats: how far the routing moved (lam >= 0.3 substitutes) and greedy agreement
    assert all(0 < row["substitution_rate_B"] <= 1 for row in log)
    assert all(row["substitution_rate_A"] > 0 for row in log)
    assert all(0 <= row["greedy_agreement_B"] <= 1 for row in log)
    assert all(0 <= row["greedy_agreement_A"] <= 1 for row in log)  # set A's table has it
    sweep_json = json.loads((tmp_path / "select" / "sweep.json").read_text())
    exact_a = next(r for r in sweep_json["results"] if r["config"]["policy"] == "exact")
    assert len(exact_a["generated"]) == 2  # TUNE_PROMPTS greedy generations per config
    assert all(0 <= r["greedy_agreement"] <= 1 for r in sweep_json["results"])
    fastest = {}
    for r in sweep_json["results"]:
        fam = r["config"]["policy"]
        if fam in ("cache-prior", "psr"):
            ms = r["latency"]["rtx4090"]["ms_per_token"]
            if fam not in fastest or ms < fastest[fam][0]:
                fastest[fam] = (ms, r["label"])
    assert {fam: p.describe() for fam, p in res["points"]["0.5"].items()} == {
        fam: label for fam, (_, label) in fastest.items()
    }
    f = Path(res["file"])
    assert f == user_points_file(ckpt) and f.is_file()  # the user's folder (PSR_HOME here)
    assert not (ckpt / "operating_points.json").exists()  # the model folder is never written
    points, source = operating_points_with_source(ckpt, 0.5)
    assert source == str(f) and points == res["points"]["0.5"]
    model = psr.load(ckpt, "psr", residency=0.5, progress=False)
    assert model.policy == res["points"]["0.5"]["psr"] and model.policy_source == f"tuned ({f})"
    assert psr.load(ckpt, "psr", residency=0.5, lam=0.1, progress=False).policy.lam == 0.1
    # quality_budget: the tuned point when tuned for that budget or a tighter one.
    tight = psr.load(ckpt, "psr", residency=0.5, quality_budget=12.0, progress=False)
    assert tight.policy == res["points"]["0.5"]["psr"]
    with pytest.raises(ValueError, match=r"tuned for a budget of 10 nats/token, above the 0\.5"):
        psr.load(ckpt, "psr", residency=0.5, quality_budget=0.5, progress=False)
    with pytest.raises(ValueError, match=r"no operating point .* at residency 0\.25"):
        psr.load(ckpt, "psr", residency=0.25, quality_budget=0.5, progress=False)
    with pytest.raises(ValueError, match="chooses lam and n"):
        psr.load(ckpt, "psr", residency=0.5, lam=0.1, quality_budget=0.5, progress=False)
    with pytest.raises(ValueError, match="applies to 'cache-prior' or 'psr', not 'exact'"):
        psr.load(ckpt, "exact", residency=0.5, quality_budget=0.5, progress=False)
    from psr.points import resolve_policy

    with pytest.raises(ValueError, match="needs the model folder and residency"):
        resolve_policy("psr", quality_budget=0.5)  # never silently the defaults

    # Resuming from the saved selection replicates again and picks the same points.
    again = tune(
        str(ckpt),
        str(tmp_path / "again"),
        residencies=[0.5],
        budget=10.0,
        lams=[0.3, 1.0],
        ns=[0, 1],
        windows=2,
        window_tokens=64,
        progress=False,
        write=str(tmp_path / "again.json"),
        select_from=str(tmp_path / "select" / "sweep.json"),
    )
    assert again["points"] == res["points"] and not (tmp_path / "again" / "select").exists()
    with pytest.raises(ValueError, match=r"no results at residency 0\.25"):
        tune(str(ckpt), str(tmp_path), [0.25], select_from=str(tmp_path / "select/sweep.json"))
    with pytest.raises(ValueError, match="measured on"):
        tune(str(tmp_path), str(tmp_path), [0.5], select_from=str(tmp_path / "select/sweep.json"))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"not a readable sweep\.json"):
        tune(str(ckpt), str(tmp_path), [0.5], select_from=str(tmp_path / "bad.json"))


def test_tuned_points_are_never_written_into_the_package(ckpt) -> None:
    import psr.points as P

    pkg_file = Path(P.__file__).parent / "models" / "x.json"
    with pytest.raises(ValueError, match="inside the installed psr package"):
        P.write_operating_points(ckpt, {}, {}, pkg_file)


# --- configurations routed alike: one forward (psr.eval.shared, harness.run_class) ---


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
