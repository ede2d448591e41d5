"""summary.md of a bench/gpu_bench.sh run: each stage's status and seconds, the checks with
PASS/FAIL, and the key tables (per expert format too; gather vs DMA; the decode modes).
Standard library only (runs after every stage, and whatever else failed).

    python bench/gpu_summary.py --out OUT [--quiet]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (name, goal text, file, how to read the value, threshold, direction, shown as)
GOALS = (
    ("copy engine vs pinned peak", ">= 0.90", "copy.json", "engine_vs_peak", 0.90, "min", "x"),
    ("copy/compute overlap", ">= 0.90", "copy.json", "overlap_efficiency", 0.90, "min", "x"),
    (
        "latency model error (trace replay, max |modeled/measured - 1|)",
        "<= 10%",
        "replay.json",
        "checks.max_abs_model_error",
        0.10,
        "max",
        "pct",
    ),
    (
        "psr-vs-exact speedup, measured vs modeled (max |error|)",
        "<= 10%",
        "replay.json",
        "checks.max_abs_psr_speedup_error",
        0.10,
        "max",
        "pct",
    ),
    (
        "int8 copy time / bf16 copy time vs the modeled bytes ratio (|time ratio / bytes ratio"
        " - 1|)",
        "<= 10%",
        "copy.json",
        "formats.int8.abs_ratio_error",
        0.10,
        "max",
        "pct",
    ),
    # Issue 20's goals, from the decode modes (bench/gpu_modes.py): graphs rows only.
    (
        "graphs: measured / host-free modeled ms/token (max over policies and residencies)",
        "<= 1.25",
        "modes.json",
        "checks.graphs_vs_host_free_max",
        1.25,
        "max",
        "x",
    ),
    (
        "graphs: psr-vs-exact speedup / modeled host-free speedup (min over residencies)",
        ">= 0.90",
        "modes.json",
        "checks.psr_speedup_fraction_min",
        0.90,
        "min",
        "x",
    ),
    (
        "graphs: host time / ms per token (max)",
        "<= 10%",
        "modes.json",
        "checks.graphs_host_share_max",
        0.10,
        "max",
        "pct",
    ),
    (
        "decode modes agree: configurations whose tokens or hit/miss/prefetch counts differ",
        "0",
        "modes.json",
        "checks.mode_mismatches",
        0,
        "max",
        "count",
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


def fmt(v, shown: str) -> str:
    if v is None:
        return "-"
    if shown == "count":
        return f"{v:.0f}"
    return f"{v:.1%}" if shown == "pct" else f"{v:.3f}"


def checks(out: Path) -> list[dict]:
    res = []
    for name, goal, file, path, thr, how, shown in GOALS:
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
                "shown": fmt(v, shown),
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


def gather_lines(out: Path) -> list[str]:
    """The gather-vs-DMA table (gather.md) and each format's best CTA setting."""
    g = load(out, "gather.json")
    if not isinstance(g, dict) or not (out / "gather.md").is_file():
        return []
    H, F = (g.get("shape") or ["?", "?"])[:2]
    lines = [
        "",
        f"## Gather vs DMA ({H} x {F} rows, {g.get('k')} per call, {g.get('backend')}) "
        f"[{g.get('status')}]",
        "",
        (out / "gather.md").read_text().strip(),
    ]
    best = g.get("best")
    if isinstance(best, dict) and best:
        bits = []
        for fmt_name, b in best.items():
            try:
                ctas = b["setting"] if b["ctas"] is None else f"{b['ctas']} CTAs"
                bits.append(
                    f"{fmt_name} at {ctas}: {b['gather_gbps']:.2f} GB/s, "
                    f"{b['gather_vs_dma']:.2f}x DMA"
                )
            except (KeyError, TypeError, ValueError):
                bits.append(f"{fmt_name} (incomplete)")
        lines += ["", "best gather per format: " + "; ".join(bits)]
    return lines


def modes_lines(out: Path) -> list[str]:
    """The decode modes' tables (modes.md) and the host-aware model's error per mode."""
    d = load(out, "modes.json")
    if not isinstance(d, dict) or not (out / "modes.md").is_file():
        return []
    lines = [
        "",
        f"## Decode modes: host-driven, sync-free eager, graphs ({d.get('shape')}) "
        f"[{d.get('status')}]",
        "",
        (out / "modes.md").read_text().strip(),
    ]
    errs = dig(d, "checks.max_abs_model_error")
    if isinstance(errs, dict) and errs:
        lines.append(
            "\nhost-aware model, max |modeled / measured - 1| per mode: "
            + ", ".join(f"{m} {fmt(v, 'pct')}" for m, v in errs.items())
        )
    return lines


def prefill_lines(out: Path) -> list[str]:
    """The prefill stage (bench/gpu_prefill.py): TTFT and tok/s with the CPU split off / on,
    and layer-major."""
    d = load(out, "prefill.json")
    if not isinstance(d, dict) or not d.get("models"):
        return []
    lines = [
        "",
        f"## Prefill: time to first token, the CPU split off / on ({d.get('device')}, "
        f"chunk {d.get('chunk')})",
        "",
        "| model | prompt | threshold | TTFT off s | TTFT on s | tok/s off | tok/s on | on/off "
        "| copies off / on | CPU experts | same first token | TTFT layer-major s | "
        "copies layer-major | same as on |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in d["models"].items():
        if "error" in m:
            lines.append(f"| {name} | error: {str(m['error'])[:160]} |" + " |" * 12)
            continue
        for T, r in m.get("prompts", {}).items():
            if "skipped" in r or "error" in r:
                why = r.get("skipped") or f"error: {str(r['error'])[:160]}"
                lines.append(f"| {name} | {T} | {why} |" + " |" * 11)
                continue
            off, on, lm = r["off"], r["on"], r.get("layer_major")
            lm_cols = (
                "- | - | - |"
                if lm is None
                else (
                    f"{lm['ttft_s']:.3f} | {lm['prefill_copies']} | "
                    f"{r['layer_major_same_first_token']} |"
                )
            )
            lines.append(
                f"| {name} | {T} | {m['threshold']} | {off['ttft_s']:.3f} | {on['ttft_s']:.3f} "
                f"| {off['tok_s']:.0f} | {on['tok_s']:.0f} | {r['on_over_off_tok_s']:.2f}x | "
                f"{off['prefill_copies']} / {on['prefill_copies']} | {on['cpu_experts']} | "
                f"{r['same_first_token']} | {lm_cols}"
            )
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
    lines += gather_lines(out)
    lines += modes_lines(out)
    lines += prefill_lines(out)
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
        ("Expert FFN launch sweep (kernels alone)", "gemv_sweep.md", "gemv_sweep.json"),
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
    g = load(out, "ggml.json")
    if isinstance(g, dict) and g.get("rows"):
        lines += ["", "## GGUF block formats: expert GEMV", "", "| format | bytes/expert | GB/s |"]
        lines.append("|---|---|---|")
        for r in g["rows"]:
            lines.append(f"| {r['format']} | {r['row_bytes']} | {r['bytes_per_s'] / 1e9:.1f} |")
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
