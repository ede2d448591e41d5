"""experts_on gpu / cpu / hybrid side by side on the CPU backend, one Qwen3-30B-A3B-shaped
random model (bench/cpu_decode.py's: hidden 2048, 128 experts of FFN 768, top-8).

    .venv/bin/python bench/experts_on.py [--ckpt DIR] [--layers 2] [--residency 0.5]
        [--format bf16] [--threads 1] [--tokens 16] [--rounds 2] [--out FILE.json]

One load (`psr.load(..., device=--device (cpu), dtype=float32, expert_format=--format)`), then per
policy (exact; psr lam 0.3, n 1) and mode (`model.set_experts_on`: gpu, cpu, hybrid:M with
M = top_k / 2) a warm-up generate and timed ones, rounds interleaving the modes (A B C A B
C). Decode tok/s is wall clock: n decode tokens over one generate of n + 1 tokens less one of 1
(the prefill), the device synchronized around each: measured outside psr. psr's own figure
(`stats_tok_s`: its stats' decode tokens over decode seconds, which until run 3's fix counted
only the final wait on CUDA) is kept beside it as a check. The median over rounds; copies and
CPU experts per token are the stats'. On the CPU backend a "copy" is a memcpy on the store's
copy thread into the slab, which the same CPU kernels then read: cpu mode saves that memcpy.
The machine's load (`uptime`) is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def _wall(model, prompt: torch.Tensor, new: int) -> float:
    """Seconds of one generate, the device drained before and after (psr's own decode
    seconds are host time: on CUDA the forwards are asynchronous, graph replays most)."""
    sync = torch.cuda.synchronize if model.runtime.store.device.type == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    model.generate(prompt, max_new_tokens=new)
    sync()
    return time.perf_counter() - t0


def _decode(model, prompt: torch.Tensor, n: int) -> dict[str, float | str]:
    first = _wall(model, prompt, 1)  # prefill and its token: subtracted below
    model.reset_stats()
    c0 = model.runtime.store.counters()["cpu_task_s"]  # the hand-off's host tasks (CPU time)
    wall = _wall(model, prompt, n + 1)
    cpu_s = model.runtime.store.counters()["cpu_task_s"] - c0
    s = model.stats
    t = max(s["tokens"], 1)
    return {
        "tok_s": n / max(wall - first, 1e-9),  # wall clock, n decode tokens
        "stats_tok_s": s["tokens_per_s"],  # psr's own figure, for comparison
        "copies_per_token": s["copies"] / t,
        "cpu_experts_per_token": s["cpu_experts"] / t,
        "hit_rate": s["hit_rate"],
        "cpu_task_ms_per_token": 1e3 * cpu_s / t,  # decode's: prefill takes no hand-off
        "graphs": model.graph_status,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/psr-cpu-decode/qwen3moe-2l"))
    ap.add_argument("--layers", type=int, default=2, help="when --ckpt must be written")
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--format", default="bf16", help="expert_format (native, bf16, int8, ...)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--device", default="cpu", help="cpu, or cuda (the device step hands CPU experts off)"
    )
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import psr

    if not (a.ckpt / "config.json").is_file():
        from cpu_decode import write_checkpoint  # type: ignore[import-not-found]

        write_checkpoint(a.ckpt, a.layers, 1024)
    torch.set_num_threads(a.threads)
    model = psr.load(
        str(a.ckpt), "exact", a.residency, device=a.device, dtype=torch.float32,
        expert_format=a.format, progress=False,
    )  # fmt: skip
    k = model.runtime.spec.top_k
    modes = ["gpu", "cpu", f"hybrid:{k // 2}"]
    prompt = torch.arange(3, 19)[None]
    res: dict[str, dict[str, list[dict[str, float]]]] = {}
    for policy, kw in (("exact", {}), ("psr", {"lam": 0.3, "n": 1})):
        model.configure(policy, a.residency, **kw)
        runs = res.setdefault(policy, {m: [] for m in modes})
        for r in range(a.rounds + 1):
            for mode in modes:
                where, _, m = mode.partition(":")
                model.set_experts_on(where, int(m) if m else None)
                got = _decode(model, prompt, a.tokens)
                if r:  # round 0 warms every mode up
                    runs[mode].append(got)
    load = os.getloadavg()
    print(f"uptime load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; threads {a.threads}")
    print(f"{'policy':8} {'mode':10} {'tok/s':>7} {'copies/tok':>11} {'cpu exp/tok':>12} hit")
    table = {}
    for policy, by_mode in res.items():
        for mode, rs in by_mode.items():
            med: dict[str, float | str] = {
                key: statistics.median(float(x[key]) for x in rs)
                for key in rs[0]
                if key != "graphs"
            }
            med["graphs"] = str(rs[-1]["graphs"])
            table[f"{policy}/{mode}"] = med
            print(
                f"{policy:8} {mode:10} {med['tok_s']:7.2f} {med['copies_per_token']:11.1f} "
                f"{med['cpu_experts_per_token']:12.1f} {med['hit_rate']:.3f} "
                f"cpu {med['cpu_task_ms_per_token']:.2f} ms/tok; graphs {med['graphs']}"
            )
    if a.out is not None:
        a.out.write_text(json.dumps({"args": vars(a) | {"ckpt": str(a.ckpt)}, "load": load,
                                     "results": table}, indent=1, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
