"""PSR against Cache-Prior at equal quality, from a sweep's lam grid.

    python bench/equal_quality.py bench/results/tune/select/sweep.json [--profile rtx4090]

For each residency and each PSR point, Cache-Prior's modeled ms/token at the same mean
Δ nats/token, linearly interpolated along Cache-Prior's lam curve (exact as lam 0);
the ratio is Cache-Prior's ms over PSR's. Points outside Cache-Prior's measured range
are not extrapolated. Also the within-budget comparison: the fastest point of each
family whose 95% upper bound is within the budget.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from psr.eval.report import pct
from psr.eval.runs import choose


def interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """y at x on a piecewise-linear curve of (x, y) sorted by x; None outside it."""
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("sweep")
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--budget", type=float, default=0.01)
    args = ap.parse_args(argv)
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
