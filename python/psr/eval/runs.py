"""`psr demo`, `psr eval` and `psr bench sweep`: runs of the harness over policies and
residencies, with their reports."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from psr.eval.harness import DEFAULT_PROFILES, EvalData, RunConfig, compare, run_config
from psr.eval.report import markdown_table, pareto, save
from psr.models.embedded import DEFAULT_MODEL, heldout_text, tokenizer_of
from psr.policy import (
    OPERATING_POINTS_FILE,
    Policy,
    make_policy,
    operating_points,
    standard_policies,
)


def policy_grid(path: str, residencies: Sequence[float]) -> list[RunConfig]:
    """The four standard policies at each residency, at the model's operating points."""
    return [
        RunConfig(p, rho)
        for rho in residencies
        for p in standard_policies(operating_points(path, rho))
    ]


def run_all(
    path: str,
    configs: list[RunConfig],
    data: EvalData,
    desc: str,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    progress: bool = True,
) -> list[dict]:
    results = []
    for rc in tqdm(configs, desc=desc, disable=not progress):
        results.append(run_config(path, rc, data, profiles, progress=progress))
    compare(results, profiles)
    return results


def demo(
    out: str = "bench/results/demo",
    residencies: Sequence[float] = (0.5, 0.25),
    progress: bool = True,
    quick: bool = False,
) -> list[dict]:
    """The main job: the embedded model under the four policies at 50% and 25% residency."""
    path = DEFAULT_MODEL
    t0 = time.time()
    data = EvalData.from_text(
        tokenizer_of(path),
        heldout_text(path),
        prompts=2 if quick else 4,
        gen_tokens=24 if quick else 48,
        windows=4 if quick else 12,
        window_tokens=96,
    )
    results = run_all(path, policy_grid(path, residencies), data, "psr demo", progress=progress)
    paths = save(results, out, "demo", {"model": path, "seconds": time.time() - t0})
    print(
        f"psr demo: embedded model ({path}), {len(data.prompts)} held-out prompts x "
        f"{data.gen_tokens} greedy tokens, {len(data.windows)} held-out windows for "
        f"Δ nats/token; latency modeled for an OLMoE-sized expert"
    )
    print(markdown_table(results))
    print(f"\nwrote {paths['md']}, {paths['json']}, {paths['png']} ({time.time() - t0:.0f} s)")
    return results


def grid(policies: Sequence[Policy], residencies: Sequence[float]) -> list[RunConfig]:
    """Every policy at every residency (policies from `psr.policy.parse_policies`)."""
    return [RunConfig(p, rho) for rho in residencies for p in policies]


def evaluate(
    path: str,
    configs: list[RunConfig],
    out: str,
    *,
    windows: int = 24,
    cloze: int = 24,
    prompts: int = 4,
    gen_tokens: int = 48,
    progress: bool = True,
    traces: bool = False,
) -> list[dict]:
    """Quality suite: perplexity, cloze multiple choice, greedy agreement, modeled latency."""
    data = EvalData.from_text(
        tokenizer_of(path),
        heldout_text(path),
        prompts=prompts,
        gen_tokens=gen_tokens,
        windows=windows,
        cloze=cloze,
    )
    results = run_all(path, configs, data, "psr eval", progress=progress)
    paths = save(results, out, "eval", {"model": path}, traces=traces)
    print(markdown_table(results))
    print(f"\nwrote {paths['md']}, {paths['json']}, {paths['png']}")
    return results


def sweep(
    path: str,
    out: str,
    residencies: Sequence[float] = (0.5, 0.25),
    lams: Sequence[float] = (0.1, 0.2, 0.3, 0.5, 0.8),
    ns: Sequence[int] = (0, 1, 2),
    tolerance: float = 0.01,
    windows: int = 16,
    write_points: bool = False,
    progress: bool = True,
) -> dict:
    """lam x n per residency: Pareto front of modeled latency vs Δ nats/token, and the
    operating points (fastest cache-prior / psr within `tolerance` nats of exact)."""
    data = EvalData.from_text(
        tokenizer_of(path), heldout_text(path), prompts=2, gen_tokens=32, windows=windows
    )
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
    results = run_all(path, configs, data, "psr sweep", progress=progress)
    prof = DEFAULT_PROFILES[0]
    fronts, points = {}, {}
    for rho in residencies:
        rs = [r for r in results if r["config"]["residency"] == rho]
        pts = [(r["latency"][prof]["ms_per_token"], r["delta_nll"]["mean"], r["label"]) for r in rs]
        fronts[f"{rho:g}"] = pareto(pts)
        choice = {}
        for fam in ("cache-prior", "psr"):
            ok = [
                r
                for r in rs
                if r["config"]["policy"] == fam and r["delta_nll"]["mean"] <= tolerance
            ]
            if ok:
                best = min(ok, key=lambda r: r["latency"][prof]["ms_per_token"])
                cfg = best["config"]
            else:  # nothing within tolerance: this module's defaults
                cfg = make_policy(fam).params()
            choice[fam] = {k: cfg[k] for k in ("lam", "n") if cfg[k] is not None}
        points[f"{rho:g}"] = choice
    extra = {
        "model": path,
        "pareto": fronts,
        "tolerance_nats": tolerance,
        "points": points,
        "profile": prof,
    }
    paths = save(results, out, "sweep", extra)
    print(markdown_table(results))
    print(f"\nPareto front ({prof}, latency vs Δ nats/token): {json.dumps(fronts, indent=1)}")
    print(f"operating points (fastest within {tolerance} nats/token): {json.dumps(points)}")
    if write_points:
        f = Path(path) / OPERATING_POINTS_FILE
        f.write_text(
            json.dumps(
                {
                    "points": points,
                    "tolerance_nats": tolerance,
                    "profile": prof,
                    "source": "psr bench sweep",
                },
                indent=1,
            )
        )
        print(f"wrote {f}")
    print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
    return extra
