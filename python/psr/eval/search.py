"""`psr tune`'s search (issue 42): lams screened on a few windows of set A, the finalists
measured on all of them, each configuration's result saved as it completes, a deadline.

* **Screening, coarse to fine.** Per residency and n, three lams of the grid first (its
  ends and middle), then bisection on the grid between the highest lam that *could* be
  within the budget and the next one screened above it, until they are neighbours; each
  screened on 1/8 of set A's windows (`screening`, evenly spread, no greedy prompts: about
  1/8 of a configuration's cost). A lam could be within the budget unless the lower end of
  its screening 95% interval is above the budget. Guarantee: a lam whose true Δ nats is
  within the budget is dropped with probability at most 2.5% (the interval's one-sided
  error), so noise on the few windows does not drop a good candidate but rarely; lams
  whose cost is clearly above the budget are never measured in full. The 2.5% is
  nominal: a bootstrap interval over few windows (the items) is narrower than its
  coverage says, so the real rate is somewhat higher at SCREEN_LEAST windows.
* **Finalists, fastest first.** Per residency and family (Cache-Prior: n = 0; PSR: every
  n > 0 together), the candidates are each n's lams from the highest that screening kept
  downward, ranked by their screened modeled latency (`finalists`); they are measured on
  all of set A's windows in that order until one is within the budget (the 95% upper
  bound, as before), which is the family's point. With quality cost rising in lam and
  the screened latency ranking the candidates as the full one does, this is the point
  the full search over set A finds, unless screening dropped it (the 2.5% above); a
  family's slower n is not measured in full once a faster candidate is within budget
  (one walk per family, not one per n), and set B replicates it as before.
* **Saved results.** Each configuration's result is a JSON file under the run folder as
  soon as it is measured, keyed by the checkpoint (psr.points.model_key), the data it was
  measured on and the configuration; a re-run with the same arguments reads them instead
  of measuring again, so an interrupted tune resumes where it stopped and ends with the
  same points as one run.
* **Deadline.** Past it no new configuration starts (`OutOfTime`); the caller reports the
  best point so far.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from psr.eval.harness import EvalData, RunConfig, compare, run_config
from psr.eval.workers import Workers
from psr.points import model_key
from psr.policy import make_policy

# Result keys that are not saved: the trace (replayed into latency already) and replay inputs.
_NOT_SAVED = ("trace", "mode_starts", "mode_traces")


# Screening measures 1/SCREEN_SHARE of set A's windows, at least SCREEN_LEAST of them.
SCREEN_SHARE = 8
SCREEN_LEAST = 8


class OutOfTime(Exception):
    """The deadline passed before a configuration that still had to be measured."""


def screening(data: EvalData) -> EvalData:
    """`data`'s screening subset: 1/SCREEN_SHARE of its windows (at least SCREEN_LEAST, at
    most all), evenly spread over them, without greedy prompts or cloze (scored NLL and
    the trace the latency model replays are all screening reads)."""
    n = len(data.windows)
    k = min(n, max(SCREEN_LEAST, n // SCREEN_SHARE))
    step = n // k if k else 1
    return dataclasses.replace(
        data,
        windows=data.windows[::step][:k],
        prompts=[],
        gen_tokens=0,
        cloze=[],
        source=f"{data.source} (screening: {k} of {n} windows)",
    )


def coarse_indices(n: int) -> list[int]:
    """The grid's ends and middle (all of a grid of at most three)."""
    return sorted({0, (n - 1) // 2, n - 1}) if n > 0 else []


def next_index(measured: dict[int, bool], n: int) -> int | None:
    """The next grid index to measure for one residency and n, from `measured` (index ->
    within budget): the middle of the gap between the highest index within budget and the
    next measured one above it; None when they are neighbours (or nothing is within budget
    and the lowest index is measured, or the highest index is within budget)."""
    ok = [i for i, good in measured.items() if good]
    lo = max(ok) if ok else -1
    above = [i for i in measured if i > lo]
    hi = min(above) if above else n
    if lo == -1 and 0 not in measured:
        return 0
    if hi - lo <= 1:
        return None
    if hi == n:  # nothing measured above lo: its neighbour first (coarse grids include n - 1)
        return lo + 1
    return (lo + hi) // 2


class Runner:
    """Measures configurations (psr.eval.harness.run_config) on `workers` or reads their
    saved results, one progress line each on stderr, until `deadline` (time.monotonic(),
    one clock for every process)."""

    def __init__(
        self,
        path: str,
        folder: str | Path,
        profiles: Sequence[str],
        deadline: float | None = None,
        progress: bool = False,
        workers: Workers | None = None,
    ) -> None:
        self.path, self.folder, self.profiles = path, Path(folder), tuple(profiles)
        self.deadline, self.progress = deadline, progress
        self.workers = workers or Workers()
        self.model = model_key(path)
        self.measured = self.reused = 0

    def _file(self, rc: RunConfig, split: str) -> Path:
        name = f"{split}-{rc.residency:g}-{rc.label}"
        return self.folder / (re.sub(r"[^A-Za-z0-9.=_-]+", "_", name) + ".json")

    def _key(self, rc: RunConfig, data: EvalData) -> dict[str, Any]:
        tokens = json.dumps([data.windows, data.prompt_len, data.prompts, data.gen_tokens])
        return {
            "model": self.model,
            "data": hashlib.sha256(tokens.encode()).hexdigest(),
            "config": rc.as_dict(),
            "profiles": list(self.profiles),
        }

    def __call__(self, rc: RunConfig, data: EvalData, split: str) -> dict[str, Any]:
        """`rc`'s result on `data` (held-out set `split`): saved, or measured and saved."""
        return self.many([rc], data, split)[0]

    def many(self, rcs: Sequence[RunConfig], data: EvalData, split: str) -> list[dict[str, Any]]:
        """Each of `rcs`' results on `data` (held-out set `split`), in order: the saved
        ones read back, the others measured together on the workers and saved as each
        completes. OutOfTime when any was not started before the deadline (the others'
        results are saved)."""
        out = [self._saved(rc, data, split) for rc in rcs]
        todo = [i for i, r in enumerate(out) if r is None]
        if todo and self.deadline is not None and time.monotonic() >= self.deadline:
            raise OutOfTime(rcs[todo[0]].label)
        inner = self.progress and self.workers.workers == 1
        tasks = [
            (self.path, rcs[i], data, split, self.profiles, inner, self._file(rcs[i], split),
             self._key(rcs[i], data), self.deadline)
            for i in todo
        ]  # fmt: skip
        late = []
        for i, r in zip(todo, self.workers.map(_measure, tasks), strict=True):
            if r is None:
                late.append(rcs[i].label)
            else:
                out[i] = r
                self.measured += 1
        if late:
            raise OutOfTime(late[0])
        return out  # type: ignore[return-value]

    def _saved(self, rc: RunConfig, data: EvalData, split: str) -> dict[str, Any] | None:
        """`rc`'s saved result on `data`, if a whole one with the same key is saved."""
        f = self._file(rc, split)
        if not f.is_file():
            return None
        try:
            saved = json.loads(f.read_text())
        except ValueError:
            return None  # a file cut short by an interruption: measured again
        if not (isinstance(saved, dict) and saved.get("key") == self._key(rc, data)):
            return None
        self.reused += 1
        _line(f"set {split} {rc.residency:.1%} {rc.label}: saved result")
        result: dict[str, Any] = saved["result"]
        return result


def _line(text: str) -> None:
    tqdm.write(f"psr tune: {text}", file=sys.stderr)


def _measure(
    path: str,
    rc: RunConfig,
    data: EvalData,
    split: str,
    profiles: Sequence[str],
    progress: bool,
    f: Path,
    key: dict[str, Any],
    deadline: float | None,
) -> dict[str, Any] | None:
    """One configuration measured and saved to `f` (a worker's task); None, measuring
    nothing, once `deadline` has passed."""
    if deadline is not None and time.monotonic() >= deadline:
        return None
    t = time.perf_counter()
    r = run_config(path, rc, data, profiles, progress=progress)
    r = {k: v for k, v in r.items() if k not in _NOT_SAVED}
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "result": r}))
    tmp.replace(f)  # whole or absent: an interruption leaves no half-written result
    _line(
        f"set {split} {rc.residency:.1%} {rc.label}: measured in "
        f"{time.perf_counter() - t:.1f} s, saved to {f}"
    )
    return r


def within(r: dict[str, Any], budget: float) -> bool:
    """The 95% upper bound of `r`'s Δ nats/token is within `budget`: a point may be chosen."""
    return bool(r.get("delta_nll", {}).get("hi", float("inf")) <= budget)


def could_be_within(r: dict[str, Any], budget: float) -> bool:
    """The lower end of `r`'s 95% interval is within `budget`: screening keeps it."""
    return bool(r.get("delta_nll", {}).get("lo", float("inf")) <= budget)


def finalists(
    screened: dict[tuple[float, int], dict[int, dict[str, Any]]],
    rho: float,
    ns: Sequence[int],
    budget: float,
    profile: str,
) -> list[tuple[int, int]]:
    """One family's candidates at residency `rho` to measure in full, as (n, grid index),
    fastest first by their screened modeled latency on `profile`: for each n in `ns`
    the grid's lams up to the highest that screening kept (could be within the budget),
    so a walk that fails goes on to the next-fastest candidate, whichever n it has."""
    out: list[tuple[float, int, int]] = []
    for n in ns:
        rs = screened.get((rho, n), {})
        top = max((i for i, r in rs.items() if could_be_within(r, budget)), default=-1)
        ms = math.inf
        for i in range(top, -1, -1):
            # A lam screening skipped ranks as the screened one above it (its latency lies
            # between its neighbours': it falls as lam rises), right after that one.
            if i in rs:
                ms = rs[i]["latency"][profile]["ms_per_token"]
            out.append((ms, -i, n))
    return [(n, -neg) for _, neg, n in sorted(out)]


Batch = Callable[[Sequence[RunConfig]], list[dict[str, Any]]]


def walk_together(
    run: Batch,
    fixed: Sequence[RunConfig],
    walks: Sequence[Sequence[RunConfig]],
    ok: Callable[[int, dict[str, Any], list[dict[str, Any]]], bool],
    head: list[dict[str, Any]],
    got: list[list[dict[str, Any]]],
) -> None:
    """`fixed` measured into `head`, and each walk's configurations in order into its list
    in `got` until `ok(walk, result, head)`. The walks advance together, one configuration
    each per `run` call (`fixed` in the first): the configurations measured are those of
    walking them one after another, in fewer calls, each a batch for the workers. `head`
    and `got` fill in place, so an OutOfTime leaves what was measured before it."""
    got[:] = [[] for _ in walks]
    live = [w for w, cs in enumerate(walks) if cs]
    first = run([*fixed, *(walks[w][0] for w in live)])
    head[:] = first[: len(fixed)]
    batch = first[len(fixed) :]
    while live:
        for w, r in zip(live, batch, strict=True):
            got[w].append(r)
        live = [w for w in live if not ok(w, got[w][-1], head) and len(got[w]) < len(walks[w])]
        if live:
            batch = run([walks[w][len(got[w])] for w in live])


def select(
    run: Batch,
    screen: Batch,
    residencies: Sequence[float],
    lams: Sequence[float],
    ns: Sequence[int],
    budget: float,
    profiles: Sequence[str],
) -> tuple[list[dict[str, Any]], bool]:
    """Exact, then Cache-Prior (n = 0) and PSR (n > 0) over `lams` at each residency:
    screened with `screen` coarse to fine, the finalists measured with `run` (see the
    module's docstring); each call measures a batch of configurations that do not depend
    on each other. Returns (every `run` result, compared with exact at its residency, in
    the order of one walk after another; whether the search finished: False when a run
    raised OutOfTime)."""
    grid = sorted(set(lams))
    screened: dict[tuple[float, int], dict[int, dict[str, Any]]] = {}
    exact: dict[float, dict[str, Any]] = {}  # screened

    def policy(n: int, i: int) -> Any:
        return make_policy("cache-prior", grid[i]) if n == 0 else make_policy("psr", grid[i], n)

    def screen_round(todo: list[tuple[float, int, int]], lead: Sequence[RunConfig] = ()) -> None:
        got = screen([*lead, *(RunConfig(policy(n, i), rho) for rho, n, i in todo)])
        exact.update(zip([rc.residency for rc in lead], got, strict=False))
        for (rho, n, i), r in zip(todo, got[len(lead) :], strict=True):
            screened.setdefault((rho, n), {})[i] = r
        compare([*exact.values(), *(r for rs in screened.values() for r in rs.values())], profiles)

    def kept(rs: dict[int, dict[str, Any]]) -> dict[int, bool]:
        return {i: could_be_within(r, budget) for i, r in rs.items()}

    exacts = [RunConfig(make_policy("exact"), rho) for rho in residencies]
    full: list[dict[str, Any]] = []  # exact at each residency, in full
    walked: list[list[dict[str, Any]]] = []
    finished = False
    try:
        coarse = [(rho, n, i) for rho in residencies for n in ns for i in coarse_indices(len(grid))]
        screen_round(coarse, exacts)
        while todo := [
            (rho, n, i)
            for (rho, n), rs in screened.items()
            if (i := next_index(kept(rs), len(grid))) is not None
        ]:
            screen_round(todo)
        # Per residency and family, its finalists fastest first until one is within budget.
        at, walks = [], []
        for k, rho in enumerate(residencies):
            for fam_ns in ([n for n in ns if n == 0], [n for n in ns if n > 0]):
                cands = finalists(screened, rho, fam_ns, budget, profiles[0])
                at.append(k)
                walks.append([RunConfig(policy(n, i), rho) for n, i in cands])

        def ok(w: int, r: dict[str, Any], head: list[dict[str, Any]]) -> bool:
            compare([head[at[w]], r], profiles)
            return within(r, budget)

        walk_together(run, exacts, walks, ok, full, walked)
        finished = True
    except OutOfTime:
        pass
    results = [*full, *(r for rs in walked for r in rs)]
    compare(results, profiles)
    return results, finished
