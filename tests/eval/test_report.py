"""Reports: the Pareto front, the markdown table and what the figures draw (no model runs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.text import Text

from psr.eval import plots
from psr.eval.labels import pareto, short_label
from psr.eval.plots import frontier_figure, overview_figure
from psr.eval.report import markdown_table, save


def result(policy, rho, lam=None, n=None, *, ms, miss, d=None, w=0.004, speedup=None):
    r = {
        "config": {"policy": policy, "residency": rho, "lam": lam, "n": n},
        "label": policy + (f"(lam={lam}, n={n})" if lam is not None or n is not None else ""),
        "stats": {
            "misses_per_token": miss,
            "hit_rate": 0.5,
            "prefetches": 10 if n else 0,
            "prefetch_used_frac": 0.7,
        },
        "latency": {"rtx4090": {"ms_per_token": ms}, "h200": {"ms_per_token": ms / 2}},
        "greedy_agreement": 1.0,
    }
    if speedup is not None:
        r["speedup"] = {"rtx4090": speedup, "h200": speedup}
    if d is not None:
        r["delta_nll"] = {"mean": d, "lo": d - w, "hi": d + 2 * w, "n": 12}
    return r


def grid() -> list[dict]:
    """Two residencies; on each, some points dominated and some on the front."""
    out = []
    for rho, k in ((0.5, 1.0), (0.25, 1.4)):
        out += [
            result("exact", rho, ms=4.5 * k, miss=6 * k, d=0.0, w=0.0, speedup=1.0),
            result("exact-prefetch", rho, n=1, ms=4.2 * k, miss=5 * k, d=0.0, w=0.0),
            result("cache-prior", rho, 0.1, ms=3.9 * k, miss=4.8 * k, d=0.012),  # dominated
            result("psr", rho, 0.1, 1, ms=3.2 * k, miss=3 * k, d=0.008),
            result("psr", rho, 0.3, 1, ms=2.0 * k, miss=0.8 * k, d=0.05),
            result("psr", rho, 0.3, 2, ms=2.4 * k, miss=0.5 * k, d=0.06),  # off the ms front
            result("cache-prior-async", rho, 0.2, ms=3.0 * k, miss=2.5 * k, d=0.03),
        ]
    return out


def brute_front(rs, key):
    """Non-dominated (key, Δ) points, by brute force."""
    pts = [(key(r), r["delta_nll"]["mean"]) for r in rs]
    return sorted(
        p for p in set(pts) if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in pts)
    )


# --- pareto -------------------------------------------------------------------------------------


def test_pareto_ties_duplicates_and_non_finite() -> None:
    pts = [
        (1.0, 0.5, "a"),
        (1.0, 0.5, "a-dup"),  # an exact duplicate: only the first is kept
        (1.0, 0.7, "same-lat-worse"),
        (2.0, 0.5, "same-loss-slower"),
        (2.0, 0.1, "b"),
        (3.0, 0.1, "tie-loss-slower"),
        (0.5, math.nan, "nan"),
        (math.inf, -1.0, "inf"),
        (4.0, -0.2, "c"),
    ]
    assert pareto(pts) == ["a", "b", "c"]
    assert pareto(list(reversed(pts))) == ["a-dup", "b", "c"]
    assert pareto([]) == []
    assert pareto([(1.0, 1.0, "x")]) == ["x"]


def test_pareto_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    pts = [(float(a), float(b), i) for i, (a, b) in enumerate(rng.integers(0, 6, (60, 2)))]
    front = pareto(pts)
    got = sorted({(pts[i][0], pts[i][1]) for i in front})
    want = sorted(
        {
            (a, b)
            for a, b, _ in pts
            if not any(c <= a and d <= b and (c, d) != (a, b) for c, d, _ in pts)
        }
    )
    assert got == want and len(front) == len(want)  # one item per non-dominated point


# --- markdown -----------------------------------------------------------------------------------


def test_markdown_table_columns_and_rows() -> None:
    rs = grid()[:4]
    rs[2].pop("delta_nll")
    rs[1].pop("greedy_agreement")
    rs[3]["delta_cloze_pts"] = {"mean": 4.2, "lo": 0.0, "hi": 8.4, "n": 48}
    rs[3]["stats"]["substitution_rate"] = 0.1234
    rs[0]["stats"]["substitution_rate"] = 0.0
    md = markdown_table(rs).splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    assert head == [
        "residency",
        "policy",
        "misses/tok",
        "hit rate",
        "prefetch used",
        "rtx4090 ms/tok (host-free)",
        "h200 ms/tok (host-free)",
        "speedup (rtx4090, host-free)",
        "subst. rate",
        "greedy agree",
        "Δ nats/tok [95% CI]",
        "Δ cloze pts [95% CI]",
    ]
    assert len(md) == 2 + len(rs)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md[2:]]
    assert all(len(row) == len(head) for row in rows)
    assert rows[0][:2] == ["50%", "exact"] and rows[0][4] == "-"  # no prefetches
    assert rows[0][7] == "1.00x" and rows[1][7] == "-"  # speedup missing
    # the substitution rate; "-" in results written before it was counted
    assert [r[8] for r in rows] == ["0.000", "-", "-", "0.123"]
    assert rows[0][9] == "1.00" and rows[1][9] == "-"  # no greedy prompts: no agreement
    assert rows[2][10] == "-" and rows[3][10] == "+0.0080 [+0.0040, +0.0160]"
    assert rows[3][11] == "+4.2000 [+0.0000, +8.4000]" and rows[0][11] == "-"
    assert "Δ nats" not in markdown_table([result("exact", 0.5, ms=1, miss=1)])
    assert (
        markdown_table([result("exact", 0.375, ms=1, miss=1)])
        .splitlines()[2]
        .startswith("| 37.5% | exact |")
    )


def test_short_labels() -> None:
    rs = grid()
    assert [short_label(r) for r in rs[:7]] == [
        "exact",
        "exact-prefetch n1",
        "cache-prior λ0.1",
        "psr λ0.1 n1",
        "psr λ0.3 n1",
        "psr λ0.3 n2",
        "cache-prior-async λ0.2",
    ]
    rs[3]["config"]["expert_format"] = "int8"
    rs[4]["config"]["expert_format"] = "native"
    assert [short_label(r) for r in rs[3:5]] == ["psr λ0.1 n1 int8", "psr λ0.3 n1"]


# --- figures ------------------------------------------------------------------------------------


def lines(ax, prefix):
    return {ln.get_gid(): ln for ln in ax.lines if (ln.get_gid() or "").startswith(prefix)}


def labels(ax):
    return [t for t in ax.texts if t.get_gid() == "front-label"]


@pytest.fixture(scope="module")
def frontier():
    rs = grid()
    return rs, frontier_figure(rs, "rtx4090", budget=0.01)


def test_frontier_draws_one_front_line_per_residency_through_exactly_its_front(frontier) -> None:
    rs, fig = frontier
    ms_ax, miss_ax = fig.axes
    keys = {
        ms_ax: lambda r: r["latency"]["rtx4090"]["ms_per_token"],
        miss_ax: lambda r: r["stats"]["misses_per_token"],
    }
    for ax, key in keys.items():
        fronts = lines(ax, "pareto-front:")
        assert set(fronts) == {"pareto-front:0.5", "pareto-front:0.25"}
        for rho in (0.5, 0.25):
            ln = fronts[f"pareto-front:{rho:g}"]
            got = sorted(zip(ln.get_ydata(), ln.get_xdata(), strict=True))
            want = brute_front([r for r in rs if r["config"]["residency"] == rho], key)
            assert np.allclose(got, want) and len(got) == len(want)
            assert len(want) >= 3  # a real line, not a point
            assert ln.get_drawstyle() == "steps-post"
            assert list(ln.get_xdata()) == sorted(ln.get_xdata())  # drawn left to right
    # The dominated cache-prior λ0.1 is on no front; psr λ0.3 n2 is on the misses front only.
    ms_front = lines(ms_ax, "pareto-front:")["pareto-front:0.5"]
    miss_front = lines(miss_ax, "pareto-front:")["pareto-front:0.5"]
    assert 0.012 not in list(ms_front.get_xdata()) + list(miss_front.get_xdata())
    assert 0.06 in list(miss_front.get_xdata()) and 0.06 not in list(ms_front.get_xdata())


def test_frontier_has_ci_error_bars_from_lo_hi(frontier) -> None:
    rs, fig = frontier
    ax = fig.axes[0]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert bars and all(c.has_xerr and not c.has_yerr for c in bars)
    n = sum(len(c.lines[0].get_xdata()) for c in bars)
    assert n == len(rs)  # every point, once
    segs = [s for c in bars for col in c.lines[2] for s in col.get_segments()]
    spans = sorted((round(s[0][0], 9), round(s[1][0], 9)) for s in segs)
    want = sorted((round(r["delta_nll"]["lo"], 9), round(r["delta_nll"]["hi"], 9)) for r in rs)
    assert spans == want
    # one marker per family: the async variant falls under "other"
    fams = {c.lines[0].get_gid().split(":")[2] for c in bars}
    assert fams == {"exact", "exact-prefetch", "cache-prior", "psr", "other"}
    assert {c.lines[0].get_marker() for c in bars} == set(plots.MARKERS.values())


def test_frontier_labels_only_front_points_without_overlap(frontier) -> None:
    rs, fig = frontier
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        front = {
            (float(x), float(y))
            for ln in lines(ax, "pareto-front:").values()
            for x, y in zip(ln.get_xdata(), ln.get_ydata(), strict=True)
        }
        texts = labels(ax)
        assert {(float(t.xy[0]), float(t.xy[1])) for t in texts} == front
        assert len(texts) == len(front)
        names = {short_label(r) for r in rs}
        assert all(t.get_text() in names for t in texts)  # short labels, not numbers
        boxes = [Text.get_window_extent(t, renderer) for t in texts]  # the text, no leader
        for i, a in enumerate(boxes):
            assert all(not a.overlaps(b) for b in boxes[i + 1 :])
            assert ax.bbox.contains(a.x0, a.y0) and ax.bbox.contains(a.x1, a.y1)


def test_frontier_zero_line_budget_and_titles(frontier) -> None:
    _, fig = frontier
    ax = fig.axes[0]
    vlines = [ln for ln in ax.lines if ln.get_gid() is None and ln.get_linestyle() != "None"]
    xs = {float(ln.get_xdata()[0]): ln.get_linestyle() for ln in vlines}
    assert xs == {0.0: "-", 0.01: "--"}
    assert "rtx4090" in fig.get_suptitle() and "rtx4090" in ax.get_ylabel()
    assert "Δ nats/token" in ax.get_xlabel() and "misses" in fig.axes[1].get_ylabel()
    w, h = fig.get_size_inches() * fig.dpi
    assert 1200 <= w <= 1600 and h < w
    no_budget = frontier_figure(grid()[:4], budget=None).axes[0]
    dashed = [ln for ln in no_budget.lines if ln.get_gid() is None and ln.get_linestyle() == "--"]
    assert dashed == []


def test_frontier_numbers_and_key_when_labels_do_not_fit(monkeypatch) -> None:
    monkeypatch.setattr(plots, "_CLEAN_PT", -1)  # no place is good enough for a label
    rs = grid()[:7]
    fig = frontier_figure(rs)
    for ax in fig.axes:
        nums = [t.get_text() for t in labels(ax)]
        assert nums and all(s.isdigit() for s in nums)
    key = [t.get_text() for t in fig.texts]
    assert "Pareto-front points by number:" in key
    assert any(s.endswith("psr λ0.3 n1") for s in key) and not any(
        "λ0.1" in s and "cache" in s for s in key
    )


def test_overview_bars_speedups_and_frontier_panel() -> None:
    rs = grid()
    fig = overview_figure(rs, "rtx4090")
    bars_ax, q_ax = fig.axes
    ticks = [t.get_text() for t in bars_ax.get_yticklabels()]
    assert ticks[0] == "50% resident" and "25% resident" in ticks and "psr λ0.3 n2" in ticks
    assert all(t.get_rotation() == 0 for t in bars_ax.get_yticklabels())  # horizontal labels
    texts = [t.get_text() for t in bars_ax.texts]
    assert len(texts) == len(rs)
    assert "4.50 ms  1.00×" in texts  # given speedup
    assert "3.20 ms  1.41×" in texts  # computed vs exact at the same residency
    assert set(lines(q_ax, "pareto-front:")) == {"pareto-front:0.5", "pareto-front:0.25"}
    assert any(isinstance(c, ErrorbarContainer) for c in q_ax.containers)
    plain = overview_figure([{k: v for k, v in r.items() if k != "delta_nll"} for r in rs])
    assert len(plain.axes) == 1


def test_save_writes_the_frontier_png_only_with_quality(tmp_path, monkeypatch) -> None:
    rs = grid()[:4]
    paths = save(rs, tmp_path, "t", profiles=("h200", "rtx4090"))
    assert set(paths) == {"json", "md", "png", "frontier"}
    assert paths["frontier"] == tmp_path / "t_frontier.png"
    for k in ("png", "frontier"):
        png = paths[k].read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
        width = int.from_bytes(png[16:20], "big")
        assert 1200 <= width <= 1600
    assert "h200 ms/tok" in paths["md"].read_text()
    # Without Δ nats/token: no frontier (the drawing itself stubbed out here).
    calls = []
    monkeypatch.setattr(plots, "plot", lambda r, p, prof, **kw: calls.append(("plot", p)))
    monkeypatch.setattr(plots, "plot_frontier", lambda *a, **kw: calls.append(("frontier",)))
    plain = save([{k: v for k, v in r.items() if k != "delta_nll"} for r in rs], tmp_path, "u")
    assert set(plain) == {"json", "md", "png"} and calls == [("plot", tmp_path / "u.png")]
