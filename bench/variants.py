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
On the spec's Cache-Prior or PSR (CacheRouting; docs/design.md, Evaluation):
  cp_paper   Cache-Prior as its paper defines it: the bias scaled by the running average
             of the layer's score spread over the sequence's decode tokens, not the
             token's own;
  cp_guard, cp_paper_guard, psr_guard
             the router's own top J (= v) experts never displaced by the bias.
Every configuration is scored on held-out set A (selection) with the powered harness;
per residency and variant, the fastest point within the budget (95% upper bound) is then
re-measured on set B beside the tuned point of the policy it changes (PSR, or Cache-Prior
for the cp_ variants). A variant is kept only if it is at least 2% faster than that
baseline on B at a cost still within budget. Results: variants.md/json (the spec-rule
variants), variants-<names>.md/json for another set (--variants).

    python bench/variants.py --variants cp_paper,cp_guard,psr_guard --residency 0.5 --windows 48
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
from psr.eval.labels import pct
from psr.eval.latency import simulate
from psr.eval.quality import perplexity_items
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


def selection_scores(
    logits: torch.Tensor, spec: pk.RouteSpec, bias: torch.Tensor | None
) -> torch.Tensor:
    """The scores the routing op ranks and takes the spread `D` of (psr_kernels.routing,
    stage 2): sigmoid scores plus the correction bias, softmax probabilities plus the
    bias for a biased softmax router (ERNIE), else the logits."""
    x = logits.float()
    if spec.scoring == "sigmoid":
        return torch.sigmoid(x) + (0.0 if bias is None else bias.float())
    if spec.scoring == "softmax" and bias is not None:
        return torch.softmax(x, -1) + bias.float()
    return x


class CacheRouting(Steering):
    """Cache-Prior as its paper defines it and / or a top-J guard, on the spec's policies,
    through the routing op (`install` wraps the runtime's `route_counted`):

      paper_range  the bias is `lam * Delta * m` with `Delta` the running average of the
                   layer's selection-score spread (max - min) over this sequence's decode
                   tokens so far, the current one included (Skliar et al., arXiv
                   2412.00099; docs/design.md), instead of the token's own spread `D`.
                   The op is handed `lam * Delta / D`, so its bias is `lam * Delta * m`;
                   weights stay the router's own (re-ranking only), as in the spec.
      guard = J    the router's own top J experts are never displaced: they are added to
                   the mask, so each has at most J - 1 experts above it after the bias
                   (cached ones rise by the same amount), and the other k - J slots go to
                   the best biased scores of the rest, as without the guard.

    Routing per decode token: the scoring window and the host step both call `lam(layer)`
    before a layer's decode routings (the window once for its tokens, in order), so the
    op's calls that follow are that layer's. A new sequence gets a new `layer.history`
    list (the runtime's `_forget_sequence`), which restarts the average: it is
    deterministic and the same between teacher-forced scoring and token-by-token
    decoding."""

    spec_rule = False

    def __init__(self, runtime: Any, *, paper_range: bool, guard: int) -> None:
        if isinstance(guard, bool) or not isinstance(guard, int) or guard < 0:
            raise ValueError(f"guard must be an int >= 0, got {guard!r}")
        super().__init__(runtime)
        k = runtime.spec.top_k
        if guard > k:
            raise ValueError(f"guard={guard} exceeds the router's top_k={k}")
        if guard and runtime.spec.n_group > 1:
            # Biasing the guarded experts raises their groups' scores: the group limit
            # could then differ from the guard's definition.
            raise ValueError("the top-J guard does not support group-limited routers")
        self.paper_range, self.guard = paper_range, guard
        self._layer: Any = None
        # MoE layer -> (the sequence's history list, sum of spreads, decode tokens)
        self._ranges: dict[int, tuple[list[list[int]], float, int]] = {}
        self._route = self._exact = None

    def install(self) -> None:
        """Steer the runtime by this rule: its steering and its decode routing op."""
        rt = self.rt
        self._route, self._exact = rt.ops.route_counted, rt.ops.route
        rt.set_steering(self)
        rt.ops = dataclasses.replace(rt.ops, route_counted=self.route_counted)

    def lam(self, layer: Any) -> float:
        self._layer = layer  # the op's next calls route this layer
        return self.rt.policy.lam

    def delta(self, layer: Any, spread: float) -> float:
        """Fold this decode token's spread into the layer's running average; return it."""
        seq, total, n = self._ranges.get(layer.index, (None, 0.0, 0))
        if seq is not layer.history:  # a new sequence
            total, n = 0.0, 0
        total, n = total + spread, n + 1
        self._ranges[layer.index] = (layer.history, total, n)
        return total / n

    def route_counted(
        self, logits: torch.Tensor, spec: pk.RouteSpec, *, mask=None, bias=None, **kw
    ):
        assert self._route is not None and self._exact is not None, "call install() first"
        if mask is None or spec.lam == 0:
            return self._route(logits, spec, mask=mask, bias=bias, **kw)
        if logits.shape[0] != 1:
            raise ValueError(
                f"{type(self).__name__} routes one decode token per call, got {logits.shape[0]}"
            )
        L = self._layer
        if self.paper_range:
            z = selection_scores(logits, spec, bias)[0]
            spread = float(z.max() - z.min())
            if not spread > 0:
                raise ValueError(
                    f"MoE layer {L.index}: the selection scores have no spread ({spread}); "
                    "the running-average range cannot be expressed through the op's lam"
                )
            spec = dataclasses.replace(spec, lam=spec.lam * self.delta(L, spread) / spread)
        if self.guard:
            _, ids0 = self._exact(logits, dataclasses.replace(spec, lam=0.0), bias=bias, **kw)
            mask = mask.reshape(1, -1).clone()
            mask[0, ids0[0, : self.guard]] = True
        return self._route(logits, spec, mask=mask, bias=bias, **kw)


# Variants on the spec's Cache-Prior or PSR: (policy family, paper_range, guarded).
CACHE_ROUTING = {
    "cp_paper": ("cache-prior", True, False),
    "cp_guard": ("cache-prior", False, True),
    "cp_paper_guard": ("cache-prior", True, True),
    "psr_guard": ("psr", False, True),
}


def family_of(variant: str) -> str:
    """The spec's policy a variant changes (its baseline is that policy's tuned point)."""
    return CACHE_ROUTING[variant][0] if variant in CACHE_ROUTING else "psr"


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
    elif name in CACHE_ROUTING:
        _, paper, guarded = CACHE_ROUTING[name]
        if guarded and value < 1:
            raise ValueError(f"{name} needs a guard J >= 1, got {value:g}")
        CacheRouting(rt, paper_range=paper, guard=int(value) if guarded else 0).install()
    elif name not in ("psr", "wide", "cache-prior"):
        raise ValueError(f"unknown variant {name!r}")


def measure(path: str, rho: float, lam: float, n: int, variant: str, value: float, data: EvalData):
    fam = variant if variant in ("psr", "cache-prior") else family_of(variant)
    policy = make_policy(fam, lam, n if fam == "psr" else None)
    model = load(path, policy, rho, dtype="float32", progress=False)
    apply_variant(model, variant, value)
    rec = model.record_trace()
    nll = perplexity_items(model, data.windows, data.prompt_len)
    stats = model.stats.report()
    model.close()
    lat = simulate(rec.trace, PROFILE)
    base = variant in ("psr", "cache-prior")
    label = "" if base else {"wide": "wide "}.get(variant, f"{variant}({value:g}) ")
    label += policy.describe()
    return {
        "config": RunConfig(policy, rho).as_dict() | {"variant": variant},
        "label": label,
        "variant": [variant, value],
        "stats": stats,
        "latency": {PROFILE: lat.as_dict()},
        "token_ms": lat.per_token_ms,  # per decode token, windows in order
        "generated": [],
        "nll_items": nll,
        "cloze_items": [],
    }


def exact(path: str, rho: float, data: EvalData) -> dict:
    model = load(path, "exact", rho, dtype="float32", progress=False)
    rec = model.record_trace()
    nll = perplexity_items(model, data.windows, data.prompt_len)
    lat = simulate(rec.trace, PROFILE)
    r = {
        "config": RunConfig(make_policy("exact"), rho).as_dict(),
        "label": "exact",
        "stats": model.stats.report(),
        "latency": {PROFILE: lat.as_dict()},
        "token_ms": lat.per_token_ms,
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
    # (lam, n, J): the guard lets lam rise past the unguarded budget edge
    "cp_paper": [(lam, 0, 0.0) for lam in (0.05, 0.1)],
    "cp_guard": [(lam, 0, 2.0) for lam in (0.05, 0.1, 0.15)],
    "cp_paper_guard": [(lam, 0, 2.0) for lam in (0.1, 0.15)],
    "psr_guard": [(lam, 2, 2.0) for lam in (0.1, 0.15, 0.2)],
}
# The variants of the spec's rule the first runs measured (the default of --variants).
SPEC_VARIANTS = ["renorm", "lam_first", "conf", "wide", "ahead2", "lam_ramp"]


def summary(r: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of a measured point."""
    out = {k: r[k] for k in ("label", "delta_nll", "speedup")}
    return out | {"substitution_rate": r["stats"].get("substitution_rate")}


def _ci(d: dict[str, float]) -> str:
    return f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]"


def row(rho: float, name: str, a: dict[str, Any] | None, b: dict[str, Any], kept: str) -> str:
    """A table row: the point chosen on A (None: a tuned baseline) and its B replication."""
    rate = b["stats"].get("substitution_rate")
    a_cols = "(tuned) | " if a is None else f"{_ci(a['delta_nll'])} | {a['speedup'][PROFILE]:.2f}x"
    return (
        f"| {rho:.1%} | {name} | {(a or b)['label']} | {a_cols} | {_ci(b['delta_nll'])} | "
        f"{b['speedup'][PROFILE]:.2f}x | {'-' if rate is None else f'{rate:.3f}'} | {kept} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default="bench/results/variants")
    ap.add_argument("--residency", default="0.5,0.25")
    ap.add_argument("--windows", type=int, default=160)
    ap.add_argument(
        "--variants",
        default=",".join(SPEC_VARIANTS),
        help="comma-separated names from GRID (default: the spec-rule variants); another "
        "set writes variants-<names>.md/json",
    )
    ap.add_argument("--lams", default=None, help="only the GRID points at these lams (a,b,...)")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    if args.lams is not None:
        keep = {float(x) for x in args.lams.split(",")}
        GRID.update({v: [p for p in GRID[v] if p[0] in keep] for v in names if v in GRID})
    if unknown := set(names) - GRID.keys():
        ap.error(f"unknown variants {sorted(unknown)}; choose from {sorted(GRID)}")
    stem = "variants" if names == SPEC_VARIANTS else "variants-" + "-".join(names)
    stem += "" if args.lams is None else "-lam" + "-".join(args.lams.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(windows=args.windows, window_tokens=160, prompt_tokens=32, prompts=0)
    data_a = EvalData.from_heldout(args.model, "A", **kw)
    data_b = EvalData.from_heldout(args.model, "B", **kw)
    report: dict[str, Any] = {"budget": BUDGET, "profile": PROFILE, "residencies": {}}
    lines = [
        "| residency | variant | point | A: Δ nats [95% CI] | A: speedup | B: Δ nats [95% CI] "
        "| B: speedup | B: subst. rate | kept |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rho in [float(x) for x in args.residency.split(",")]:
        ex_a = exact(args.model, rho, data_a)
        points = operating_points(args.model, rho)
        fams = list(dict.fromkeys(family_of(v) for v in names))
        rows = {
            f: [measure(args.model, rho, points[f].lam, points[f].n, f, 0.0, data_a)] for f in fams
        }
        for variant in names:
            grid = GRID[variant]
            rows[variant] = [
                measure(args.model, rho, lam, n, variant, v, data_a) for lam, n, v in grid
            ]
            print(f"{pct(rho)} {variant}: {len(grid)} points on A", flush=True)
        for rs in rows.values():
            compare([ex_a, *rs], (PROFILE,))
        ex_b = exact(args.model, rho, data_b)
        base_b = {
            f: measure(args.model, rho, points[f].lam, points[f].n, f, 0.0, data_b) for f in fams
        }
        compare([ex_b, *base_b.values()], (PROFILE,))
        res = {
            "A_exact_ms": ex_a["latency"][PROFILE]["ms_per_token"],
            "baseline_B": {f: summary(b) for f, b in base_b.items()},
            "variants": {},
        }
        for variant, rs in rows.items():
            if variant in fams:
                res["variants"][variant] = {"A": [summary(r) for r in rs]}
                continue
            fam = family_of(variant)
            best = next(iter(choose(rs, rho, fam, BUDGET, PROFILE)), None)
            entry: dict[str, Any] = {"family": fam, "A": [summary(r) for r in rs]}
            if best is not None:
                lam, n = best["config"]["lam"], best["config"]["n"]
                rb = measure(args.model, rho, lam, n, variant, best["variant"][1], data_b)
                compare([ex_b, rb], (PROFILE,))
                kept = (
                    within_budget(rb, BUDGET)
                    and rb["speedup"][PROFILE] >= MIN_GAIN * base_b[fam]["speedup"][PROFILE]
                )
                entry["B"] = summary(rb)
                entry["kept"] = kept
                lines.append(row(rho, variant, best, rb, "yes" if kept else "no"))
            else:
                lines.append(f"| {rho:.1%} | {variant} | (none within budget on A) | | | | | | - |")
            res["variants"][variant] = entry
        for f, b in base_b.items():
            lines.append(row(rho, f"baseline ({f})", None, b, "-"))
        report["residencies"][f"{rho:g}"] = res
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
