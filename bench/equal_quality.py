"""PSR against Cache-Prior at equal quality: from a sweep's lam grid, or measured on set B
against both Cache-Prior variants with a 95% interval.

    python bench/equal_quality.py bench/results/tune/select/sweep.json [--profile rtx4090]
    python bench/equal_quality.py --measure --out bench/results/cp_variants \
        [--residency 0.5,0.25] [--windows 80]

From a sweep: for each residency and each PSR point, Cache-Prior's modeled ms/token at the
same mean Δ nats/token, linearly interpolated along Cache-Prior's lam curve (exact as lam
0); the ratio is Cache-Prior's ms over PSR's. Points outside Cache-Prior's measured range
are not extrapolated. Also the within-budget comparison: the fastest point of each family
whose 95% upper bound is within the budget.

`--measure`: on held-out set B (the replication set), per residency: exact, the spec's
Cache-Prior (the token's own range) and Cache-Prior as its paper defines it (the running-
average range, bench/variants.py's CacheRouting) on the lam grid `CP_LAMS`, and PSR at its
tuned point. Each Cache-Prior curve is interpolated at PSR's Δ nats/token as above; the
strongest Cache-Prior is the one faster there. The 95% interval of PSR's speedup over it
is a percentile bootstrap over windows (paired: each resample draws the same windows for
every configuration and recomputes each one's mean Δ nats and mean modeled ms/token,
then the interpolation). Writes equal_quality_B.{md,json,png} and the frontier figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from psr.eval.labels import pct
from psr.eval.runs import choose


def interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """y at x on a piecewise-linear curve of (x, y) sorted by x; None outside it."""
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return None


# Cache-Prior's lam grid on set B (both variants): the tuned points' neighbourhood, wide
# enough that PSR's tuned Δ nats lies inside each curve.
CP_LAMS = (0.05, 0.1, 0.15)
CP_VARIANTS = ("cache-prior", "cp_paper")  # the spec's range, the paper's running average
RESAMPLES = 2000


def window_means(r: dict[str, Any], windows: int) -> np.ndarray:
    """Per window, the mean modeled ms of its decode tokens (the trace holds them in order)."""
    ms = np.asarray(r["token_ms"], dtype=np.float64)
    if ms.size % windows:
        raise ValueError(
            f"{r['label']}: {ms.size} decode tokens do not split into {windows} windows"
        )
    return ms.reshape(windows, -1).mean(1)


def at_equal_quality(
    ex: tuple[np.ndarray, np.ndarray],
    curve: list[tuple[np.ndarray, np.ndarray]],
    psr: tuple[np.ndarray, np.ndarray],
    idx: np.ndarray,
) -> float | None:
    """Cache-Prior's ms over PSR's at PSR's mean Δ nats, on the windows `idx`; each pair
    holds a configuration's per-window NLL and ms (exact: lam 0 of the curve)."""
    nll0 = ex[0][idx]
    pts = sorted(
        [(0.0, float(ex[1][idx].mean()))]
        + [(float((n[idx] - nll0).mean()), float(m[idx].mean())) for n, m in curve]
    )
    d = float((psr[0][idx] - nll0).mean())
    y = interpolate(pts, d)
    return None if y is None else y / float(psr[1][idx].mean())


def measure_b(args: argparse.Namespace) -> int:
    """`--measure` (module docstring)."""
    from variants import PROFILE, compare, exact, measure

    from psr.eval.harness import EvalData
    from psr.eval.report import save
    from psr.points import operating_points

    kw = dict(windows=args.windows, window_tokens=160, prompt_tokens=32, prompts=0)
    data = EvalData.from_heldout(args.model, "B", **kw)
    rng = np.random.default_rng(0)
    idxs = [rng.integers(0, args.windows, args.windows) for _ in range(RESAMPLES)]
    results: list[dict[str, Any]] = []
    lines = [
        f"set B, {args.windows} windows x 128 decode-path tokens; {PROFILE} (host-free); "
        f"95% interval: percentile bootstrap over windows ({RESAMPLES} resamples)\n",
        "| residency | psr point | Δ nats/tok | cache-prior variant | its ms/tok at equal Δ "
        "| psr speedup over it [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {}
    for rho in [float(x) for x in args.residency.split(",")]:
        pt = operating_points(args.model, rho)["psr"]
        ex = exact(args.model, rho, data)
        ps = measure(args.model, rho, pt.lam, pt.n, "psr", 0.0, data)
        curves = {
            v: [measure(args.model, rho, lam, 0, v, 0.0, data) for lam in CP_LAMS]
            for v in CP_VARIANTS
        }
        rs = [ex, ps, *curves["cache-prior"], *curves["cp_paper"]]
        compare(rs, (PROFILE,))
        results += rs

        def pair(r: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
            return np.asarray(r["nll_items"]), window_means(r, args.windows)

        everything = np.arange(args.windows)
        rows = {}
        for v, curve in curves.items():
            c = [pair(r) for r in curve]
            point = at_equal_quality(pair(ex), c, pair(ps), everything)
            boot = [at_equal_quality(pair(ex), c, pair(ps), i) for i in idxs]
            inside = [b for b in boot if b is not None]
            ci = (
                (float(np.percentile(inside, 2.5)), float(np.percentile(inside, 97.5)))
                if len(inside) >= 0.95 * RESAMPLES
                else None
            )
            rows[v] = {"speedup": point, "ci": ci, "resamples_inside": len(inside)}
        # the strongest Cache-Prior: the lower ms at PSR's Δ, i.e. the smaller speedup
        known = {v: r for v, r in rows.items() if r["speedup"] is not None}
        strongest = min(known, key=lambda v: known[v]["speedup"]) if known else None
        d = ps["delta_nll"]["mean"]
        for v, r in rows.items():
            sp, ci = r["speedup"], r["ci"]
            ms = "-" if sp is None else f"{ps['latency'][PROFILE]['ms_per_token'] * sp:.2f}"
            txt = "(outside its range)" if sp is None else f"{sp:.2f}x"
            if ci is not None:
                txt += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
            mark = " (strongest)" if v == strongest else ""
            lines.append(f"| {pct(rho)} | {ps['label']} | {d:+.4f} | {v}{mark} | {ms} | {txt} |")
        summary[f"{rho:g}"] = {
            "psr": ps["label"],
            "delta_nll": ps["delta_nll"],
            "strongest": strongest,
            **rows,
        }
        print("\n".join(lines), flush=True)
        out = Path(args.out)  # written after each residency: a long run keeps what it has
        slim = [{k: v for k, v in r.items() if k != "token_ms"} for r in results]
        save(slim, out, "equal_quality_B", {"model": args.model, "summary": summary}, (PROFILE,))
        (out / "equal_quality_B.md").write_text(
            "\n".join(lines) + "\n\n" + (out / "equal_quality_B.md").read_text()
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("sweep", nargs="?")
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--measure", action="store_true", help="measure on set B (docstring)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="bench/results/cp_variants")
    ap.add_argument("--residency", default="0.5,0.25")
    ap.add_argument("--windows", type=int, default=80)
    ap.add_argument("--replot", action="store_true", help="redraw --out's figures from its json")
    args = ap.parse_args(argv)
    if args.replot:
        from psr.eval import plots

        out = Path(args.out)
        saved = json.loads((out / "equal_quality_B.json").read_text())["results"]
        plots.plot(saved, out / "equal_quality_B.png", (args.profile,))
        plots.plot_frontier(saved, out / "equal_quality_B_frontier.png", args.profile)
        return 0
    if args.measure:
        if args.model is None:
            from psr.models import DEFAULT_MODEL

            args.model = DEFAULT_MODEL
        return measure_b(args)
    if args.sweep is None:
        ap.error("give a sweep.json, or --measure")
    results = json.loads(Path(args.sweep).read_text())["results"]

    def ms(r: dict[str, Any]) -> float:
        return r["latency"][args.profile]["ms_per_token"]

    print(
        "| residency | psr point | Δ nats/tok | psr ms/tok (host-free) | cache-prior ms/tok "
        "(host-free) at equal Δ | psr speedup over cache-prior |\n|---|---|---|---|---|---|"
    )
    within = []
    for rho in sorted({r["config"]["residency"] for r in results}, reverse=True):
        at = [r for r in results if r["config"]["residency"] == rho]
        cp = sorted(
            (r["delta_nll"]["mean"], ms(r))
            for r in at
            if r["config"]["policy"] in ("cache-prior", "exact")
        )
        for r in sorted(at, key=lambda r: (r["config"]["lam"] or 0, r["config"]["n"] or 0)):
            if r["config"]["policy"] != "psr":
                continue
            d = r["delta_nll"]["mean"]
            y = interpolate(cp, d)
            ratio = f"{y / ms(r):.2f}x" if y is not None else "(outside cache-prior's range)"
            print(
                f"| {pct(rho)} | {r['label']} | {d:+.4f} | {ms(r):.2f} | "
                f"{'-' if y is None else f'{y:.2f}'} | {ratio} |"
            )
        best = {
            fam: next(iter(choose(results, rho, fam, args.budget, args.profile)), None)
            for fam in ("cache-prior", "psr")
        }
        if all(best.values()):
            within.append(
                f"{pct(rho)}: {best['psr']['label']} {ms(best['psr']):.2f} ms vs "
                f"{best['cache-prior']['label']} {ms(best['cache-prior']):.2f} ms = "
                f"{ms(best['cache-prior']) / ms(best['psr']):.2f}x"
            )
    print(
        f"\nfastest within budget (95% upper bound <= {args.budget:g}), psr over cache-prior "
        "(host-free):"
    )
    print("\n".join(within))
    return 0


if __name__ == "__main__":
    sys.exit(main())
