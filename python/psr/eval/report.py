"""Reports of evaluation results: markdown tables, JSON files and PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from psr.eval.harness import DEFAULT_PROFILES


def markdown_table(
    results: list[dict[str, Any]], profiles: Sequence[str] = DEFAULT_PROFILES
) -> str:
    cols = ["residency", "policy", "misses/tok", "hit rate", "prefetch used"]
    cols += [f"{p} ms/tok" for p in profiles] + [f"speedup ({profiles[0]})", "greedy agree"]
    has_nll = any("delta_nll" in r for r in results)
    has_cloze = any("delta_cloze_pts" in r for r in results)
    if has_nll:
        cols.append("Δ nats/tok [95% CI]")
    if has_cloze:
        cols.append("Δ cloze pts [95% CI]")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        s = r["stats"]
        used = f"{s['prefetch_used_frac']:.2f}" if s["prefetches"] else "-"
        row = [
            f"{r['config']['residency']:.0%}",
            r["label"],
            f"{s['misses_per_token']:.2f}",
            f"{s['hit_rate']:.2f}",
            used,
        ]
        row += [f"{r['latency'][p]['ms_per_token']:.2f}" for p in profiles]
        row += [
            f"{r.get('speedup', {}).get(profiles[0], float('nan')):.2f}x",
            f"{r.get('greedy_agreement', float('nan')):.2f}",
        ]
        for key, on in (("delta_nll", has_nll), ("delta_cloze_pts", has_cloze)):
            if on:
                d = r.get(key)
                row.append(f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]" if d else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def save(
    results: list[dict[str, Any]],
    out: str | Path,
    name: str,
    extra: dict | None = None,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    traces: bool = False,
) -> dict[str, Path]:
    """Write `name.json` (+ traces optionally), `name.md` and `name.png` under `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k != "trace" or traces} for r in results]
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "png": out / f"{name}.png"}
    paths["json"].write_text(json.dumps({"results": slim, **(extra or {})}, indent=1))
    paths["md"].write_text(markdown_table(results, profiles) + "\n")
    plot(results, paths["png"], profiles)
    return paths


def plot(results: list[dict[str, Any]], path: Path, profiles: Sequence[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = sorted({r["config"]["residency"] for r in results}, reverse=True)
    has_q = any("delta_nll" in r for r in results)
    fig, axes = plt.subplots(1, 2 if has_q else 1, figsize=(12 if has_q else 7, 4.2), squeeze=False)
    ax = axes[0][0]
    labels = list(dict.fromkeys(r["label"] for r in results))
    width = 0.8 / max(len(res), 1)
    for i, rho in enumerate(res):
        ys = []
        for lab in labels:
            m = [r for r in results if r["label"] == lab and r["config"]["residency"] == rho]
            ys.append(m[0]["latency"][profiles[0]]["ms_per_token"] if m else 0)
        ax.bar([j + i * width for j in range(len(labels))], ys, width, label=f"{rho:.0%} resident")
    ax.set_xticks(
        [j + width * (len(res) - 1) / 2 for j in range(len(labels))],
        labels,
        rotation=20,
        ha="right",
        fontsize=8,
    )
    ax.set_ylabel(f"modeled ms / token ({profiles[0]})")
    ax.set_title("decode latency")
    ax.legend()
    if has_q:
        ax = axes[0][1]
        for rho in res:
            pts = [r for r in results if r["config"]["residency"] == rho and "delta_nll" in r]
            ax.scatter(
                [r["latency"][profiles[0]]["ms_per_token"] for r in pts],
                [r["delta_nll"]["mean"] for r in pts],
                label=f"{rho:.0%} resident",
            )
            front = pareto(
                [
                    (r["latency"][profiles[0]]["ms_per_token"], r["delta_nll"]["mean"], r)
                    for r in pts
                ]
            )
            ax.plot(
                [r["latency"][profiles[0]]["ms_per_token"] for r in front],
                [r["delta_nll"]["mean"] for r in front],
                lw=0.8,
                alpha=0.6,
            )
            for r in pts:
                ax.annotate(
                    r["label"],
                    (r["latency"][profiles[0]]["ms_per_token"], r["delta_nll"]["mean"]),
                    fontsize=6,
                )
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xlabel(f"modeled ms / token ({profiles[0]})")
        ax.set_ylabel("Δ nats / token vs exact")
        ax.set_title("latency vs quality (lines: Pareto fronts)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pareto(points: list[tuple[float, float, Any]]) -> list[Any]:
    """Items of (latency, loss, item) not dominated (lower is better on both)."""
    front, best = [], float("inf")
    for _lat, loss, item in sorted(points, key=lambda p: (p[0], p[1])):
        if loss < best:
            front.append(item)
            best = loss
    return front
