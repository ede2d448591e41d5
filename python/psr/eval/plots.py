"""Figures of evaluation results, drawn with matplotlib's object API on the Agg canvas (no
pyplot state, no backend switch); the tables and JSON files are `psr.eval.report`'s.

* `plot` (`name.png`): modeled host-free ms/token per policy as horizontal bars grouped by
  residency, the speedup vs exact written on each bar; beside it, when the results carry
  Δ nats/token, the latency-quality frontier panel.
* `plot_frontier` (`name_frontier.png`): two panels, modeled host-free ms/token and expert
  misses/token against Δ nats/token vs exact with 95% CI error bars, a Pareto front per
  residency (step line through its non-dominated points, ringed), a vertical line at Δ = 0
  and the quality budget.

Only the points on a front are labelled; labels are placed greedily where they overlap no
marker and no other label, and when that is impossible the figure switches to numbers with a
numbered key beneath the panels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from psr.eval.defaults import DEFAULT_PROFILES
from psr.eval.labels import has_quality, pareto, pct, short_label

# Policy families, their markers and the residency colours shared by every figure.
FAMILIES = ("exact", "exact-prefetch", "cache-prior", "psr", "other")
MARKERS = {"exact": "s", "exact-prefetch": "D", "cache-prior": "^", "psr": "o", "other": "P"}
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
DPI = 120
WIDTH_IN = 13.0  # 1560 px at DPI
DELTA_LABEL = "Δ nats/token vs exact (95% CI; lower is better)"
_KEY_HEAD_IN, _KEY_COL_IN, _KEY_LINE_IN = 1.2, 1.6, 0.19  # the numbered key's layout, inches
# Label offsets (direction x, direction y, radius in points), nearest first; a leader line
# is drawn beyond _LEADER_PT, and labels further than _CLEAN_PT switch the figure to numbers.
_LEADER_PT, _CLEAN_PT = 10, 24
_DIRS = ((1, 0), (1, 1), (1, -1), (-1, 0), (-1, 1), (-1, -1), (0, 1), (0, -1))
_DIRS += ((1, 0.5), (1, -0.5), (-1, 0.5), (-1, -0.5))
_CANDIDATES = [(dx, dy, rad) for rad in (9, 16, 25, 35, 46, 60) for dx, dy in _DIRS]


def plot(
    results: list[dict[str, Any]],
    path: str | Path,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    *,
    budget: float | None = 0.01,
) -> Path:
    """Write `overview_figure` (bars + latency-quality panel on `profiles[0]`) to `path`."""
    return _write(overview_figure(results, profiles[0], budget=budget), path)


def plot_frontier(
    results: list[dict[str, Any]],
    path: str | Path,
    profile: str = DEFAULT_PROFILES[0],
    *,
    budget: float | None = 0.01,
    xscale: str = "auto",
) -> Path:
    """Write `frontier_figure` (ms/token and misses/token vs Δ nats/token) to `path`."""
    return _write(frontier_figure(results, profile, budget=budget, xscale=xscale), path)


def _quantized(r: dict[str, Any]) -> bool:
    return r["config"].get("expert_format") not in (None, "native")


def family(r: dict[str, Any]) -> str:
    p = r["config"]["policy"]
    return p if p in FAMILIES else "other"


def overview_figure(
    results: list[dict[str, Any]],
    profile: str = DEFAULT_PROFILES[0],
    *,
    budget: float | None = 0.01,
    xscale: str = "auto",
):
    """Bars of modeled ms/token per policy grouped by residency (speedup vs exact on each
    bar) and, when the results carry Δ nats/token, the latency-quality frontier panel."""
    from matplotlib.gridspec import GridSpec

    quality = has_quality(results)
    rows = len(results) + len(_residencies(results))
    row_in = max(0.13, min(0.26, 10.0 / rows))  # long lists get thinner rows
    height = max(4.8, row_in * rows + 1.9)
    fig = _figure(WIDTH_IN if quality else 10.0, height)
    gs = GridSpec(1, 2 if quality else 1, figure=fig, width_ratios=[1, 1.25] if quality else [1])
    ax = fig.add_subplot(gs[0, 0])
    _bars(ax, results, profile, fontsize=min(8.5, max(6.5, 33 * row_in)))
    panels = []
    if quality:
        qax = fig.add_subplot(gs[0, 1])
        fronts = _frontier_panel(qax, results, profile, "ms", budget, xscale)
        panels.append((qax, "ms", profile, fronts))
    title = f"psr: modeled decode latency on {profile} (host-free)"
    _finish(fig, results, panels, budget, title + (" and its quality cost" if quality else ""))
    return fig


def frontier_figure(
    results: list[dict[str, Any]],
    profile: str = DEFAULT_PROFILES[0],
    *,
    budget: float | None = 0.01,
    xscale: str = "auto",
):
    """Two panels: modeled ms/token on `profile` and expert misses/token against Δ nats/token
    vs exact, per residency (colour) and policy family (marker), 95% CI error bars, and each
    residency's Pareto front (lower both is better) as a step line through its points."""
    # Taller when the fronts are long, so that the labels fit beside their points.
    n = max((len(_front_all(results, m, profile)) for m in ("ms", "misses")), default=0)
    fig = _figure(WIDTH_IN, min(max(5.6, 4.0 + 0.17 * n), 8.0))
    axes = fig.subplots(1, 2)
    panels = [
        (ax, metric, profile, _frontier_panel(ax, results, profile, metric, budget, xscale))
        for ax, metric in zip(axes, ("ms", "misses"), strict=True)
    ]
    title = (
        f"psr quality-latency frontier on {profile}: cost vs Δ nats/token "
        "(lines: Pareto front per residency)"
    )
    _finish(fig, results, panels, budget, title)
    return fig


def _front_all(results: list[dict[str, Any]], metric: str, profile: str) -> list[dict[str, Any]]:
    """The points on some residency's front of `metric` vs Δ nats/token."""
    out = []
    for rho in _residencies(results):
        pts = [r for r in results if r["config"]["residency"] == rho and "delta_nll" in r]
        out += pareto([(_value(r, metric, profile), r["delta_nll"]["mean"], r) for r in pts])
    return out


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _write(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path


def _residencies(results: list[dict[str, Any]]) -> list[float]:
    return sorted({r["config"]["residency"] for r in results}, reverse=True)


def _colors(results: list[dict[str, Any]]) -> dict[float, str]:
    return {rho: COLORS[i % len(COLORS)] for i, rho in enumerate(_residencies(results))}


def _value(r: dict[str, Any], metric: str, profile: str) -> float:
    if metric == "ms":
        return float(r["latency"][profile]["ms_per_token"])
    return float(r["stats"]["misses_per_token"])


def _speedup(r: dict[str, Any], results: list[dict[str, Any]], profile: str) -> float | None:
    sp = r.get("speedup", {}).get(profile)
    if sp is not None:
        return float(sp)
    rho = r["config"]["residency"]
    ref = [
        x for x in results if x["config"]["policy"] == "exact" and x["config"]["residency"] == rho
    ]
    return _value(ref[0], "ms", profile) / _value(r, "ms", profile) if ref else None


def _bars(ax, results: list[dict[str, Any]], profile: str, fontsize: float = 8.5) -> None:
    """Horizontal bars, one block per residency (a bold header row above each block)."""
    colors = _colors(results)
    ticks, labels, heads, y = [], [], [], 0.0
    top = max((_value(r, "ms", profile) for r in results), default=1.0)
    for rho in _residencies(results):
        ticks.append(y)
        labels.append(f"{pct(rho)} resident")
        heads.append(len(ticks) - 1)
        y += 1
        for r in (r for r in results if r["config"]["residency"] == rho):
            ms = _value(r, "ms", profile)
            ax.barh(y, ms, 0.72, color=colors[rho], alpha=0.85)
            sp = _speedup(r, results, profile)
            text = f"{ms:.2f} ms" + (f"  {sp:.2f}×" if sp is not None else "")
            ax.text(ms + top * 0.01, y, text, va="center", ha="left", fontsize=fontsize - 0.5)
            ticks.append(y)
            labels.append(short_label(r))
            y += 1
        y += 0.4
    ax.set_yticks(ticks, labels, fontsize=fontsize)
    for i in heads:
        lab = ax.get_yticklabels()[i]
        lab.set_fontweight("bold")
        lab.set_color(colors[_residencies(results)[heads.index(i)]])
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(y - 0.4, -0.8)
    ax.set_xlim(0, top * 1.3)
    ax.set_xlabel(f"modeled ms/token on {profile}, host-free (lower is better)")
    ax.set_title(f"decode latency, speedup vs exact at the same residency ({profile})", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def _frontier_panel(
    ax,
    results: list[dict[str, Any]],
    profile: str,
    metric: str,
    budget: float | None,
    xscale: str = "auto",
) -> dict[float, list[dict[str, Any]]]:
    """Scatter `metric` against Δ nats/token with CI bars; returns each residency's front."""
    colors = _colors(results)
    fronts: dict[float, list[dict[str, Any]]] = {}
    for rho in _residencies(results):
        pts = [r for r in results if r["config"]["residency"] == rho and "delta_nll" in r]
        _scatter_points(ax, pts, rho, colors[rho], metric, profile)
        fronts[rho] = _draw_front(ax, pts, rho, colors[rho], metric, profile)
    ax.axvline(0.0, color="0.3", lw=0.9, zorder=1)
    if budget is not None:
        ax.axvline(budget, color="0.3", lw=0.9, ls="--", zorder=1)
        ax.update_datalim([(budget, ax.dataLim.y0)])
    _set_xscale(ax, results, budget, xscale)
    ax.margins(x=0.1, y=0.1)
    ax.autoscale_view()
    x0, x1 = ax.get_xlim()
    y0, y1 = ax.get_ylim()
    if budget is not None and budget < x1:  # grey out what is over the budget
        ax.axvspan(budget, x1, color="0.5", alpha=0.1, lw=0, zorder=0)
    for rho, front in fronts.items():
        _front_tails(ax, front, rho, colors[rho], metric, profile, (x1, y1))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    _label_frontier_axes(ax, metric, profile)
    return fronts


def _scatter_points(
    ax, pts: list[dict[str, Any]], rho: float, color: str, metric: str, profile: str
) -> None:
    """A residency's points per family, with their Δ's 95% interval as x error bars
    (quantized expert copies: hollow markers)."""
    for fam in FAMILIES:
        for quant in (False, True):
            sel = [r for r in pts if family(r) == fam and _quantized(r) == quant]
            if not sel:
                continue
            d = [r["delta_nll"] for r in sel]
            ax.errorbar(
                [x["mean"] for x in d],
                [_value(r, metric, profile) for r in sel],
                xerr=[
                    [max(x["mean"] - x["lo"], 0.0) for x in d],
                    [max(x["hi"] - x["mean"], 0.0) for x in d],
                ],
                fmt=MARKERS[fam],
                color=color,
                ms=6,
                mfc="white" if quant else color,
                mec=color if quant else "white",
                mew=1.2 if quant else 0.6,
                elinewidth=0.9,
                ecolor=color,
                capsize=2,
                alpha=0.9,
                zorder=3,
                gid=f"points:{rho:g}:{fam}{':quantized' if quant else ''}",
            )


def _draw_front(
    ax, pts: list[dict[str, Any]], rho: float, color: str, metric: str, profile: str
) -> list[dict[str, Any]]:
    """A residency's Pareto front (lower `metric`, lower Δ) as a step line; returns it,
    ordered by Δ."""
    front = pareto([(_value(r, metric, profile), r["delta_nll"]["mean"], r) for r in pts])
    front.sort(key=lambda r: r["delta_nll"]["mean"])
    ax.plot(
        [r["delta_nll"]["mean"] for r in front],
        [_value(r, metric, profile) for r in front],
        color=color,
        lw=1.6,
        drawstyle="steps-post",
        marker="o",
        ms=12,
        mfc="none",
        mew=1.2,
        zorder=2,
        gid=f"pareto-front:{rho:g}",
    )
    return front


def _front_tails(
    ax,
    front: list[dict[str, Any]],
    rho: float,
    color: str,
    metric: str,
    profile: str,
    corner: tuple[float, float],
) -> None:
    """The front's open ends, dashed to the axes' far `corner` (x1, y1): up from its first
    point, right from its last (everything above and to the right of the line is
    dominated)."""
    if not front:
        return
    a, b = front[0], front[-1]
    x1, y1 = corner
    ax.plot(
        [a["delta_nll"]["mean"]] * 2,
        [_value(a, metric, profile), y1],
        [b["delta_nll"]["mean"], x1],
        [_value(b, metric, profile)] * 2,
        color=color,
        lw=1.0,
        ls=(0, (5, 3)),
        alpha=0.7,
        zorder=2,
        gid=f"pareto-tail:{rho:g}",
    )


def _label_frontier_axes(ax, metric: str, profile: str) -> None:
    ax.set_xlabel(DELTA_LABEL)
    if metric == "ms":
        ax.set_ylabel(f"modeled ms/token on {profile}, host-free")
        ax.set_title(f"modeled decode latency ({profile}, host-free) vs quality", fontsize=10)
    else:
        ax.set_ylabel("expert misses/token")
        ax.set_title("expert misses vs quality", fontsize=10)
    ax.grid(alpha=0.25)


def _legend_handles(results: list[dict[str, Any]], budget: float | None, quality: bool):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    colors = _colors(results)
    h = [Patch(color=c, label=f"{pct(rho)} resident") for rho, c in colors.items()]
    fams = [f for f in FAMILIES if any(family(r) == f for r in results)]
    if not quality:
        return h
    h += [Line2D([], [], ls="none", marker=MARKERS[f], color="0.35", label=f) for f in fams]
    if any(_quantized(r) for r in results):
        h.append(
            Line2D([], [], ls="none", marker="o", mfc="white", mec="0.35", label="quantized copies")
        )
    h.append(
        Line2D(
            [],
            [],
            color="0.35",
            marker="o",
            ms=10,
            mfc="none",
            drawstyle="steps-post",
            label="Pareto front",
        )
    )
    h.append(Line2D([], [], color="0.3", lw=0.9, label="Δ = 0 (exact)"))
    if budget is not None:
        h.append(Patch(fc="0.9", ec="0.3", ls="--", label=f"over budget (Δ > {budget:g})"))
    return h


def _finish(fig, results, panels, budget: float | None, title: str) -> None:
    """Title and legend rows on top, tight layout, front labels (or numbers + a key beneath)."""
    sup = fig.suptitle(title, fontsize=12, va="top", y=1 - 0.1 / fig.get_figheight())
    sup.set_in_layout(False)
    handles = _legend_handles(results, budget, bool(panels))
    leg_rows = 1 if len(handles) <= 10 else 2
    top_in = 0.5 + 0.22 * leg_rows  # suptitle + legend rows, inches
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.4 / fig.get_figheight()),
        ncol=math.ceil(len(handles) / leg_rows),
        fontsize=8.5,
        frameon=False,
        handlelength=1.8,
        columnspacing=1.4,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - top_in / fig.get_figheight()))
    if not panels:
        return
    entries = _front_entries(panels)
    if all(_label_panel(fig, results, *p, entries, numbered=False) for p in panels):
        return
    # Labels do not fit: number the front points and write the key beneath the panels.
    for ax, *_ in panels:
        for t in [t for t in ax.texts if t.get_gid() == "front-label"]:
            t.remove()
    rows = _key_rows(fig, entries)
    key_in = 0.35 + _KEY_LINE_IN * rows
    h = fig.get_figheight()
    fig.set_size_inches(fig.get_figwidth(), h + key_in)
    h += key_in
    fig.legends[0].set_bbox_to_anchor((0.5, 1 - 0.4 / h))
    sup.set_y(1 - 0.1 / h)
    fig.tight_layout(rect=(0, key_in / h, 1, 1 - top_in / h))
    for p in panels:
        _label_panel(fig, results, *p, entries, numbered=True)
    _key(fig, results, entries, key_in)


def _front_entries(panels) -> dict[int, tuple[int, dict[str, Any]]]:
    """id(result) -> (number, result) for every point on some front, by residency and Δ."""
    seen: dict[int, dict[str, Any]] = {}
    for *_, fronts in panels:
        for front in fronts.values():
            for r in front:
                seen[id(r)] = r
    order = sorted(seen.values(), key=lambda r: (-r["config"]["residency"], r["delta_nll"]["mean"]))
    return {id(r): (i + 1, r) for i, r in enumerate(order)}


def _by_residency(entries) -> dict[float, list[tuple[int, dict[str, Any]]]]:
    out: dict[float, list[tuple[int, dict[str, Any]]]] = {}
    for num, r in sorted(entries.values(), key=lambda e: e[0]):
        out.setdefault(r["config"]["residency"], []).append((num, r))
    return out


def _key_per_row(fig) -> int:
    return max(2, int((fig.get_figwidth() - _KEY_HEAD_IN) // _KEY_COL_IN))


def _key_rows(fig, entries) -> int:
    n = _key_per_row(fig)
    return sum(math.ceil(len(v) / n) for v in _by_residency(entries).values())


def _key(fig, results, entries, key_in: float) -> None:
    """The numbered key beneath the panels: a block of rows per residency."""
    colors = _colors(results)
    w, h = fig.get_figwidth(), fig.get_figheight()
    n = _key_per_row(fig)
    line = _KEY_LINE_IN / h
    y = (key_in - 0.22) / h
    fig.text(0.1 / w, y + 0.04 / h, "Pareto-front points by number:", fontsize=8.5, va="bottom")
    for rho, items in _by_residency(entries).items():
        fig.text(
            0.1 / w,
            y,
            f"{pct(rho)} resident",
            fontsize=8.5,
            va="top",
            color=colors[rho],
            fontweight="bold",
        )
        for i, (num, r) in enumerate(items):
            fig.text(
                (_KEY_HEAD_IN + (i % n) * _KEY_COL_IN) / w,
                y - (i // n) * line,
                f"{num:>2}  {short_label(r)}",
                fontsize=8.5,
                va="top",
                color=colors[rho],
            )
        y -= math.ceil(len(items) / n) * line


def _label_panel(fig, results, ax, metric, profile, fronts, entries, *, numbered: bool) -> bool:
    """Annotate each front point of `ax` with its short label (or number) at a place that
    overlaps no marker and no other label and whose leader line crosses neither (greedy, nearest
    place first, in a few orders); True when every label found one within `_CLEAN_PT` points."""
    from matplotlib.font_manager import FontProperties

    renderer = fig.canvas.get_renderer()
    colors = _colors(results)
    px = fig.dpi / 72.0
    font = FontProperties(size=8, weight="bold" if numbered else "normal")
    frame = ax.get_window_extent(renderer)
    trans = ax.transData
    # Obstacles: every marker (the rings on the front are larger), every error bar (softer).
    marks: list[tuple[float, float, float, float]] = []
    bars: list[tuple[float, float, float, float]] = []
    for c in ax.containers:
        line = c.lines[0]
        for X, Y in trans.transform(list(zip(line.get_xdata(), line.get_ydata(), strict=True))):
            marks.append(_box(X, Y, 5 * px))
        for col in c.lines[2]:
            for seg in col.get_segments():
                (a, b), (c2, d) = trans.transform(seg[0]), trans.transform(seg[-1])
                bars.append((min(a, c2), min(b, d) - px, max(a, c2), max(b, d) + px))
    for line in ax.lines:  # fronts, their tails, Δ = 0 and the budget: soft obstacles too
        xy = [tuple(p) for p in line.get_transform().transform(line.get_xydata())]
        if line.get_drawstyle() == "steps-post":
            xy = [p for a, b in pairwise(xy) for p in (a, (b[0], a[1]))] + xy[-1:]
        for (a, b), (c2, d) in pairwise(xy):
            if a == c2 or b == d:  # axis-aligned segments only
                bars.append((min(a, c2) - px, min(b, d) - px, max(a, c2) + px, max(b, d) + px))
    pts = []
    for rho, front in fronts.items():
        for r in front:
            X, Y = trans.transform((r["delta_nll"]["mean"], _value(r, metric, profile)))
            text = str(entries[id(r)][0]) if numbered else short_label(r)
            w, h, _ = renderer.get_text_width_height_descent(text, font, ismath=False)
            pts.append((rho, r, float(X), float(Y), text, w + 3 * px, h + 2 * px))
    marks += [_box(X, Y, 7 * px) for _, _, X, Y, *_ in pts]
    crowd = [sum(abs(X - q[2]) + abs(Y - q[3]) < 80 * px for q in pts) for _, _, X, Y, *_ in pts]
    orders = [
        list(range(len(pts))),
        sorted(range(len(pts)), key=lambda i: -crowd[i]),
        list(reversed(range(len(pts)))),
    ]
    best = None
    for order in orders:
        spots = _place([pts[i] for i in order], marks, bars, frame, px)
        fails = sum(not clean for *_, clean in spots)
        if best is None or fails < best[0]:
            best = (fails, [pts[i] for i in order], spots)
        if fails == 0:
            break
    if best is None:  # no front points
        return True
    fails, pts, spots = best
    for (rho, r, _, _, text, _, _), (dx, dy, rad, _) in zip(pts, spots, strict=True):
        ax.annotate(
            text,
            (r["delta_nll"]["mean"], _value(r, metric, profile)),
            xytext=(dx * rad, dy * rad),
            textcoords="offset points",
            ha="left" if dx > 0 else "right" if dx < 0 else "center",
            va="bottom" if dy > 0 else "top" if dy < 0 else "center",
            fontproperties=font,
            color=colors[rho],
            bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.75},
            arrowprops=(
                {"arrowstyle": "-", "lw": 0.6, "color": colors[rho], "shrinkA": 0, "shrinkB": 6}
                if rad > _LEADER_PT
                else None
            ),
            zorder=5,
            gid="front-label",
        )
    return fails == 0


def _place(pts, marks, bars, frame, px: float) -> list[tuple[float, float, float, bool]]:
    """Greedy placement in the given order: (dx, dy, radius in points, clean) per point. A
    place's cost: overlaps with labels, markers and leader crossings (hard), with error bars and
    lines (soft, half weight), and its distance; clean: no hard cost, within `_CLEAN_PT`."""
    import numpy as np

    marks_a = np.asarray(marks, dtype=float).reshape(-1, 4)
    bars_a = np.asarray(bars, dtype=float).reshape(-1, 4)
    placed = np.zeros((0, 4))
    out = []
    for *_, X, Y, _text, w, hgt in pts:
        own = (
            (marks_a[:, 0] <= X)
            & (X <= marks_a[:, 2])
            & (marks_a[:, 1] <= Y)
            & (Y <= marks_a[:, 3])
        )
        hard_obs = np.concatenate([placed, marks_a[~own]])
        weights = np.concatenate([np.full(len(placed), 20.0), np.full(int((~own).sum()), 5.0)])
        best = None
        for dx, dy, rad in _CANDIDATES:
            tx, ty = X + dx * rad * px, Y + dy * rad * px  # the text's anchor
            x0 = tx if dx > 0 else tx - w if dx < 0 else tx - w / 2
            y0 = ty if dy > 0 else ty - hgt if dy < 0 else ty - hgt / 2
            box = (x0, y0, x0 + w, y0 + hgt)
            if not (
                frame.x0 <= x0 and box[2] <= frame.x1 and frame.y0 <= y0 and box[3] <= frame.y1
            ):
                continue
            hard = float(weights @ _overlaps(box, hard_obs))
            if rad > _LEADER_PT:  # the leader line must cross no label and no marker
                for t in (0.5, 0.65, 0.8, 0.95):
                    lx, ly = X + (tx - X) * t, Y + (ty - Y) * t
                    hard += 50.0 * float(
                        np.sum(
                            (hard_obs[:, 0] <= lx)
                            & (lx <= hard_obs[:, 2])
                            & (hard_obs[:, 1] <= ly)
                            & (ly <= hard_obs[:, 3])
                        )
                    )
            soft = 0.5 * float(_overlaps(box, bars_a).sum())
            cost = hard + (1e4 if hard else 0.0) + soft + 4.0 * rad * px
            if best is None or cost < best[0]:
                best = (cost, dx, dy, rad, box, hard)
            if hard + soft == 0:  # nothing nearer is free; nothing further is cheaper
                break
        if best is None:  # nowhere inside the axes: right of the point
            best = (0.0, 1, 0, _CANDIDATES[0][2], _box(X, Y, 0), 1.0)
        _, dx, dy, rad, box, hard = best
        placed = np.vstack([placed, box])
        out.append((dx, dy, rad, hard == 0 and rad <= _CLEAN_PT))
    return out


def _overlaps(box, obs):
    """Overlap areas of `box` with each row (x0, y0, x1, y1) of `obs`."""
    import numpy as np

    w = np.minimum(box[2], obs[:, 2]) - np.maximum(box[0], obs[:, 0])
    h = np.minimum(box[3], obs[:, 3]) - np.maximum(box[1], obs[:, 1])
    return np.clip(w, 0, None) * np.clip(h, 0, None)


def _box(X: float, Y: float, half: float) -> tuple[float, float, float, float]:
    return (X - half, Y - half, X + half, Y + half)


def _set_xscale(ax, results, budget: float | None, xscale: str) -> None:
    """ "auto": symlog (linear within ±budget, log beyond) when the Δs span over 8 budgets."""
    lin = budget or 0.01
    if xscale == "auto":
        far = max((abs(r["delta_nll"]["mean"]) for r in results if "delta_nll" in r), default=0)
        xscale = "symlog" if far > 8 * lin else "linear"
    if xscale != "symlog":
        ax.set_xscale(xscale)
        return
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("symlog", linthresh=lin, linscale=1.0)
    steps = [m * 10.0**e for e in range(-4, 3) for m in (1, 2, 5)]
    ticks = sorted({0.0, lin} | {s for s in steps if s > lin} | {-s for s in steps if s >= lin})
    ticks += [lin / 2, -lin / 2]
    ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
