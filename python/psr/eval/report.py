"""Reports of evaluation results as text: markdown tables, JSON files, short labels.

Imports neither matplotlib nor torch: tables can be rendered wherever results can be read.
The figures (`name.png`, `name_frontier.png`) are drawn by `psr.eval.plots`, which `save`
imports only when it writes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from psr.eval.defaults import DEFAULT_PROFILES
from psr.eval.labels import has_quality, pct


def _jsonable_trace(t: Any) -> Any:
    return t.to_json() if hasattr(t, "to_json") else t


def has_host_aware(results: list[dict[str, Any]]) -> bool:
    """Some result carries host-aware modeled latency (`latency_host`)."""
    return any(r.get("latency_host") for r in results)


def has_graph(results: list[dict[str, Any]]) -> bool:
    """Some result carries the host-aware figure with the step captured (`latency_graph`)."""
    return any(r.get("latency_graph") for r in results)


def host_note(results: list[dict[str, Any]]) -> str:
    """What the tables' host-free and host-aware columns mean, naming the host models the
    results used ('' when none is host-aware)."""
    labels = sorted(
        {lat["host_model"] for r in results for lat in (r.get("latency_host") or {}).values()}
    )
    if not labels:
        return ""
    note = (
        "ms/tok (host-free): copies and compute only, the host free (the model every earlier "
        "psr figure used); ms/tok (host-aware): the same trace with each configuration's "
        "measured decode schedule replayed on one host thread that launches every kernel, "
        f"makes every sync and store call in order: {', '.join(labels)} "
        "(eager launch / Triton launch / sync), the host's own Python measured with the "
        "launches stubbed (bench/results/host_path/host_costs.md)"
    )
    if has_graph(results):
        note += (
            "; ms/tok (graph): the same device step captured, one CUDA graph replay per token "
            "(CUDA's default: the host pays the loop and one graph launch per token)"
        )
    firsts = [
        lat["first_token_ms"]
        for r in results
        for lat in (r.get("latency_host") or {}).values()
        if lat.get("first_token_ms")
    ]
    if firsts:
        note += (
            f"; a sequence's first decode token (eager, with the cache hand-over) is not in "
            f"ms/tok: {min(firsts):.2f}-{max(firsts):.2f} ms modeled"
        )
    return note + (
        ". The headline speedup is the first speedup column (host-free, as every earlier "
        "psr figure)"
    )


def _ms(lat: dict[str, Any], profiles: Sequence[str]) -> list[str]:
    """ms/token cells of one result's latency dict, "-" for a profile it lacks."""
    return [f"{lat[p]['ms_per_token']:.2f}" if p in lat else "-" for p in profiles]


def markdown_table(
    results: list[dict[str, Any]], profiles: Sequence[str] = DEFAULT_PROFILES
) -> str:
    host = has_host_aware(results)
    p0 = profiles[0]
    cols = ["residency", "policy", "misses/tok", "hit rate", "prefetch used"]
    cols += [f"{p} ms/tok (host-free)" for p in profiles]
    graph = has_graph(results)
    if host:
        cols += [f"{p} ms/tok (host-aware)" for p in profiles]
    if graph:
        cols += [f"{p} ms/tok (graph)" for p in profiles]
    cols += [f"speedup ({p0}, host-free)"]
    if host:
        cols += [f"speedup ({p0}, host-aware)"]
    if graph:
        cols += [f"speedup ({p0}, graph)"]
    cols += ["subst. rate", "greedy agree"]
    has_nll = has_quality(results)
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
            pct(r["config"]["residency"]),
            r["label"],
            f"{s['misses_per_token']:.2f}",
            f"{s['hit_rate']:.2f}",
            used,
        ]
        row += [f"{r['latency'][p]['ms_per_token']:.2f}" for p in profiles]
        for key, on in (("latency_host", host), ("latency_graph", graph)):
            if on:
                row += _ms(r.get(key) or {}, profiles)
        speedups = [r.get("speedup", {})] + ([r.get("speedup_host", {})] if host else [])
        speedups += [r.get("speedup_graph", {})] if graph else []
        row += [f"{sp[p0]:.2f}x" if p0 in sp else "-" for sp in speedups]
        # results written before the count have no rate: "-"
        sub = s.get("substitution_rate")
        row.append(f"{sub:.3f}" if sub is not None else "-")
        row.append(f"{r['greedy_agreement']:.2f}" if r.get("greedy_agreement") is not None else "-")
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
    extra: dict[str, Any] | None = None,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    traces: bool = False,
    *,
    budget: float | None = 0.01,
    appendix: str = "",
) -> dict[str, Path]:
    """Write `name.json` (+ traces optionally), `name.md` and `name.png` under `out`, and
    `name_frontier.png` (key "frontier") when the results carry Δ nats/token."""
    from psr.eval import plots  # matplotlib: only when figures are written

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    slim = [
        {k: (_jsonable_trace(v) if k == "trace" else v) for k, v in r.items()}
        if traces
        else {k: v for k, v in r.items() if k != "trace"}
        for r in results
    ]
    for r in slim:
        r.pop("mode_starts", None)  # the cpu / hybrid replays' input, not a result
        r.pop("mode_traces", None)  # the recorded modes' traces (the modes table's input)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "png": out / f"{name}.png"}
    paths["json"].write_text(json.dumps({"results": slim, **(extra or {})}, indent=1))
    note = host_note(results)
    paths["md"].write_text(
        markdown_table(results, profiles)
        + "\n"
        + (f"\n{note}\n" if note else "")
        + (f"\n{appendix}\n" if appendix else "")
    )
    plots.plot(results, paths["png"], profiles, budget=budget)
    if has_quality(results):
        paths["frontier"] = out / f"{name}_frontier.png"
        plots.plot_frontier(results, paths["frontier"], profiles[0], budget=budget)
    return paths
