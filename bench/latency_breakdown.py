"""Where a modeled decode token's time goes: compute, the copy link, stalls.

    python bench/latency_breakdown.py --windows 40 --out bench/results/variants

Teacher-forced on held-out set A (the selection set), modeled on the default profile,
for exact routing, the tuned PSR point and the prefetch variants that add copies
(two-layers-ahead prefetch, n = 4). If the copy link is busy for most of a token, a
prefetch issued earlier cannot hide more: only fewer copies per token make it faster.
Writes latency_breakdown.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from variants import exact, measure

from psr.eval.defaults import PROFILE
from psr.eval.harness import EvalData
from psr.eval.report import pct
from psr.models import DEFAULT_MODEL

# (label, (lam, n, variant, variant value)) of the PSR runs, beside exact routing
CONFIGS = [
    ("psr(lam=0.1, n=2)", (0.1, 2, "psr", 0.0)),
    ("ahead2(1) psr(lam=0.1, n=2)", (0.1, 2, "ahead2", 1.0)),
    ("ahead2(2) psr(lam=0.1, n=2)", (0.1, 2, "ahead2", 2.0)),
    ("psr(lam=0.1, n=4)", (0.1, 4, "wide", 0.0)),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--residency", default="0.5,0.25")
    ap.add_argument("--out", default="bench/results/variants")
    args = ap.parse_args(argv)
    data = EvalData.from_heldout(
        args.model, "A", windows=args.windows, window_tokens=160, prompt_tokens=32, prompts=0
    )
    lines = [
        f"Modeled on {PROFILE}, {args.windows} windows x 128 decode tokens of set A.",
        "",
        "| residency | config | ms/token | compute ms | copy link busy ms | stall ms "
        "| misses/tok | prefetches/tok | copies/tok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rho in [float(x) for x in args.residency.split(",")]:
        for label, cfg in [("exact", None), *CONFIGS]:
            if cfg is None:
                r = exact(args.model, rho, data)
            else:
                r = measure(args.model, rho, *cfg, data)
            lat, s = r["latency"][PROFILE], r["stats"]
            t = s["tokens"]
            lines.append(
                f"| {pct(rho)} | {label} | {lat['ms_per_token']:.2f} | {lat['compute_ms']:.2f} | "
                f"{lat['copy_ms']:.2f} | {lat['stall_ms']:.2f} | {s['misses'] / t:.2f} | "
                f"{s['prefetches'] / t:.2f} | {(s['misses'] + s['prefetches']) / t:.2f} |"
            )
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latency_breakdown.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
