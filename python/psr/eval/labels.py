"""What the reports, figures and runs share, importable by each of them without the
others (no torch, no matplotlib): how a residency and a configuration are named, whether
results carry quality, and the latency-quality Pareto front."""

from __future__ import annotations

import math
from typing import Any


def pct(rho: float) -> str:
    """A residency as people write it: 50%, 37.5%."""
    return f"{rho:.1%}".replace(".0%", "%")


def short_label(r: dict[str, Any]) -> str:
    """'psr λ0.1 n2', 'cache-prior λ0.05', 'exact-prefetch n1', 'exact', 'psr λ0.1 n2 int8'
    (a quantized expert format is named; the model's own is not)."""
    c = r["config"]
    # a steering variant of bench/variants.py is named by it (its baseline is not)
    v = c.get("variant")
    parts = [c["policy"] if v in (None, c["policy"]) else str(v)]
    if c.get("lam") is not None:
        parts.append(f"λ{c['lam']:g}")
    if c.get("n") is not None:
        parts.append(f"n{c['n']:g}")
    if c.get("expert_format") not in (None, "native"):
        parts.append(str(c["expert_format"]))
    return " ".join(parts)


def has_quality(results: list[dict[str, Any]]) -> bool:
    """Some result carries Δ nats/token (what the latency-quality figures need)."""
    return any("delta_nll" in r for r in results)


def pareto(points: list[tuple[float, float, Any]]) -> list[Any]:
    """Items of (latency, loss, item) not dominated (lower is better on both), by latency.

    A point is dropped when another is at most as high on both and strictly lower on one; of
    exact duplicates only the first given is kept. Points with a non-finite value are ignored.
    """
    finite = [p for p in points if math.isfinite(p[0]) and math.isfinite(p[1])]
    front, best = [], float("inf")
    for _lat, loss, item in sorted(finite, key=lambda p: (p[0], p[1])):
        if loss < best:
            front.append(item)
            best = loss
    return front
