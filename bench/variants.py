"""Steering variants beyond the spec's rule, measured with the replication rule.

    python bench/variants.py --out bench/results/variants [--residency 0.5,0.25]

The spec's PSR (`z' = z + lam * D * m`, n next-layer predictions) is the baseline. Each
variant changes one thing, applied to a loaded model through the runtime's extension
points (psr.runtime.Steering subclasses, or the routing op), never to the cache rules:
  renorm     the chosen experts' gate weights rescaled to the unbiased top-k's total
             mass (a substitution no longer shrinks the layer's output);
  lam_first  a different lam for the first MoE layer, which never receives prefetches;
  conf       prefetch a predicted expert only if the next layer's router gives it at least
             probability tau (fewer, surer prefetch copies);
  wide       the spec's rule with more predictions per layer and token (n = 3, 4), beyond
             the tuning grid's n <= 2 (more prefetch copies, more cached candidates);
  ahead2     also insert up to v experts predicted by the router two MoE layers ahead
             (AheadTwo): copies issued a layer earlier, at a lower recall;
  lam_ramp   per-layer lam rising linearly with depth, lam*(1-v) at the first MoE layer to
             lam*(1+v) at the last (deeper layers receive surer prefetches).
Every configuration is scored on held-out set A (selection) with the powered harness;
per residency and variant, the fastest point within the budget (95% upper bound) is then
re-measured on set B beside the tuned baseline PSR point. A variant is kept only if it
is at least 2% faster than the baseline on B at a cost still within budget.
Results: variants.md/json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

import psr_kernels as pk
from psr.eval.defaults import BUDGET, PROFILE
from psr.eval.harness import EvalData, RunConfig, compare
from psr.eval.latency import simulate
from psr.eval.quality import perplexity_items
from psr.eval.report import pct
from psr.eval.runs import choose, within_budget
from psr.models import DEFAULT_MODEL, load
from psr.points import operating_points
from psr.policy import make_policy
from psr.runtime.steering import Prediction, Steering


class LamFirst(Steering):
    """A separate lam for the first MoE layer."""

    spec_rule = False

    def __init__(self, runtime: Any, value: float) -> None:
        super().__init__(runtime)
        self.value = value

    def lam(self, layer: Any) -> float:
        return self.value if layer.index == 0 else self.rt.policy.lam


class LamRamp(Steering):
    """lam ramped linearly with depth: lam * (1 - v) in the first MoE layer to
    lam * (1 + v) in the last."""

    spec_rule = False

    def __init__(self, runtime: Any, value: float) -> None:
        super().__init__(runtime)
        self.value = value

    def lam(self, layer: Any) -> float:
        last = len(self.rt.layers) - 1
        return self.rt.policy.lam * (1 - self.value + 2 * self.value * layer.index / last)


class Confident(Steering):
    """Prefetch only predictions whose next-layer router probability is at least tau."""

    spec_rule = False

    def __init__(self, runtime: Any, tau: float) -> None:
        super().__init__(runtime)
        self.tau = tau

    def predictions(self, layer: Any, residual: torch.Tensor) -> list[Prediction]:
        out = []
        for target, n, ids in super().predictions(layer, residual):
            nxt = self.rt.layers[target]
            h = pk.rms_norm_ref(residual, nxt.norm_weight, nxt.norm_eps)
            probs = torch.softmax(h @ nxt.gate_weight.float().t(), -1)
            kept = [[e for e in row if float(probs[i, e]) >= self.tau] for i, row in enumerate(ids)]
            out.append((target, n, kept))
        return out


class AheadTwo(Steering):
    """Also insert up to `a` experts predicted by the router of the MoE layer two ahead (on
    this layer's MoE input), after the next layer's own prediction: copies issued a layer
    earlier, at a lower recall."""

    spec_rule = False

    def __init__(self, runtime: Any, a: int) -> None:
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ValueError(f"ahead2 must be an int >= 0, got {a!r}")
        super().__init__(runtime)
        self.a = a

    def predictions(self, layer: Any, residual: torch.Tensor) -> list[Prediction]:
        out = super().predictions(layer, residual)
        ids2 = self.predict(layer, residual, 2, self.a)
        if ids2 is not None:
            out.append((layer.index + 2, self.a, ids2))
        return out


def apply_variant(model: Any, name: str, value: float) -> None:
    """Steer `model` by a variant (a Steering subclass; `renorm` replaces the routing op
    and decodes on the host step, where that op runs)."""
    rt = model.runtime
    if name == "renorm":
        route = rt.ops.route_counted  # what the host-driven decode step routes with

        def renorm_route(logits, spec, *, mask=None, **kw):
            w, ids, sub = route(logits, spec, mask=mask, **kw)
            if mask is None or spec.lam == 0:
                return w, ids, sub
            w0, _, _ = route(logits, dataclasses.replace(spec, lam=0.0), **kw)
            return w * (w0.sum(-1, keepdim=True) / w.sum(-1, keepdim=True)), ids, sub

        rt.ops = dataclasses.replace(rt.ops, route_counted=renorm_route)
        rt.set_decode("host")
    elif name == "lam_first":
        rt.set_steering(LamFirst(rt, value))
    elif name == "conf":
        rt.set_steering(Confident(rt, value))
    elif name == "ahead2":
        rt.set_steering(AheadTwo(rt, int(value)))
    elif name == "lam_ramp":
        rt.set_steering(LamRamp(rt, value))
    elif name not in ("psr", "wide"):
        raise ValueError(f"unknown variant {name!r}")


def measure(path: str, rho: float, lam: float, n: int, variant: str, value: float, data: EvalData):
    model = load(path, "psr", rho, lam=lam, n=n, dtype="float32", progress=False)
    apply_variant(model, variant, value)
    rec = model.record_trace()
    nll = perplexity_items(model, data.windows, data.prompt_len)
    stats = model.stats.report()
    model.close()
    label = {"psr": "", "wide": "wide "}.get(variant, f"{variant}({value:g}) ")
    label += f"psr(lam={lam:g}, n={n})"
    return {
        "config": RunConfig(make_policy("psr", lam, n), rho).as_dict() | {"variant": variant},
        "label": label,
        "variant": [variant, value],
        "stats": stats,
        "latency": {PROFILE: simulate(rec.trace, PROFILE).as_dict()},
        "generated": [],
        "nll_items": nll,
        "cloze_items": [],
    }


def exact(path: str, rho: float, data: EvalData) -> dict:
    model = load(path, "exact", rho, dtype="float32", progress=False)
    rec = model.record_trace()
    nll = perplexity_items(model, data.windows, data.prompt_len)
    r = {
        "config": RunConfig(make_policy("exact"), rho).as_dict(),
        "label": "exact",
        "stats": model.stats.report(),
        "latency": {PROFILE: simulate(rec.trace, PROFILE).as_dict()},
        "generated": [],
        "nll_items": nll,
        "cloze_items": [],
    }
    model.close()
    return r


# A variant is kept only if, on set B, it is within budget AND at least this much faster
# than the tuned point: a 0.1% modeled difference is a different trace, not a gain.
MIN_GAIN = 1.02

GRID = {
    "renorm": [(lam, n, 0.0) for lam in (0.1, 0.15, 0.2, 0.3) for n in (1, 2)],
    "lam_first": [(lam, n, f * lam) for lam, n in ((0.1, 2), (0.15, 2)) for f in (0.5, 2.0)],
    "conf": [(lam, 2, tau) for lam in (0.1, 0.15, 0.2) for tau in (0.05, 0.15)],
    "wide": [(lam, n, 0.0) for lam in (0.05, 0.1, 0.15) for n in (3, 4)],
    "ahead2": [(lam, n, a) for lam in (0.1, 0.15) for n, a in ((1, 1), (2, 1), (2, 2))],
    "lam_ramp": [(lam, 2, v) for lam in (0.1, 0.15) for v in (-0.5, 0.5)],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default="bench/results/variants")
    ap.add_argument("--residency", default="0.5,0.25")
    ap.add_argument("--windows", type=int, default=160)
    ap.add_argument(
        "--variants",
        default=",".join(GRID),
        help="comma-separated subset of GRID; a subset writes variants-<names>.md/json",
    )
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    if unknown := set(names) - GRID.keys():
        ap.error(f"unknown variants {sorted(unknown)}; choose from {sorted(GRID)}")
    stem = "variants" if names == list(GRID) else "variants-" + "-".join(names)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(windows=args.windows, window_tokens=160, prompt_tokens=32, prompts=0)
    data_a = EvalData.from_heldout(args.model, "A", **kw)
    data_b = EvalData.from_heldout(args.model, "B", **kw)
    report: dict[str, Any] = {"budget": BUDGET, "profile": PROFILE, "residencies": {}}
    lines = [
        "| residency | variant | point | A: Δ nats [95% CI] | A: speedup | B: Δ nats [95% CI] "
        "| B: speedup | kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rho in [float(x) for x in args.residency.split(",")]:
        ex_a = exact(args.model, rho, data_a)
        base = operating_points(args.model, rho)["psr"]
        rows = {"psr": [measure(args.model, rho, base.lam, base.n, "psr", 0.0, data_a)]}
        for variant in names:
            grid = GRID[variant]
            rows[variant] = [
                measure(args.model, rho, lam, n, variant, v, data_a) for lam, n, v in grid
            ]
            print(f"{pct(rho)} {variant}: {len(grid)} points on A", flush=True)
        for rs in rows.values():
            compare([ex_a, *rs], (PROFILE,))
        ex_b = exact(args.model, rho, data_b)
        base_b = measure(args.model, rho, base.lam, base.n, "psr", 0.0, data_b)
        compare([ex_b, base_b], (PROFILE,))
        res = {
            "A_exact_ms": ex_a["latency"][PROFILE]["ms_per_token"],
            "baseline_B": {k: base_b[k] for k in ("label", "delta_nll", "speedup")},
            "variants": {},
        }
        for variant, rs in rows.items():
            best = next(iter(choose(rs, rho, "psr", BUDGET, PROFILE)), None)
            entry = {"A": [{k: r[k] for k in ("label", "delta_nll", "speedup")} for r in rs]}
            if best is not None and variant != "psr":
                lam, n = best["config"]["lam"], best["config"]["n"]
                rb = measure(args.model, rho, lam, n, variant, best["variant"][1], data_b)
                compare([ex_b, rb], (PROFILE,))
                kept = (
                    within_budget(rb, BUDGET)
                    and rb["speedup"][PROFILE] >= MIN_GAIN * base_b["speedup"][PROFILE]
                )
                entry["B"] = {k: rb[k] for k in ("label", "delta_nll", "speedup")}
                entry["kept"] = kept
                d, e = best["delta_nll"], rb["delta_nll"]
                lines.append(
                    f"| {rho:.1%} | {variant} | {best['label']} | {d['mean']:+.4f} "
                    f"[{d['lo']:+.4f}, {d['hi']:+.4f}] | {best['speedup'][PROFILE]:.2f}x | "
                    f"{e['mean']:+.4f} "
                    f"[{e['lo']:+.4f}, {e['hi']:+.4f}] | {rb['speedup'][PROFILE]:.2f}x | "
                    f"{'yes' if kept else 'no'} |"
                )
            res["variants"][variant] = entry
        d = base_b["delta_nll"]
        lines.append(
            f"| {rho:.1%} | baseline | {base_b['label']} | (tuned) | | {d['mean']:+.4f} "
            f"[{d['lo']:+.4f}, {d['hi']:+.4f}] | {base_b['speedup'][PROFILE]:.2f}x | - |"
        )
        report["residencies"][f"{rho:g}"] = res
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
