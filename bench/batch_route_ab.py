"""A/B of a batched decode step's routing (issue 38): each layer step's rows routed and
predicted one row at a time (`BatchStep.route` as the commit --base has it) against all
rows in one call (this tree), on the same loaded model, alternated rounds, CPU time.

    OMP_NUM_THREADS=1 python bench/batch_route_ab.py --base main --rounds 4 \
        --models embedded,embedded-gguf,qwen3-gguf --batches 2,4,8 --out DIR

The models and prompts are bench/batch.py's (experts on the CPU, psr at residency 0.5,
one thread). Per model and b: `generate_batch` of b prompts x --tokens new tokens
(prefill included), base then this tree, --rounds times; the CPU seconds of each, the
per-round ratio base / this (its median), and the tokens of both (they must be equal).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import _model
from common import write_json

import psr.runtime.batch as batch_mod


def base_route(base: str) -> Any:
    """`BatchStep.route` of commit `base` (its per-row loop), bound to this tree's
    module globals; its `dec.count` calls take the sequence this tree's count needs."""
    src = subprocess.run(["git", "show", f"{base}:python/psr/runtime/batch.py"],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    at = src.index("class BatchStep(")
    start = src.index("    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:", at)
    end = src.index("    def experts(", start)
    body = textwrap.dedent(src[start:end]).replace("dec.count(", "dec.count(seq, ")
    ns: dict[str, Any] = {}
    exec(compile(body, f"{base}:batch.py", "exec"), vars(batch_mod), ns)
    return ns["route"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main")
    ap.add_argument("--models", type=lambda s: s.split(","), default=["embedded"])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[4])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--qwen-layers", type=int, default=2)
    ap.add_argument("--qwen-vocab", type=int, default=8192)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ways = {"base": base_route(args.base), "this": batch_mod.BatchStep.route}
    out: dict[str, Any] = {"command": "OMP_NUM_THREADS=1 python bench/batch_route_ab.py "
                           + " ".join(sys.argv[1:]), "rows": []}  # fmt: skip
    for name in args.models:
        model, prompts = _model(name, args)
        model.generate_batch(prompts[:2], 2)  # warm-up
        for b in args.batches:
            ps = prompts[:b]
            cpu: dict[str, list[float]] = {w: [] for w in ways}
            toks: dict[str, Any] = {}
            for _ in range(args.rounds):
                for w, fn in ways.items():
                    batch_mod.BatchStep.route = fn  # type: ignore[method-assign]
                    c = time.process_time()
                    toks[w] = model.generate_batch(ps, args.tokens)
                    cpu[w].append(time.process_time() - c)
            batch_mod.BatchStep.route = ways["this"]  # type: ignore[method-assign]
            ratios = [a / t for a, t in zip(cpu["base"], cpu["this"], strict=True)]
            row = {"model": name, "b": b, "cpu_s": cpu, "ratio_median": statistics.median(ratios),
                   "ratios": ratios, "same_tokens": toks["base"] == toks["this"]}  # fmt: skip
            print(row, flush=True)
            out["rows"].append(row)
        model.close()
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "route_ab.json", out)
    lines = [
        f"`{out['command']}`",
        "",
        "| model | b | base CPU s (min) | this CPU s (min) | "
        "base / this (median of rounds) | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        lines.append(f"| {r['model']} | {r['b']} | {min(r['cpu_s']['base']):.2f} | "
                     f"{min(r['cpu_s']['this']):.2f} | {r['ratio_median']:.2f}x | "
                     f"{r['same_tokens']} |")  # fmt: skip
    (args.out / "route_ab.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
