"""`psr demo`, `psr eval`, `psr bench sweep` and `psr tune`: runs of the harness over
policies and residencies, with their reports.

Selection and replication: operating points are chosen on held-out set A (`sweep`,
`tune`) and must hold on held-out set B, which they were not chosen on; the demo and
`psr eval` report on set B by default.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from psr.eval.defaults import (
    BUDGET,
    DEFAULT_PROFILES,
    PROFILE,
    PROMPT_TOKENS,
    SWEEP_LAMS,
    SWEEP_NS,
    TUNE_GEN_TOKENS,
    TUNE_PROMPTS,
    WINDOW_TOKENS,
    WINDOWS,
)
from psr.eval.harness import (
    EvalData,
    RunConfig,
    ScheduleJob,
    add_host_latency,
    compare,
    run_class,
    run_config,
    schedule_prompt,
)
from psr.eval.labels import pareto
from psr.eval.modes import modes_appendix
from psr.eval.report import host_note, markdown_table, save
from psr.eval.search import OutOfTime, Runner, screening, select, walk_together
from psr.eval.search import within as within_budget
from psr.eval.workers import Workers
from psr.models.embedded import DEFAULT_MODEL, heldout_sets, tokenizer_of
from psr.points import operating_points, operating_points_with_source, write_operating_points
from psr.policy import Policy, make_policy, standard_policies


def policy_grid(path: str, residencies: Sequence[float]) -> tuple[list[RunConfig], list[str]]:
    """The four standard policies at each residency at the model's operating points,
    and where those points came from."""
    configs, sources = [], []
    for rho in residencies:
        points, source = operating_points_with_source(path, rho)
        configs += [RunConfig(p, rho) for p in standard_policies(points)]
        sources.append(f"{rho:.1%}: {source}")
    return configs, sources


def grid(
    policies: Sequence[Policy] | None,
    residencies: Sequence[float],
    formats: Sequence[str | None] = (None,),
    model: str | None = None,
) -> list[RunConfig]:
    """Every policy at every residency in every expert format (policies from
    `psr.policy.parse_policies`, or None: the four standard policies at `model`'s
    operating points of each residency); exact in the native format is always included,
    the reference of every comparison."""
    fmts = [None if f in (None, "native") else f for f in formats]
    out = []
    for rho in residencies:
        pols = (
            policies
            if policies is not None
            else standard_policies(operating_points(model or DEFAULT_MODEL, rho))
        )
        configs = [RunConfig(p, rho, f) for f in fmts for p in pols]
        ref = RunConfig(make_policy("exact"), rho)
        out += ([] if ref in configs else [ref]) + configs
    return out


def run_all(
    path: str,
    configs: list[RunConfig],
    data: EvalData,
    desc: str,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    progress: bool = True,
    host: bool = False,
    modes_recorded: bool = False,
    modes_replayed: bool = True,
    workers: Workers | None = None,
) -> list[dict[str, Any]]:
    """Every configuration through `run_config` (on `workers`, default this process; the
    results in `configs`' order; those routed alike through one `run_class`), then
    `compare`. `host`: each one's decode schedule
    measured (measure_schedules) and its latency modeled host-aware too. `modes_recorded`:
    biased policies' cpu / hybrid traces recorded (run_config), for the modes tables;
    `modes_replayed=False`: no input for exact's replayed modes table."""
    workers = workers or Workers()
    # Measured first: in a child process (a CPU without Triton) beside the scoring.
    job = ScheduleJob(path, configs, schedule_prompt(data), progress=progress) if host else None
    # One bar per configuration in this process; with workers, one bar over them all.
    inner = progress and workers.workers == 1
    # Configurations routed alike measured with one forward (run_class), largest first;
    # recorded modes score each configuration's windows again: each alone.
    groups = routing_groups(configs, share=not modes_recorded)
    tasks = [
        (path, [configs[i] for i in g], data, profiles, inner, modes_recorded, modes_replayed)
        for g in groups
    ]
    results: list[dict[str, Any]] = [{} for _ in configs]
    waiting: list[int] = []  # results still without their host-aware latency

    def host_latency(wait: bool) -> None:
        # Modeled as results arrive once the schedules are in (beside the workers' last
        # tasks, not after them); the rest once the workers are done.
        if job is None or not (wait or job.done()):
            return
        schedules = job.result()
        for i in waiting:
            add_host_latency(results[i], schedules[configs[i]], profiles)
        waiting.clear()

    def arrived(k: int, rs: list[dict[str, Any]], bar: Any) -> None:
        bar.update(len(rs))
        for i, r in zip(groups[k], rs, strict=True):
            results[i] = r
        waiting.extend(groups[k])
        host_latency(wait=False)

    try:
        with tqdm(total=len(configs), desc=desc, disable=not progress) as bar:
            workers.map(_run_group, tasks, lambda k, rs: arrived(k, rs, bar))
    except BaseException:
        if job is not None:
            job.cancel()
        raise
    host_latency(wait=True)
    compare(results, profiles)
    return results


def routing_groups(configs: Sequence[RunConfig], share: bool = True) -> list[list[int]]:
    """Indices of `configs` grouped by `RunConfig.routing_class` (None, or `share` False:
    one each), each group in `configs`' order, the groups largest first (then in order)."""
    groups: dict[Any, list[int]] = {}
    for i, rc in enumerate(configs):
        key = rc.routing_class if share and rc.routing_class is not None else ("alone", i)
        groups.setdefault(key, []).append(i)
    return sorted(groups.values(), key=lambda g: (-len(g), g[0]))


def _run_group(
    path: str,
    rcs: list[RunConfig],
    data: EvalData,
    profiles: Sequence[str],
    progress: bool,
    modes_recorded: bool,
    modes_replayed: bool,
) -> list[dict[str, Any]]:
    """run_config, or for configurations routed alike run_class, with run_all's options:
    a worker's task."""
    if len(rcs) > 1:
        return run_class(
            path, rcs, data, profiles, progress=progress, modes_replayed=modes_replayed
        )
    return [
        run_config(
            path,
            rcs[0],
            data,
            profiles,
            progress=progress,
            modes_recorded=modes_recorded,
            modes_replayed=modes_replayed,
        )
    ]


def describe(data: EvalData) -> str:
    """One line: what every configuration was measured on."""
    parts = [
        f"{data.source or 'held-out text'}: {len(data.windows)} windows x "
        f"{data.scored_tokens // max(len(data.windows), 1)} decode-path tokens "
        f"({data.scored_tokens:,} scored tokens per config; misses and modeled latency "
        "from the same stream)"
    ]
    if data.prompts:
        parts.append(f"greedy agreement over {len(data.prompts)} x {data.gen_tokens} tokens")
    if data.cloze:
        parts.append(f"{len(data.cloze):,} cloze items")
    return "; ".join(parts) + "; Δ vs exact with paired BCa 95% intervals over windows/items"


def demo(
    out: str = "psr-results/demo",
    residencies: Sequence[float] = (0.5, 0.25),
    progress: bool = True,
    quick: bool = False,
    workers: Workers | None = None,
) -> list[dict[str, Any]]:
    """The main job: the embedded model under the four policies at 50% and 25% residency,
    at its tuned operating points, plus PSR with int8 expert copies, on held-out set B
    (not used for tuning)."""
    path = DEFAULT_MODEL
    t0 = time.time()
    data = EvalData.from_heldout(
        path,
        "B",
        # Sized to finish in under 3 minutes on one CPU core; `psr eval` is the powered
        # (20,480-token) measurement of the same points.
        windows=4 if quick else 20,
        window_tokens=WINDOW_TOKENS,
        prompt_tokens=PROMPT_TOKENS,
        prompts=2 if quick else 3,
        gen_tokens=16 if quick else 32,
    )
    configs, sources = policy_grid(path, residencies)
    # The best combination: PSR's point with int8 expert copies (half the bytes per copy).
    psr_rows = [rc for rc in configs if rc.policy.name == "psr"]
    for rc in psr_rows:
        configs.insert(configs.index(rc) + 1, RunConfig(rc.policy, rc.residency, "int8"))
    # The table only: the gpu / cpu / hybrid tables are `psr eval`'s (the demo's time).
    results = run_all(
        path,
        configs,
        data,
        "psr demo",
        progress=progress,
        host=True,
        modes_replayed=False,
        workers=workers,
    )
    extra = {"model": path, "data": describe(data), "operating_points": sources}
    paths = save(results, out, "demo", {**extra, "seconds": time.time() - t0})
    print(f"psr demo: embedded model ({path})")
    print(f"measured on {describe(data)}")
    print(f"operating points: {'; '.join(sources)}")
    print("latency modeled for an OLMoE-1B-7B-sized expert, host-free and host-aware\n")
    print(markdown_table(results))
    print(f"\n{host_note(results)}")
    print(f"\n{_ttft(out, ('rtx4090',))}")
    print("\nexperts on gpu / cpu / hybrid and the powered figures: psr eval")
    written = ", ".join(str(v) for v in paths.values())
    print(f"\nwrote {written} ({time.time() - t0:.0f} s)")
    return results


def _ttft(out: str, profiles: tuple[str, ...] = ("rtx4090", "h200")) -> str:
    """The modeled time to first token (psr.eval.ttft, milliseconds to compute), written
    beside the results as ttft.md for every GPU profile; returns `profiles`' table."""
    from psr.eval.ttft import ttft_report

    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "ttft.md").write_text(ttft_report() + "\n")
    return ttft_report(profiles)


def evaluate(
    path: str,
    configs: list[RunConfig],
    out: str,
    *,
    split: str = "B",
    windows: int = WINDOWS,
    cloze: int = 0,
    prompts: int = 4,
    gen_tokens: int = 48,
    progress: bool = True,
    traces: bool = False,
    record_modes: bool = False,
    workers: Workers | None = None,
) -> list[dict[str, Any]]:
    """Quality suite: decode-path likelihood, cloze, greedy agreement, modeled latency.
    `record_modes`: the modes tables of biased policies from recorded cpu / hybrid runs
    (each scores the windows once more per mode), not only exact's replay."""
    data = EvalData.from_heldout(
        path,
        split,
        windows=windows,
        window_tokens=WINDOW_TOKENS,
        prompt_tokens=PROMPT_TOKENS,
        prompts=prompts,
        gen_tokens=gen_tokens,
        cloze=cloze,
    )
    results = run_all(
        path,
        configs,
        data,
        "psr eval",
        progress=progress,
        host=True,
        modes_recorded=record_modes,
        workers=workers,
    )
    appendix = modes_appendix(results, DEFAULT_PROFILES)
    extra = {"model": path, "data": describe(data)}
    paths = save(results, out, "eval", extra, traces=traces, appendix=appendix)
    print(f"measured on {describe(data)}\n")
    print(markdown_table(results))
    print(f"\n{host_note(results)}")
    print(f"\n{_ttft(out)}")
    if appendix:
        print(f"\n{appendix}")
    print(f"\nwrote {', '.join(str(v) for v in paths.values())}")
    return results


def sweep_configs(
    residencies: Sequence[float], lams: Sequence[float], ns: Sequence[int]
) -> list[RunConfig]:
    """exact, exact + prefetch (each n > 0), and Cache-Prior (n = 0) / PSR over lam x n."""
    configs = []
    for rho in residencies:
        configs.append(RunConfig(make_policy("exact"), rho))
        configs += [RunConfig(make_policy("exact-prefetch", n=n), rho) for n in ns if n > 0]
        for lam in lams:
            configs += [
                RunConfig(
                    make_policy("cache-prior", lam) if n == 0 else make_policy("psr", lam, n), rho
                )
                for n in ns
            ]
    return configs


def choose(
    results: list[dict[str, Any]], residency: float, family: str, budget: float, profile: str
) -> list[dict[str, Any]]:
    """A family's results at a residency within budget, fastest first (modeled)."""
    ok = [
        r
        for r in results
        if r["config"]["residency"] == residency
        and r["config"]["policy"] == family
        and within_budget(r, budget)
    ]
    return sorted(ok, key=lambda r: r["latency"][profile]["ms_per_token"])


def sweep(
    path: str,
    out: str,
    residencies: Sequence[float] = (0.5, 0.25),
    lams: Sequence[float] = SWEEP_LAMS,
    ns: Sequence[int] = SWEEP_NS,
    budget: float = BUDGET,
    windows: int = WINDOWS,
    split: str = "A",
    profile: str = PROFILE,
    progress: bool = True,
    window_tokens: int = WINDOW_TOKENS,
    sets: dict[str, tuple[str, str]] | None = None,
    prompts: int = 0,
    workers: Workers | None = None,
) -> dict[str, Any]:
    """lam x n per residency on held-out set `split` (of `sets`, default the model's
    heldout.txt): the Pareto front of modeled latency against Δ nats/token, and per family
    the fastest point whose 95% upper bound is within `budget` (the candidates `tune`
    replicates). `prompts`: greedy generations of `TUNE_GEN_TOKENS` tokens per config for
    greedy agreement with exact (`psr tune`: a few, as on set B)."""
    data = EvalData.from_sets(
        path,
        sets if sets is not None else heldout_sets(path),
        split,
        windows=windows,
        window_tokens=window_tokens,
        prompt_tokens=PROMPT_TOKENS,
        prompts=prompts,
        gen_tokens=TUNE_GEN_TOKENS,
    )
    profiles = tuple(dict.fromkeys([profile, *DEFAULT_PROFILES]))
    configs = sweep_configs(residencies, lams, ns)
    results = run_all(path, configs, data, "psr sweep", profiles, progress, workers=workers)
    return sweep_report(path, out, results, data, residencies, budget, profile)


def sweep_report(
    path: str,
    out: str,
    results: list[dict[str, Any]],
    data: EvalData,
    residencies: Sequence[float],
    budget: float,
    profile: str,
) -> dict[str, Any]:
    """A sweep's results (compared with exact) per residency: the Pareto front and each
    family's points within budget, printed and saved as `out/sweep.{json,md,png}`."""
    profiles = tuple(dict.fromkeys([profile, *DEFAULT_PROFILES]))
    fronts, points = {}, {}
    for rho in residencies:
        rs = [r for r in results if r["config"]["residency"] == rho]
        pts = [
            (r["latency"][profile]["ms_per_token"], r["delta_nll"]["mean"], r["label"]) for r in rs
        ]
        fronts[f"{rho:g}"] = pareto(pts)
        points[f"{rho:g}"] = {
            fam: [r["label"] for r in choose(results, rho, fam, budget, profile)]
            for fam in ("cache-prior", "psr")
        }
    extra = {
        "model": path,
        "data": describe(data),
        "pareto": fronts,
        "budget_nats": budget,
        "within_budget": points,
        "profile": profile,
    }
    paths = save(results, out, "sweep", extra, profiles)
    print(f"measured on {describe(data)}\n")
    print(markdown_table(results, profiles))
    print(f"\nPareto front ({profile}, latency vs Δ nats/token): {json.dumps(fronts, indent=1)}")
    print(f"within budget ({budget} nats/token, 95% upper bound), fastest first: {points}")
    print(f"wrote {', '.join(str(v) for v in paths.values())}")
    extra["results"] = results
    return extra


def load_selection(file: str | Path, path: str, residencies: Sequence[float]) -> dict[str, Any]:
    """An earlier `psr sweep`/`psr tune` selection (`sweep.json`) checked for reuse: measured
    on a set A of the same model, at every residency in `residencies` (check_selection_set:
    on the same set A)."""
    try:
        sel: dict[str, Any] = json.loads(Path(file).read_text())
        results, data = sel["results"], sel["data"]
        have = {float(r["config"]["residency"]) for r in results}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--select-from {file}: not a readable sweep.json ({e})") from None
    if Path(sel.get("model", "")).resolve() != Path(path).resolve():
        raise ValueError(f"--select-from {file}: measured on {sel.get('model')}, not {path}")
    if "set A" not in str(data):
        raise ValueError(f"--select-from {file}: not measured on a set A ({data})")
    missing = [f"{rho:g}" for rho in residencies if rho not in have]
    if missing:
        raise ValueError(f"--select-from {file}: no results at residency {', '.join(missing)}")
    return sel


def check_selection_set(sel: dict[str, Any], file: str | Path, set_a: str) -> None:
    """A reused selection was measured on set A as described by `set_a` (the same text, split
    the same way), not on another text."""
    if not str(sel["data"]).startswith(f"{set_a}:"):
        raise ValueError(f"--select-from {file}: not measured on {set_a} ({sel['data']})")


def tuning_sets(
    path: str,
    text: str | Path | None,
    budget: float,
    windows: int,
    window_tokens: int = WINDOW_TOKENS,
) -> tuple[dict[str, tuple[str, str]], int]:
    """The selection and replication sets `tune` measures on (the user's `text`, else the
    model's heldout.txt), and the windows per configuration: at most `windows`, and enough
    for the budget (psr.eval.text.check_sets), else a one-line error saying how many
    tokens the text has and how many the budget needs."""
    from psr.eval.text import EmptyText, check_sets, needs, text_sets

    if text is not None:
        from psr.models.sources import has_tokenizer

        if not has_tokenizer(path):
            raise ValueError(f"--text: {path} has no tokenizer to read the text with")
        try:
            sets, source = text_sets(text), f"--text {text}"
        except EmptyText as e:
            raise EmptyText(f"{e}; {needs(budget, window_tokens, PROMPT_TOKENS)}") from None
        tok = tokenizer_of(path)
    else:
        tok, sets, source = tokenizer_of(path), heldout_sets(path), f"{path}/heldout.txt"
    used = check_sets(tok, sets, source, budget, windows, window_tokens, PROMPT_TOKENS)
    return sets, used


def interval_note(results: list[dict[str, Any]], budget: float, tokens: int) -> str | None:
    """When the 95% intervals on set A of the points that could be chosen (mean Δ within the
    budget) are wider than the budget, a line saying so and how many more tokens per set
    would narrow them below it (the width falls as 1 / sqrt(tokens)); else None."""
    widths = [
        r["delta_nll"]["hi"] - r["delta_nll"]["lo"]
        for r in results
        if r["config"]["policy"] in ("cache-prior", "psr")
        and r.get("delta_nll", {}).get("mean", math.inf) <= budget
    ]
    if not widths or max(widths) <= budget:
        return None
    w = max(widths)
    more = math.ceil(tokens * ((w / budget) ** 2 - 1))
    return (
        f"the 95% intervals on set A are up to {w:.4f} nats/token wide, wider than the "
        f"{budget:g} budget, so points near it are kept only when clearly inside: about "
        f"{more:,} more decode-path tokens per set would narrow them below it"
    )


def _replicate(
    run: Callable[[Sequence[RunConfig]], list[dict[str, Any]]],
    sel: dict[str, Any],
    residencies: Sequence[float],
    budget: float,
    profile: str,
    chosen: dict[str, dict[str, Policy]],
    log: list[dict[str, Any]],
    replicated: list[dict[str, Any]],
) -> None:
    """Per residency and family, set A's fastest candidates within budget measured on set B
    (`run`: configurations' results there), fastest first, until one is within budget
    there too (the walks together: psr.eval.search.walk_together), filling `chosen` (the
    points), `log` and `replicated` (results, per residency exact and then each family's
    candidates). A family with none is left out: no point is written that was not
    measured to hold."""
    profiles = tuple(dict.fromkeys([profile, *DEFAULT_PROFILES]))
    at, fams, walks = [], [], []
    for k, rho in enumerate(residencies):
        for fam in ("cache-prior", "psr"):
            cands = choose(sel["results"], rho, fam, budget, profile)[:3]
            at.append(k)
            fams.append(fam)
            walks.append(
                [(c, make_policy(fam, c["config"]["lam"], c["config"]["n"])) for c in cands]
            )

    def ok(w: int, rb: dict[str, Any], exact_b: list[dict[str, Any]]) -> bool:
        compare([exact_b[at[w]], rb], profiles)
        return within_budget(rb, budget)

    exact_b: list[dict[str, Any]] = []
    got: list[list[dict[str, Any]]] = []
    exacts = [RunConfig(make_policy("exact"), rho) for rho in residencies]
    rcs = [[RunConfig(pol, residencies[at[w]]) for _, pol in walk] for w, walk in enumerate(walks)]
    walk_together(run, exacts, rcs, ok, exact_b, got)
    for k, rho in enumerate(residencies):
        replicated.append(exact_b[k])
        chosen[f"{rho:g}"] = {}
        for w in (w for w in range(len(walks)) if at[w] == k):
            for (cand, pol), rb in zip(walks[w], got[w], strict=False):
                replicated.append(rb)
                log.append(_replication_row(rho, pol, cand, rb, budget, profile))
                if log[-1]["replicated"]:
                    chosen[f"{rho:g}"][fams[w]] = pol


def _replication_row(
    rho: float, pol: Policy, cand: dict[str, Any], rb: dict[str, Any], budget: float, profile: str
) -> dict[str, Any]:
    """A candidate's line in the replication log: set A's figures beside set B's."""
    return {
        "residency": rho,
        "policy": pol.describe(),
        "A": cand["delta_nll"],
        "B": rb["delta_nll"],
        "speedup_A": cand["speedup"][profile],
        "speedup_B": rb["speedup"][profile],
        # how far the routing moved: routed experts outside the exact top-k
        "substitution_rate_A": cand["stats"].get("substitution_rate"),
        "substitution_rate_B": rb["stats"]["substitution_rate"],
        "greedy_agreement_A": cand.get("greedy_agreement"),
        "greedy_agreement_B": rb.get("greedy_agreement"),
        "replicated": within_budget(rb, budget),
    }


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.3f}"


def tune(
    path: str,
    out: str,
    residencies: Sequence[float] = (0.5, 0.375, 0.25),
    budget: float = BUDGET,
    profile: str = PROFILE,
    lams: Sequence[float] = SWEEP_LAMS,
    ns: Sequence[int] = SWEEP_NS,
    windows: int = WINDOWS,
    write: str | None = None,
    progress: bool = True,
    window_tokens: int = WINDOW_TOKENS,
    select_from: str | None = None,
    text: str | Path | None = None,
    max_minutes: float | None = None,
    workers: Workers | None = None,
) -> dict[str, Any]:
    """Operating points per residency: select on set A (the fastest Cache-Prior and PSR
    point whose quality cost's 95% upper bound is within `budget`, modeled on `profile`),
    then replicate on set B: a point is kept only if it is within budget there too; else
    the next-fastest candidate from A is tried (a family with none gets no point). The sets
    are the user's `text` (psr.eval.text) or the model's heldout.txt, with enough tokens
    for the budget. Writes the points to the user's folder, keyed by the checkpoint
    (psr.points.model_key), or to `write`, for `psr.load` to use.

    Selection screens `lams` coarse to fine on a few of set A's windows per residency and n
    and measures the finalists on all of them (psr.eval.search); every
    configuration's result is saved under `out/runs/` as it completes and read back by a
    re-run with the same arguments, which resumes an interrupted tune (`select_from`: the
    `sweep.json` of an earlier selection, to replicate only). `max_minutes`: no
    configuration starts after that many minutes; the tune then reports the best points so
    far, marked as such, writes none, and a re-run resumes."""
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    profiles = tuple(dict.fromkeys([profile, *DEFAULT_PROFILES]))
    runner = Runner(path, f"{out}/runs", profiles, deadline, progress, workers)
    if select_from is not None:
        sel = load_selection(select_from, path, residencies)
    sets, windows = tuning_sets(path, text, budget, windows, window_tokens)
    if select_from is not None:
        check_selection_set(sel, select_from, sets["A"][0])
    else:
        data_a = _tuning_data(path, sets, "A", windows, window_tokens)
        sel, stopped = _select_on_a(
            path, out, runner, data_a, residencies, lams, ns, budget, profile
        )
        if stopped is not None:
            return stopped
    note = interval_note(sel["results"], budget, windows * (window_tokens - PROMPT_TOKENS))
    data_b = _tuning_data(path, sets, "B", windows, window_tokens)
    chosen: dict[str, dict[str, Policy]] = {}
    log: list[dict[str, Any]] = []
    replicated: list[dict[str, Any]] = []
    try:
        _replicate(
            lambda rcs: runner.many(rcs, data_b, "B"),
            sel, residencies, budget, profile, chosen, log, replicated,
        )  # fmt: skip
    except OutOfTime:
        return _stopped(sel["results"], residencies, budget, profile, runner, "replicating on B")
    meta = {
        "budget_nats": budget,
        "profile": profile,
        "selected_on": sel["data"],
        "replicated_on": describe(data_b),
        "replication": log,
        "interval_note": note,
        "source": "psr tune",
    }
    written = write_operating_points(path, chosen, meta, write)
    save(replicated, f"{out}/replicate", "replicate", {"model": path, **meta}, profiles)
    _print_points(log, chosen, budget, profile, note)
    print(
        f"configurations: {runner.measured} measured, {runner.reused} read back from "
        f"{runner.folder}"
    )
    print(f"wrote {written} (psr.load uses it for {path})")
    counts = {"measured": runner.measured, "reused": runner.reused}
    return {"points": chosen, "file": str(written), "complete": True, **counts, **meta}


def _tuning_data(
    path: str, sets: dict[str, tuple[str, str]], split: str, windows: int, window_tokens: int
) -> EvalData:
    """What `tune` measures on set `split`: the windows, and a few greedy prompts for the
    agreement beside Δ nats/token in the tables."""
    return EvalData.from_sets(
        path,
        sets,
        split,
        windows=windows,
        window_tokens=window_tokens,
        prompt_tokens=PROMPT_TOKENS,
        prompts=TUNE_PROMPTS,
        gen_tokens=TUNE_GEN_TOKENS,
    )


def _select_on_a(
    path: str,
    out: str,
    runner: Runner,
    data_a: EvalData,
    residencies: Sequence[float],
    lams: Sequence[float],
    ns: Sequence[int],
    budget: float,
    profile: str,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Set A's selection (psr.eval.search.select), reported as `out/select/sweep.*`:
    (the sweep report, None), or at the deadline ({}, the best points so far)."""
    profiles = tuple(dict.fromkeys([profile, *DEFAULT_PROFILES]))
    screen_a = screening(data_a)
    results, finished = select(
        lambda rcs: runner.many(rcs, data_a, "A"),
        lambda rcs: runner.many(rcs, screen_a, "A-screen"),
        residencies, lams, ns, budget, profiles,
    )  # fmt: skip
    if not finished:
        return {}, _stopped(results, residencies, budget, profile, runner, "selecting on set A")
    return sweep_report(path, f"{out}/select", results, data_a, residencies, budget, profile), None


def _print_points(
    log: list[dict[str, Any]],
    chosen: dict[str, dict[str, Policy]],
    budget: float,
    profile: str,
    note: str | None,
) -> None:
    """The replication's lines (each candidate on A and B, kept or not), the families left
    without a point and why, and the intervals' note."""
    print(
        f"\noperating points (selected on A, replicated on B, budget {budget} nats/token; "
        f"speedups modeled host-free on {profile}):"
    )
    for row in log:
        print(
            f"  {row['residency']:.1%} {row['policy']:<22} A: {row['A']['mean']:+.4f} "
            f"[{row['A']['lo']:+.4f}, {row['A']['hi']:+.4f}] {row['speedup_A']:.2f}x "
            f"subst. {_rate(row['substitution_rate_A'])} "
            f"greedy {_rate(row.get('greedy_agreement_A'))} | "
            f"B: {row['B']['mean']:+.4f} [{row['B']['lo']:+.4f}, {row['B']['hi']:+.4f}] "
            f"{row['speedup_B']:.2f}x subst. {_rate(row['substitution_rate_B'])} "
            f"greedy {_rate(row['greedy_agreement_B'])}  "
            f"{'kept' if row['replicated'] else 'not replicated'}"
        )
    for rho, fams in chosen.items():
        for fam in sorted({"cache-prior", "psr"} - set(fams)):
            tried = any(
                f"{r['residency']:g}" == rho and r["policy"].startswith(fam + "(") for r in log
            )
            why = "none of set A's candidates held on set B" if tried else "no candidate on set A"
            print(f"  {float(rho):.1%} {fam}: {why} within budget; no point written")
    if note:
        print(f"note: {note}")


def _stopped(
    results: list[dict[str, Any]],
    residencies: Sequence[float],
    budget: float,
    profile: str,
    runner: Runner,
    stage: str,
) -> dict[str, Any]:
    """The tune's end at its deadline: per residency and family the fastest point within
    budget on set A so far, printed as such; no points file is written."""
    best: dict[str, dict[str, Policy]] = {}
    print(
        f"\nstopped at --max-minutes while {stage}: {runner.measured} configurations "
        f"measured, {runner.reused} read back, saved in {runner.folder}"
    )
    print(f"best so far (set A, budget {budget} nats/token; NOT replicated on set B):")
    for rho in residencies:
        best[f"{rho:g}"] = {}
        for fam in ("cache-prior", "psr"):
            ok = choose(results, rho, fam, budget, profile)
            if not ok:
                print(f"  {rho:.1%} {fam}: none within budget so far")
                continue
            r = ok[0]
            best[f"{rho:g}"][fam] = make_policy(fam, r["config"]["lam"], r["config"]["n"])
            d = r["delta_nll"]
            print(
                f"  {rho:.1%} {r['label']:<22} A: {d['mean']:+.4f} [{d['lo']:+.4f}, "
                f"{d['hi']:+.4f}] {r['speedup'][profile]:.2f}x  (best so far)"
            )
    print("no points written: run the same command again to resume from the saved results")
    counts = {"measured": runner.measured, "reused": runner.reused}
    return {"points": best, "file": None, "complete": False, "stage": stage, **counts}


def speculative(
    path: str,
    out: str,
    residencies: Sequence[float] = (0.5, 0.25),
    windows: int = WINDOWS,
    prompts: int = 16,
    gen_tokens: int = 64,
    block: int = 4,
    specs: Sequence[Any] | None = None,
    progress: bool = True,
    drafters: Sequence[str] = ("block", "ar"),
    block_ks: Sequence[int] | None = None,
    lams: Sequence[float] = (0.0, 0.2),
    cpu_copies: Sequence[int] = (),
    n: int = 1,
) -> list[dict[str, Any]]:
    """Speculative decoding (both drafters; verify='budget' over a K_b x lam grid,
    verify='cpu:M' over `cpu_copies` x lam) against the autoregressive policies at equal
    device memory, on held-out set B; writes speculative.{md,json}."""
    from psr.eval.spec_compare import compare_speculative, default_specs, markdown
    from psr.models.loader import load

    data = EvalData.from_heldout(
        path,
        "B",
        windows=windows,
        window_tokens=WINDOW_TOKENS,
        prompt_tokens=PROMPT_TOKENS,
        prompts=prompts,
        gen_tokens=gen_tokens,
    )
    if specs is None:
        probe = load(path, "exact", 1.0, progress=False)
        k = probe.runtime.spec.top_k
        specs = default_specs(k, block, drafters, block_ks, lams, cpu_copies, n)
        probe.close()
    rows = compare_speculative(path, residencies, specs, data, progress=progress)
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k not in ("generated",)} for r in rows]
    table = markdown(rows)
    (o / "speculative.json").write_text(
        json.dumps({"model": path, "data": describe(data), "rows": slim}, indent=1)
    )
    (o / "speculative.md").write_text(f"measured on {describe(data)}\n\n{table}\n")
    print(f"measured on {describe(data)}\n\n{table}")
    print(f"\nwrote {o / 'speculative.md'}, {o / 'speculative.json'}")
    return rows
