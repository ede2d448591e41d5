"""`psr demo`, `psr eval` and `psr bench sweep` on top of psr.evaluate."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from psr.evaluate import (
    DEFAULT_PROFILES,
    EvalData,
    RunConfig,
    compare,
    markdown_table,
    pareto,
    run_config,
    save,
)

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "default_model")
OPERATING_POINTS = "operating_points.json"
FALLBACK_POINTS = {"cache-prior": {"lam": 0.3}, "psr": {"lam": 0.3, "n": 1}}


def heldout_text(path: str) -> str:
    f = Path(path) / "heldout.txt"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: evaluation text for {path}")
    return f.read_text(encoding="utf-8")


def tokenizer_of(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def operating_points(path: str, residency: float) -> dict[str, dict[str, float]]:
    f = Path(path) / OPERATING_POINTS
    if f.is_file():
        pts = json.loads(f.read_text())["points"]
        key = f"{residency:g}"
        if key in pts:
            return pts[key]
    return FALLBACK_POINTS


def policy_grid(path: str, residencies: Sequence[float]) -> list[RunConfig]:
    out = []
    for rho in residencies:
        op = operating_points(path, rho)
        out += [
            RunConfig("exact", rho),
            RunConfig("exact-prefetch", rho, n=1),
            RunConfig("cache-prior", rho, lam=op["cache-prior"]["lam"]),
            RunConfig("psr", rho, lam=op["psr"]["lam"], n=int(op["psr"]["n"])),
        ]
    return out


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


def parse_policies(spec: str, residencies: Sequence[float]) -> list[RunConfig]:
    """'exact;cache-prior:lam=0.3;psr:lam=0.3,n=1' x residencies (exact always included)."""
    out = []
    items = [s.strip() for s in spec.split(";") if s.strip()]
    for rho in residencies:
        if not any(s.split(":")[0] == "exact" for s in items):
            out.append(RunConfig("exact", rho))
        for s in items:
            name, _, args = s.partition(":")
            kw: dict[str, Any] = {}
            for a in filter(None, args.split(",")):
                k, _, v = a.partition("=")
                if k not in ("lam", "n"):
                    raise ValueError(f"policy parameter {k!r} in {s!r}: expected lam or n")
                kw[k] = float(v) if k == "lam" else int(v)
            out.append(RunConfig(name, rho, **kw))
    return out


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
        configs.append(RunConfig("exact", rho))
        configs += [RunConfig("exact-prefetch", rho, n=n) for n in ns if n > 0]
        for lam in lams:
            configs += [
                RunConfig("cache-prior" if n == 0 else "psr", rho, lam=lam, n=None if n == 0 else n)
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
                choice[fam] = {
                    k: best["config"][k] for k in ("lam", "n") if best["config"][k] is not None
                }
            else:
                choice[fam] = FALLBACK_POINTS[fam]
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
        f = Path(path) / OPERATING_POINTS
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
