"""summary.md of a bench/gpu_bench.sh run: each stage's status and seconds, the checks with
PASS/FAIL, and the key tables (per expert format too). Standard library only (runs after
every stage, and whatever else failed).

    python bench/gpu_summary.py --out OUT [--quiet]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (name, goal text, file, how to read the value, threshold, direction)
GOALS = (
    ("copy engine vs pinned peak", ">= 0.90", "copy.json", "engine_vs_peak", 0.90, "min"),
    ("copy/compute overlap", ">= 0.90", "copy.json", "overlap_efficiency", 0.90, "min"),
    (
        "latency model error (trace replay, max |modeled/measured - 1|)",
        "<= 10%",
        "replay.json",
        "checks.max_abs_model_error",
        0.10,
        "max",
    ),
    (
        "psr-vs-exact speedup, measured vs modeled (max |error|)",
        "<= 10%",
        "replay.json",
        "checks.max_abs_psr_speedup_error",
        0.10,
        "max",
    ),
    (
        "int8 copy time / bf16 copy time vs the modeled bytes ratio (|time ratio / bytes ratio"
        " - 1|)",
        "<= 10%",
        "copy.json",
        "formats.int8.abs_ratio_error",
        0.10,
        "max",
    ),
)


def load(out: Path, name: str) -> dict | list | None:
    f = out / name
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def dig(d, path: str):
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def stages(out: Path) -> list[dict]:
    f = out / "stages.tsv"
    rows = []
    if f.is_file():
        for line in f.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 5:
                name, status, rc, secs, limit = parts[:5]
                rows.append(
                    {
                        "stage": name,
                        "status": status,
                        "rc": rc,
                        "seconds": secs,
                        "limit": limit,
                        "note": parts[5] if len(parts) > 5 else "",
                    }
                )
    return rows


def fmt(v, pct: bool) -> str:
    if v is None:
        return "-"
    return f"{v:.1%}" if pct else f"{v:.3f}"


def checks(out: Path) -> list[dict]:
    res = []
    for name, goal, file, path, thr, how in GOALS:
        d = load(out, file)
        v = dig(d, path) if d is not None else None
        if isinstance(v, (int, float)) and v == v:  # not NaN
            ok = v >= thr if how == "min" else v <= thr
            verdict = "PASS" if ok else "FAIL"
        else:
            v, verdict = None, "NO DATA"
        res.append(
            {
                "check": name,
                "goal": goal,
                "value": v,
                "shown": fmt(v, how == "max"),
                "verdict": verdict,
                "source": f"{file}: {path}",
            }
        )
    return res


def format_copy_table(copy: dict) -> list[str]:
    """copy.json's per-format rows (`formats`): GB/s, ms per expert copy, time vs bf16."""
    fm = copy.get("formats")
    if not isinstance(fm, dict) or not fm:
        return []
    H, F = (copy.get("format_shape") or ["?", "?"])[:2]
    lines = [
        "",
        f"Copy per expert format ({H} x {F} rows, side by side in one run):",
        "",
        "| format | row MB | GB/s | ms per copy | time / bf16 | bytes / bf16 | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in fm.items():
        try:
            lines.append(
                f"| {name} | {r['row_bytes'] / 1e6:.2f} | {r['gbps']:.2f} | {r['copy_ms']:.4f} | "
                f"{r['time_ratio_vs_bf16']:.3f} | {r['bytes_ratio']:.3f} | "
                f"{r['ratio_error']:+.1%} |"
            )
        except (KeyError, TypeError, ValueError):
            lines.append(f"| {name} | (incomplete: {r}) |")
    return lines


def format_replay_lines(d: dict) -> list[str]:
    """replay.json's per-format calibration and status (`formats`, `format_checks`)."""
    fm = d.get("formats")
    if not isinstance(fm, dict) or not fm:
        return []
    by = dig(d, "format_checks.by_format") or {}
    lines = ["", "Per format (replay):", ""]
    for name, f in fm.items():
        if not isinstance(f, dict):
            continue
        bits = [f"{name}: {f.get('status')}"]
        if isinstance(f.get("expert_ms"), (int, float)):
            bits.append(
                f"bytes ratio {f.get('bytes_ratio', 0):.3f}, expert "
                f"{f['expert_ms'] * 1e3:.1f} us ({f.get('expert_ms_vs_bf16', 0):.2f}x bf16), "
                f"copy {f.get('h2d_gbps', 0):.2f} GB/s, kernel check "
                f"{(f.get('kernel_check') or {}).get('ok')}"
            )
        c = by.get(name)
        if isinstance(c, dict) and isinstance(c.get("max_abs_model_error"), (int, float)):
            bits.append(f"max |model error| {c['max_abs_model_error']:.1%}")
        lines.append("* " + "; ".join(bits))
    return lines


def summary(out: Path) -> str:
    mode = (out / "MODE").read_text().strip() if (out / "MODE").is_file() else "?"
    v = load(out, "versions.json") or {}
    b = load(out, "build.json") or {}
    torch_v = v.get("torch", {}) if isinstance(v, dict) else {}
    lines = [f"# psr GPU run: summary ({mode})", ""]
    if mode.startswith("rehearsal"):
        lines += [
            "Rehearsal on the CPU with tiny shapes: every stage's code ran; the numbers "
            "and the checks below say nothing about a GPU.",
            "",
        ]
    if v:
        pk = v.get("packages", {})
        lines.append(
            f"python {v.get('python_version')}, torch {pk.get('torch')} (cuda "
            f"{torch_v.get('cuda')}), triton {pk.get('triton')}, transformers "
            f"{pk.get('transformers')}; GPU: {torch_v.get('device', 'none')}; "
            f"nvidia-smi: {v.get('nvidia_smi')}"
        )
    if b:
        bi = b.get("backend_info") or {}
        lines.append(
            f"build: {b.get('strategy') or 'FAILED'} (plan {' -> '.join(b.get('plan', []))}); "
            f"cuda_compiled {bi.get('cuda_compiled')}, cuda_available {bi.get('cuda_available')}, "
            f"archs {bi.get('cuda_archs')}"
        )
    lines += [
        "",
        "## Stages",
        "",
        "| stage | status | seconds | limit | note |",
        "|---|---|---|---|---|",
    ]
    for s in stages(out):
        lines.append(
            f"| {s['stage']} | {s['status']} | {s['seconds']} | {s['limit']} | {s['note']} |"
        )
    lines += ["", "## Checks (the issue's goals)", ""]
    lines += ["| check | goal | measured | verdict | from |", "|---|---|---|---|---|"]
    for c in checks(out):
        lines.append(
            f"| {c['check']} | {c['goal']} | {c['shown']} | {c['verdict']} | {c['source']} |"
        )
    copy = load(out, "copy.json")
    if isinstance(copy, dict):
        lines += [
            "",
            f"copy: engine {copy.get('engine_gbps', 0):.2f} GB/s, pinned peak "
            f"{copy.get('peak_gbps', 0):.2f} GB/s ({copy.get('peak')}), store-host reference "
            f"{copy.get('reference_gbps', 0):.2f} GB/s; overlap "
            f"{copy.get('overlap_efficiency', 0):.2f} (copy {copy.get('t_copy_ms', 0):.2f} ms, "
            f"compute {copy.get('t_compute_ms', 0):.2f} ms, "
            f"both {copy.get('t_both_ms', 0):.2f} ms)",
        ]
        lines += format_copy_table(copy)
    for title, md, js in (
        ("Trace replay (embedded model's traces, OLMoE-sized experts)", "replay.md", "replay.json"),
        ("Real decoding (OLMoE-1B-7B shape, random weights)", "decode.md", "decode.json"),
    ):
        d = load(out, js)
        status = d.get("status") if isinstance(d, dict) else None
        if (out / md).is_file():
            lines += ["", f"## {title}" + (f" [{status}]" if status else ""), ""]
            lines.append((out / md).read_text().strip())
            if js == "replay.json" and isinstance(d, dict) and "calibration" in d:
                c = d["calibration"]
                lines.append(
                    f"\ncalibrated here: copy {c['h2d_gbps']:.2f} GB/s, expert "
                    f"{c['expert_ms'] * 1e3:.1f} us, dense {c['dense_ms_per_layer'] * 1e3:.1f} "
                    f"us/layer; kernel check {d.get('kernel_check')}"
                )
            if js == "replay.json" and isinstance(d, dict):
                lines += format_replay_lines(d)
    k = load(out, "kernels.json")
    if isinstance(k, list) and k:
        lines += ["", "## Kernels vs torch", "", "| shape | op | kernel us | torch us | ratio |"]
        lines.append("|---|---|---|---|---|")
        for r in k:
            lines.append(
                f"| {r['shape']} | {r['op']} | {r['kernel_us']:.1f} | {r['torch_ref_us']:.1f} | "
                f"{r['speedup']:.2f}x |"
            )
    t = out / "gpu_tests.log"
    if t.is_file():
        tail = [x for x in t.read_text(errors="replace").splitlines() if x.strip()][-1:]
        lines += ["", f"gpu tests: {tail[0] if tail else '(no output)'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    text = summary(out)
    (out / "summary.md").write_text(text)
    (out / "checks.json").write_text(json.dumps(checks(out), indent=1))
    if not args.quiet:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
