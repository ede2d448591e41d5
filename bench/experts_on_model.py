"""experts_on gpu / cpu / hybrid on the embedded default model (what `psr demo` runs), each
mode RECORDED, priced with the latency model; for exact also the replay psr demo prints.

    .venv/bin/python bench/experts_on_model.py [--windows 8] [--decode-tokens 32]
        [--residency 0.5] [--out bench/results/modes]

The model at `--residency` under exact and psr at its operating point (the one psr demo
takes, `psr.points.operating_points`), float32, as the harness loads it; held-out set B
cut into `--windows` windows of 32 prompt + `--decode-tokens` teacher-forced decode-path
tokens (psr.eval.harness.EvalData, as psr demo / psr eval). Per policy one load: the
windows scored in experts_on gpu with a trace recorded, then again in cpu and in
hybrid:m for every m the profiles' costs choose (psr.eval.harness.record_modes, what
`psr eval --record-modes` runs). Each trace priced host-free and, with the policy's
measured device-step schedule (psr.eval.harness.measure_schedules: Triton path under the
interpreter, in a child process), host-aware eager and graph (psr.eval.modes.modes_rows,
psr demo's modes table). The same schedule serves every mode, as psr demo's table does:
the device step hands cpu / hybrid's CPU experts off in stream order (graphs too), so the
schedule differs by the hand-off's two store calls per layer (measured: +3-5 us per MoE
layer, bench/results/host_path/experts_on); the GPU stage has not measured it yet.

Intervals: Δ ms/token of cpu and hybrid vs gpu per window (each window's tokens priced
alone), mean with a paired BCa 95% interval over windows (psr.eval.quality.
paired_bootstrap); Δ nats/token vs gpu likewise (CPU and GPU arithmetic round apart).

exact: the recorded cpu / hybrid traces beside the replay of its gpu trace
(psr.eval.modes.replay_modes from each window's starting caches): copies and CPU experts
per token both ways, and the layer steps whose routed experts, copies or CPU experts
differ (routing moves only by rounding: near-tied router scores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ("rtx4090", "h200")


def _per_window(trace: Any, windows: int, profile: str) -> list[float]:
    """Host-free ms/token of each window's tokens priced alone."""
    from psr.eval.latency import simulate

    w = len(trace.tokens) // windows
    return [
        simulate(replace(trace, tokens=trace.tokens[i * w : (i + 1) * w]), profile).ms_per_token
        for i in range(windows)
    ]


def _step_diff(a: Any, b: Any) -> dict[str, int]:
    """Layer steps of two traces over the same tokens whose routed experts, miss copies
    or CPU experts differ."""
    out = {"steps": 0, "routed": 0, "copies": 0, "cpu_experts": 0}
    for ta, tb in zip(a.tokens, b.tokens, strict=True):
        for sa, sb in zip(ta, tb, strict=True):
            out["steps"] += 1
            out["routed"] += sorted(sa.experts) != sorted(sb.experts)
            ca = sorted((c.slot, c.expert) for c in sa.copies if c.kind == "miss")
            cb = sorted((c.slot, c.expert) for c in sb.copies if c.kind == "miss")
            out["copies"] += ca != cb
            out["cpu_experts"] += sa.cpu_experts != sb.cpu_experts
    return out


def _per_token(trace: Any) -> dict[str, float]:
    n = max(len(trace.tokens), 1)
    c = trace.counts()
    return {
        "copies": sum(len(s.copies) for tok in trace.tokens for s in tok) / n,
        "miss_copies": (c["misses"] - c["cpu_experts"]) / n,
        "cpu_experts": c["cpu_experts"] / n,
        "hit_rate": c["hits"] / max(c["routed"], 1),
    }


def record_policy(path: str, rc: Any, data: Any) -> dict[str, Any]:
    """One load: the windows scored in gpu mode with a trace recorded (exact: with each
    window's starting caches, for the replay), then in cpu / hybrid (record_modes)."""
    from psr.eval import modes
    from psr.eval.harness import record_modes
    from psr.eval.quality import perplexity_items

    t0 = time.time()
    model = rc.load(path)
    try:
        rec = model.record_trace()
        watch = modes.StartWatch(model) if modes.replayable(rc.policy) else None
        nll_gpu = perplexity_items(model, data.windows, data.prompt_len)
        model.runtime.recorder = None
        starts = None
        if watch is not None:
            watch.close()
            starts = watch.starts(len(rec.trace.tokens), len(data.windows))
        recorded = record_modes(model, data, PROFILES)
    finally:
        model.close()
    return {
        "rc": rc,
        "trace": rec.trace,
        "nll_gpu": nll_gpu,
        "starts": starts,
        "recorded": recorded,
        "seconds": time.time() - t0,
    }


def price_policy(raw: dict[str, Any], schedule: Any, windows: int) -> dict[str, Any]:
    """Every recorded trace priced (psr demo's modes rows), the Δs vs gpu with intervals,
    and for exact the replay beside the recorded traces."""
    from psr.eval import modes
    from psr.eval.latency import simulate
    from psr.eval.quality import paired_bootstrap

    rc, gpu, recorded = raw["rc"], raw["trace"], raw["recorded"]
    gpu.host = schedule
    result = {"trace": gpu, "mode_traces": recorded}
    by_profile = {p: modes.recorded_hook(result, p) for p in PROFILES}
    C, E = recorded["capacity"], recorded["num_experts"]
    counts = {m: _per_token(t) for m, t in recorded["traces"].items()}
    out: dict[str, Any] = {
        "label": rc.label,
        "config": rc.as_dict(),
        "seconds": raw["seconds"],
        "tokens_per_run": len(gpu.tokens),
        "hybrid_caps": modes.hybrid_caps(PROFILES, gpu.top_k, C, E, gpu.bytes_ratio),
        "rows": modes.modes_rows({p: t for p, t in by_profile.items() if t}),
        "counts": {"gpu": _per_token(gpu), **counts},
        "delta_ms_vs_gpu": {},
        "delta_nll_vs_gpu": {
            m: paired_bootstrap(items, raw["nll_gpu"]).as_dict()
            for m, items in recorded["nll_items"].items()
        },
    }
    for p, traces in by_profile.items():
        assert traces is not None, f"no recorded hybrid run for {p}'s cap"
        base = _per_window(traces["gpu"], windows, p)
        out["delta_ms_vs_gpu"][p] = {
            m: paired_bootstrap(_per_window(traces[m], windows, p), base).as_dict()
            for m in ("cpu", "hybrid")
        }
    st = raw["starts"]
    if st is None:
        return out
    out["replay"] = {}
    for p in PROFILES:
        rep = modes.replay_modes(gpu, st["starts"], st["window"], C, E, p)
        got = by_profile[p]
        assert got is not None
        out["replay"][p] = {
            m: {
                "recorded": _per_token(got[m]),
                "replayed": _per_token(rep[m]),
                "differ": _step_diff(got[m], rep[m]),
                "host_free_ms": {
                    "recorded": simulate(got[m], p).ms_per_token,
                    "replayed": simulate(rep[m], p).ms_per_token,
                },
            }
            for m in ("cpu", "hybrid")
        }
    return out


def _ci(d: dict[str, Any], scale: float = 1.0, fmt: str = "{:+.3f}") -> str:
    return (
        f"{fmt.format(d['mean'] * scale)} [{fmt.format(d['lo'] * scale)}, "
        f"{fmt.format(d['hi'] * scale)}]"
    )


def report(res: dict[str, Any]) -> str:
    from psr.eval import modes

    meta = res["meta"]
    lines = [
        "# experts_on gpu / cpu / hybrid on the embedded model, each mode recorded",
        "",
        f"Command: `{meta['command']}` (code {meta['head']}"
        f"{' + uncommitted changes' if meta['dirty'] else ''}; {meta['seconds']:.0f} s on a "
        f"shared 2-core VM, load {meta['load']}).",
        "",
        f"Embedded model ({meta['model']}) at {meta['residency']:.0%} residency, float32, "
        f"CPU backend; {meta['data']}; psr's operating point: {meta['operating_points']}. "
        "Every mode's windows scored by the same model load "
        "(psr.eval.harness.record_modes; `psr eval --record-modes`), traces recorded, priced "
        "by psr.eval.latency: host-free, and host-aware (eager and graph) with the policy's "
        "device-step schedule measured on the Triton path (the same schedule for every "
        "mode, as psr demo's modes table; the device step's hand-off adds two store calls "
        "per layer in cpu / hybrid, not in this schedule). hybrid: at most m misses copied "
        "per layer step "
        "(the lowest ids), m as experts_on='hybrid' chooses it from each profile's costs "
        f"(psr.eval.modes.hybrid_caps: {meta['hybrid_caps']}).",
        "",
        "Profiles' assumptions: " + modes.assumptions(list(PROFILES)) + "; " + meta["profiles"],
        "",
    ]
    for r in res["policies"]:
        lines += [f"## {r['label']} ({r['tokens_per_run']} decode tokens per mode)", ""]
        table = modes_table_rows(r)
        lines += [*table, ""]
    lines += ["## exact: recorded vs replayed (psr demo's replay)", ""]
    lines += replay_rows(res)
    lines += [
        "",
        "Δ columns: mean over windows of (mode - gpu) with a paired BCa 95% interval "
        "(psr.eval.quality.paired_bootstrap); a window's ms/token priced from its tokens alone.",
        "",
    ]
    return "\n".join(lines)


def modes_table_rows(r: dict[str, Any]) -> list[str]:
    cols = [
        "profile", "experts on", "copies/tok", "CPU experts/tok", "hit rate",
        "ms/tok host-free", "eager", "graph", "speedup vs gpu (host-free)",
        "Δ ms/tok vs gpu (95% CI)", "Δ nats/tok vs gpu (95% CI)",
    ]  # fmt: skip
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    caps = r["hybrid_caps"]
    for row in r["rows"]:
        p, mode = row["profile"], row["mode"]
        key = mode if mode != "hybrid" else f"hybrid:{caps[p]}"
        c = r["counts"][key]
        dms = "-" if mode == "gpu" else _ci(r["delta_ms_vs_gpu"][p][mode], fmt="{:+.2f}")
        dnll = "-" if mode == "gpu" else _ci(r["delta_nll_vs_gpu"][key], fmt="{:+.4f}")
        cells = [
            p, key, f"{row['copies']:.2f}", f"{row['cpu_experts']:.2f}", f"{c['hit_rate']:.3f}",
            f"{row['host_free']:.2f}", f"{row.get('eager', float('nan')):.2f}",
            f"{row.get('graph', float('nan')):.2f}", f"{row['speedup']:.2f}x", dms, dnll,
        ]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return out


def replay_rows(res: dict[str, Any]) -> list[str]:
    cols = [
        "profile", "mode", "copies/tok recorded", "replayed", "CPU experts/tok recorded",
        "replayed", "ms/tok host-free recorded", "replayed", "layer steps differing: routed / "
        "miss copies / CPU experts (of all)",
    ]  # fmt: skip
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in res["policies"]:
        for p, by_mode in r.get("replay", {}).items():
            for mode, d in by_mode.items():
                rec, rep, diff, ms = d["recorded"], d["replayed"], d["differ"], d["host_free_ms"]
                cells = [
                    p, mode, f"{rec['copies']:.3f}", f"{rep['copies']:.3f}",
                    f"{rec['cpu_experts']:.3f}", f"{rep['cpu_experts']:.3f}",
                    f"{ms['recorded']:.3f}", f"{ms['replayed']:.3f}",
                    f"{diff['routed']} / {diff['copies']} / {diff['cpu_experts']} "
                    f"(of {diff['steps']})",
                ]  # fmt: skip
                out.append("| " + " | ".join(cells) + " |")
    return out


def _head() -> tuple[str, bool]:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout

    return git("rev-parse", "--short", "HEAD").strip(), bool(
        git("status", "--porcelain", "--untracked-files=no").strip()
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32, help="scored tokens per window")
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/modes")
    a = ap.parse_args(argv)
    import psr
    from psr.eval.defaults import PROMPT_TOKENS
    from psr.eval.harness import EvalData, RunConfig, ScheduleJob, schedule_prompt
    from psr.eval.latency import get_profile
    from psr.points import operating_points_with_source
    from psr.policy import make_policy

    t0 = time.time()
    path = psr.DEFAULT_MODEL
    data = EvalData.from_heldout(
        path, "B", windows=a.windows, window_tokens=PROMPT_TOKENS + a.decode_tokens,
        prompt_tokens=PROMPT_TOKENS, prompts=0, gen_tokens=0,
    )  # fmt: skip
    points, source = operating_points_with_source(path, a.residency)
    configs = [RunConfig(make_policy("exact"), a.residency), RunConfig(points["psr"], a.residency)]
    job = ScheduleJob(path, configs, schedule_prompt(data))  # a child process, beside us
    try:
        raws = []
        for rc in configs:
            print(f"[{time.time() - t0:6.1f} s] {rc.label}: gpu, cpu, hybrid", flush=True)
            raws.append(record_policy(path, rc, data))
        print(f"[{time.time() - t0:6.1f} s] waiting for the decode schedules", flush=True)
        schedules = job.result()
    except BaseException:
        job.cancel()
        raise
    policies = [price_policy(raw, schedules[raw["rc"]], a.windows) for raw in raws]
    head, dirty = _head()
    cmd = " ".join([".venv/bin/python", "bench/experts_on_model.py", *(argv or sys.argv[1:])])
    prof = "; ".join(
        f"{p.name}: {p.expert_bytes / 1e6:.2f} MB per expert copy (an OLMoE-1B-7B expert), "
        f"H2D {p.h2d_gbps:g} GB/s + {p.copy_overhead_us:g} µs per copy, HBM {p.hbm_gbps:g} "
        f"GB/s, dense {p.dense_ms_per_layer:g} ms per decoder layer ({p.notes})"
        for p in map(get_profile, PROFILES)
    )
    res = {
        "meta": {
            "command": cmd.strip(),
            "head": head,
            "dirty": dirty,
            "seconds": time.time() - t0,
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "model": str(Path(path).resolve().relative_to(ROOT)),
            "residency": a.residency,
            "operating_points": source.replace(f"{ROOT}/", ""),
            "data": f"{data.source}: {len(data.windows)} windows x {a.decode_tokens} "
            f"decode-path tokens after {PROMPT_TOKENS} prompt tokens",
            "hybrid_caps": policies[0]["hybrid_caps"],
            "profiles": prof,
        },
        "policies": policies,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "experts_on_model.json").write_text(json.dumps(res, indent=1) + "\n")
    md = report(res)
    (a.out / "experts_on_model.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
