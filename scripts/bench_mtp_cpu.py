"""CPU-only greedy decode of the embedded model with each speculative drafter against
without one, in one run: the same prompts (held-out set B), the same tokens (asserted),
tok/s side by side.

    OMP_NUM_THREADS=1 python scripts/bench_mtp_cpu.py --threads 1 \
        --out bench/results/speculative

Every configuration holds all experts (residency 1.0, policy exact) and verifies each
block with all 64 experts (K_b = E), so speculation changes no token: it only decides
how many positions one forward verifies. The drafter is attached beside the full slab
(`set_speculative`), not taken out of it: this measures the CPU's gain, not equal
device memory. Runs are interleaved prompt by prompt (base, then each drafter), and
timed by the process's CPU time (one thread: what decoding costs, whatever else the
shared machine runs) besides wall time; each (configuration, prompt) keeps its fastest
of `--reps` runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def table_lines(rows: list[dict[str, Any]], digits: int = 1) -> list[str]:
    """The side-by-side table: a row per configuration, speeds with `digits` decimals."""
    lines = [
        "| config | tok/CPU-s | vs no drafter | tok/wall-s | vs no drafter (wall) | "
        "accepted / block | tokens / forward |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ac = "-" if r["accepted_per_block"] is None else f"{r['accepted_per_block']:.2f}"
        lines.append(
            f"| {r['config']} | {r['tok_per_cpu_s']:.{digits}f} | {r['speedup']:.2f}x | "
            f"{r['tok_per_wall_s']:.{digits}f} | {r['wall_speedup']:.2f}x | {ac} | "
            f"{r['tokens_per_forward']:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--drafters", default="mtp:2,mtp:3,mtp:4,block:4,ar:4", help="kind:block")
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32: a bf16 verify block of 5 tokens rounds differently from one token, "
        "which flips near-tied greedy choices (no batch-invariant CPU kernels yet)",
    )
    p.add_argument("--out", default=None, help="folder for mtp_cpu.{md,json}")
    args = p.parse_args(argv)

    import torch

    import psr
    from psr.eval.defaults import PROMPT_TOKENS
    from psr.eval.harness import EvalData
    from psr.models.drafters import load_drafter
    from psr.models.embedded import DEFAULT_MODEL

    path = DEFAULT_MODEL
    data = EvalData.from_heldout(
        path, "B", windows=0, prompt_tokens=PROMPT_TOKENS, prompts=args.prompts, gen_tokens=args.new
    )
    kw = dict(residency=1.0, progress=False, threads=args.threads, device="cpu", dtype=args.dtype)
    base = psr.load(path, "exact", **kw)
    E = base.runtime.spec.num_experts
    models = {"no drafter": base}
    for item in args.drafters.split(","):
        kind, block = item.split(":")
        m = psr.load(path, "exact", **kw)
        dt = next(m.hf.parameters()).dtype
        d = load_drafter(path, kind, int(block), m.hf, torch.device("cpu"), dt)
        m.set_speculative(d, E)  # every expert in each verify block: exact
        models[f"{kind}, {block} drafted"] = m
    for m in models.values():  # warm-up (first-call allocations)
        m.generate(data.prompts[0][:8], 4)
    cpu = {k: [float("inf")] * len(data.prompts) for k in models}
    wall = {k: [float("inf")] * len(data.prompts) for k in models}
    acc = {k: [0, 0, 0] for k in models}  # accepted, blocks, emitted (first rep)
    for rep in range(args.reps):
        for i, prompt in enumerate(data.prompts):
            want = None
            for name, m in models.items():
                c0, t0 = time.process_time(), time.perf_counter()
                out = m.generate(prompt, args.new)[0, len(prompt) :].tolist()
                wall[name][i] = min(wall[name][i], time.perf_counter() - t0)
                cpu[name][i] = min(cpu[name][i], time.process_time() - c0)
                if want is None:
                    want = out
                assert out == want, f"{name}: tokens differ from greedy decoding without a drafter"
                if rep == 0 and m.spec_stats is not None and m.drafter is not None:
                    st = m.spec_stats
                    acc[name] = [acc[name][0] + st.accepted, acc[name][1] + st.blocks,
                                 acc[name][2] + sum(st.per_block)]  # fmt: skip
    secs = {k: sum(v) for k, v in cpu.items()}
    walls = {k: sum(v) for k, v in wall.items()}
    n = len(data.prompts) * args.new
    rows = []
    for name in models:
        a, b, e = acc[name]
        rows.append(
            {
                "config": name,
                "tok_per_cpu_s": n / secs[name],
                "speedup": secs["no drafter"] / secs[name],
                "tok_per_wall_s": n / walls[name],
                "wall_speedup": walls["no drafter"] / walls[name],
                "accepted_per_block": a / b if b else None,
                "tokens_per_forward": e / b if b else 1.0,
            }
        )
    cmd = "OMP_NUM_THREADS=1 python scripts/bench_mtp_cpu.py " + " ".join(sys.argv[1:])
    lines = [
        f"`{cmd}`",
        "",
        f"embedded model ({args.dtype}), CPU only, {args.threads} thread(s), exact policy, "
        "all experts held, "
        f"K_b = E = {E}; {len(data.prompts)} prompts of held-out set B x {args.new} new "
        f"tokens, the fastest of {args.reps} runs each (CPU time of this process, and "
        "wall); identical tokens in every row (asserted)",
        "",
        *table_lines(rows),
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        o = Path(args.out)
        o.mkdir(parents=True, exist_ok=True)
        (o / "mtp_cpu.md").write_text(table + "\n")
        (o / "mtp_cpu.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
