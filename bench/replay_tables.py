"""The trace replay's tables and checks (bench/gpu_replay.py): per policy and residency in
bf16, per quantized format, speedups vs exact (measured, modeled, their error), the checks
gpu_summary.py grades, and DIR/replay.json + DIR/replay.md written from a result dict."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from psr.eval.labels import pct


def _cell(r: dict, key: str, fmt: str) -> str:
    """A table cell: `r[key]` formatted, or '-' when the run has no such figure."""
    v = r.get(key)
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    lines = [
        "| residency | policy | misses/tok | copies/tok | measured ms/tok | "
        "modeled ms/tok (host-free) | model error | stall ms/tok meas / mod (host-free) | "
        "speedup meas | speedup mod | speedup error | h200 profile ms/tok (host-free) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = partial(_cell, r)
        lines.append(
            f"| {pct(r['residency'])} | {r['policy']} | {r['misses_per_token']:.2f} | "
            f"{r['copies_per_token']:.2f} | {r['ms_per_token']:.3f} | {r['modeled_ms']:.3f} | "
            f"{f('model_error', '+.1%')} | {f('stall_ms_per_token', '.3f')} / "
            f"{f('modeled_stall_ms', '.3f')} | {f('speedup_vs_exact', '.2f')}x | "
            f"{f('modeled_speedup_vs_exact', '.2f')}x | {f('speedup_error', '+.1%')} | "
            f"{f('modeled_h200_ms', '.3f')} |"
        )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = [
        "| residency | policy | format | bytes ratio | copies/tok | measured ms/tok | "
        "modeled ms/tok (host-free) | model error | vs bf16 exact meas | vs bf16 exact mod | "
        "speedup error | vs exact (same format) meas / mod | h200 profile ms/tok (host-free) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = partial(_cell, r)
        lines.append(
            f"| {pct(r['residency'])} | {r['policy']} | {r['format']} | {r['bytes_ratio']:.3f} | "
            f"{r['copies_per_token']:.2f} | {r['ms_per_token']:.3f} | {r['modeled_ms']:.3f} | "
            f"{f('model_error', '+.1%')} | {f('speedup_vs_bf16_exact', '.2f')}x | "
            f"{f('modeled_speedup_vs_bf16_exact', '.2f')}x | "
            f"{f('speedup_vs_bf16_exact_error', '+.1%')} | {f('speedup_vs_exact', '.2f')}x / "
            f"{f('modeled_speedup_vs_exact', '.2f')}x | {f('modeled_h200_ms', '.3f')} |"
        )
    return "\n".join(lines)


def add_format_speedups(frows: list[dict], rows: list[dict]) -> None:
    """Each format row vs bf16 exact at its residency (measured, modeled, their error) and
    vs exact in the same format."""
    for r in frows:
        rho = r["residency"]
        b16 = next((b for b in rows if b["residency"] == rho and b["policy"] == "exact"), None)
        if b16 is not None:
            r["speedup_vs_bf16_exact"] = b16["ms_per_token"] / r["ms_per_token"]
            r["modeled_speedup_vs_bf16_exact"] = b16["modeled_ms"] / r["modeled_ms"]
            r["speedup_vs_bf16_exact_error"] = (
                r["speedup_vs_bf16_exact"] / r["modeled_speedup_vs_bf16_exact"] - 1
            )
        same = next(
            (
                b
                for b in frows
                if b["residency"] == rho and b["format"] == r["format"] and b["policy"] == "exact"
            ),
            None,
        )
        if same is not None:
            r["speedup_vs_exact"] = same["ms_per_token"] / r["ms_per_token"]
            r["modeled_speedup_vs_exact"] = same["modeled_ms"] / r["modeled_ms"]


def add_speedups(rows: list[dict]) -> None:
    for r in rows:
        base = next(
            (b for b in rows if b["residency"] == r["residency"] and b["policy"] == "exact"), None
        )
        if base is None:
            continue
        r["speedup_vs_exact"] = base["ms_per_token"] / r["ms_per_token"]
        r["modeled_speedup_vs_exact"] = base["modeled_ms"] / r["modeled_ms"]
        r["speedup_error"] = r["speedup_vs_exact"] / r["modeled_speedup_vs_exact"] - 1


def checks(rows: list[dict]) -> dict:
    errs = [abs(r["model_error"]) for r in rows if r.get("model_error") is not None]
    psr_rows = [r for r in rows if r["spec"].startswith("psr") and "speedup_error" in r]
    return {
        "max_abs_model_error": max(errs) if errs else None,
        "psr_speedup_error": {f"{r['residency']:g}": r["speedup_error"] for r in psr_rows},
        "max_abs_psr_speedup_error": (
            max(abs(r["speedup_error"]) for r in psr_rows) if psr_rows else None
        ),
    }


def format_checks(frows: list[dict]) -> dict:
    """Per format: max |model error| over its rows, and the psr speedup vs bf16 exact,
    measured vs modeled, per residency; with the max over formats."""
    by: dict[str, dict] = {}
    for fmt in dict.fromkeys(r["format"] for r in frows):
        mine = [r for r in frows if r["format"] == fmt]
        psr = [r for r in mine if r["spec"].startswith("psr") and "speedup_vs_bf16_exact" in r]
        by[fmt] = {
            "max_abs_model_error": max(abs(r["model_error"]) for r in mine),
            "psr_speedup_vs_bf16_exact": {
                f"{r['residency']:g}": r["speedup_vs_bf16_exact"] for r in psr
            },
            "psr_speedup_vs_bf16_exact_error": {
                f"{r['residency']:g}": r["speedup_vs_bf16_exact_error"] for r in psr
            },
        }
    errs = [v["max_abs_model_error"] for v in by.values()]
    return {"by_format": by, "max_abs_model_error": max(errs) if errs else None}


def write(out: Path, result: dict) -> None:
    rows, frows = result["rows"], result.get("format_rows", [])
    add_speedups(rows)
    add_format_speedups(frows, rows)
    result["checks"] = checks(rows)
    result["format_checks"] = format_checks(frows)
    tmp = out / "replay.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / "replay.json")
    md = table(rows) + "\n"
    if frows:
        md += "\nQuantized expert formats (the same traces; bf16 exact is the baseline):\n\n"
        md += format_table(frows) + "\n"
    (out / "replay.md").write_text(md)


def closing_lines(result: dict) -> list[str]:
    """What the command prints at the end: the tables, then the checks (bf16, per format)."""
    lines = [table(result["rows"])]
    if result["format_rows"]:
        lines.append(format_table(result["format_rows"]))
    c = result["checks"]
    lines.append(
        f"max |model error| {c['max_abs_model_error']:.1%}; psr speedup error "
        + ", ".join(f"{k}: {v:+.1%}" for k, v in c["psr_speedup_error"].items())
    )
    for fmt, v in result["format_checks"]["by_format"].items():
        lines.append(
            f"{fmt}: max |model error| {v['max_abs_model_error']:.1%}; psr vs bf16 exact "
            + ", ".join(f"{k}: {x:.2f}x" for k, x in v["psr_speedup_vs_bf16_exact"].items())
        )
    return lines
