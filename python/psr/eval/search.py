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
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from psr.eval.harness import EvalData, RunConfig, compare, run_config
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
    """Measures configurations (psr.eval.harness.run_config) or reads their saved results,
    one progress line each on stderr, until `deadline` (time.monotonic())."""

    def __init__(
        self,
        path: str,
        folder: str | Path,
        profiles: Sequence[str],
        deadline: float | None = None,
        progress: bool = False,
    ) -> None:
        self.path, self.folder, self.profiles = path, Path(folder), tuple(profiles)
        self.deadline, self.progress = deadline, progress
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
        f, key = self._file(rc, split), self._key(rc, data)
        if f.is_file():
            try:
                saved = json.loads(f.read_text())
            except ValueError:
                saved = None  # a file cut short by an interruption: measured again
            if isinstance(saved, dict) and saved.get("key") == key:
                self.reused += 1
                self._line(f"set {split} {rc.residency:.1%} {rc.label}: saved result")
                result: dict[str, Any] = saved["result"]
                return result
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise OutOfTime(rc.label)
        t = time.perf_counter()
        r = run_config(self.path, rc, data, self.profiles, progress=self.progress)
        r = {k: v for k, v in r.items() if k not in _NOT_SAVED}
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "result": r}))
        tmp.replace(f)  # whole or absent: an interruption leaves no half-written result
        self.measured += 1
        self._line(
            f"set {split} {rc.residency:.1%} {rc.label}: measured in "
            f"{time.perf_counter() - t:.1f} s, saved to {f}"
        )
        return r

    def _line(self, text: str) -> None:
        tqdm.write(f"psr tune: {text}", file=sys.stderr)


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


def select(
    run: Callable[[RunConfig], dict[str, Any]],
    screen: Callable[[RunConfig], dict[str, Any]],
    residencies: Sequence[float],
    lams: Sequence[float],
    ns: Sequence[int],
    budget: float,
    profiles: Sequence[str],
) -> tuple[list[dict[str, Any]], bool]:
    """Exact, then Cache-Prior (n = 0) and PSR (n > 0) over `lams` at each residency:
    screened with `screen` coarse to fine, the finalists measured with `run` (see the
    module's docstring). Returns (every `run` result, compared with exact at its residency;
    whether the search finished: False when a run raised OutOfTime)."""
    grid = sorted(set(lams))
    results: list[dict[str, Any]] = []
    screened: dict[tuple[float, int], dict[int, dict[str, Any]]] = {}
    exact: dict[float, dict[str, Any]] = {}  # screened

    def policy(n: int, i: int) -> Any:
        return make_policy("cache-prior", grid[i]) if n == 0 else make_policy("psr", grid[i], n)

    def screen_round(todo: list[tuple[float, int, int]]) -> None:
        for rho, n, i in todo:
            screened.setdefault((rho, n), {})[i] = screen(RunConfig(policy(n, i), rho))
        compare([*exact.values(), *(r for rs in screened.values() for r in rs.values())], profiles)

    def kept(rs: dict[int, dict[str, Any]]) -> dict[int, bool]:
        return {i: could_be_within(r, budget) for i, r in rs.items()}

    try:
        exact.update({rho: screen(RunConfig(make_policy("exact"), rho)) for rho in residencies})
        screen_round(
            [(rho, n, i) for rho in residencies for n in ns for i in coarse_indices(len(grid))]
        )
        while todo := [
            (rho, n, i)
            for (rho, n), rs in screened.items()
            if (i := next_index(kept(rs), len(grid))) is not None
        ]:
            screen_round(todo)
        full = {rho: run(RunConfig(make_policy("exact"), rho)) for rho in residencies}
        results.extend(full.values())
        for rho in residencies:
            for fam_ns in ([n for n in ns if n == 0], [n for n in ns if n > 0]):
                cands = finalists(screened, rho, fam_ns, budget, profiles[0])
                for n, i in cands:  # fastest first, until one is within the budget
                    r = run(RunConfig(policy(n, i), rho))
                    results.append(r)
                    compare([full[rho], r], profiles)
                    if within(r, budget):
                        break
        return results, True
    except OutOfTime:
        return results, False
    finally:
        compare(results, profiles)
