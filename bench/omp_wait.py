"""psr's CPU decode with torch's OpenMP waiting passively (psr imported before torch, as
`import psr` and its CLI now arrange) against spinning (torch imported first: OpenMP's
default, what every psr process had before), beside llama.cpp on the same GGUF file, at
each thread count, alternating the three over rounds.

    PYTHONPATH=python:. .venv/bin/python bench/omp_wait.py \\
        --model /work/cache/gguf/olmoe-L16-Q4_K_M.gguf --threads 1,2 --rounds 3 \\
        --out bench/results/cpu/threads/olmoe-L16

Each psr run is bench/llamacpp_side.py's decode worker (64 tokens after an 8-token prompt,
best of `--reps`) in its own process, PSR_BENCH_TORCH_FIRST set for the spinning one;
llama.cpp is `llama-bench -p 0 -n 64 -t T` in the environment as it was (no psr import
has touched it). Ratios only within a round: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_side as side

CONFIGS = ("llama.cpp", "psr", "psr, torch first")


def run(a: argparse.Namespace, config: str, threads: int) -> float:
    """Decode tok/s of one configuration at `threads`."""
    if config == "llama.cpp":
        return float(side.llama_bench(a, a.model, threads)["decode"]["tok_s"])
    if config == "psr, torch first":
        os.environ["PSR_BENCH_TORCH_FIRST"] = "1"
    try:
        return float(side.run_psr(a, a.model, threads, kind="decode")["decode"]["tok_s"])
    finally:
        os.environ.pop("PSR_BENCH_TORCH_FIRST", None)


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| threads | round | llama.cpp tok/s | psr tok/s | psr, torch first tok/s |"
        " psr / llama.cpp | torch first / psr |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        t = r["tok_s"]
        lines.append(
            f"| {r['threads']} | {r['round']} | {t['llama.cpp']:.2f} | {t['psr']:.2f} | "
            f"{t['psr, torch first']:.2f} | {t['psr'] / t['llama.cpp']:.2f}x | "
            f"{t['psr, torch first'] / t['psr']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--llama", type=Path, default=Path("/work/cache/llama/build/bin"))
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="folder: runs.json and table.md")
    a = ap.parse_args()
    a.decode_only, a.prompts = True, [side.PROMPT]
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for threads in a.threads:
            order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
            got = {c: run(a, c, threads) for c in order}
            runs.append({"round": r, "threads": threads, "load": os.getloadavg()[0], "tok_s": got})
            print(f"round {r} threads {threads}: {json.dumps(got)}", flush=True)
    md = f"`{' '.join(sys.argv)}`\n\n{a.model.name}\n\n{table(runs)}\n"
    print(md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "runs.json").write_text(json.dumps(runs, indent=1))
        (a.out / "table.md").write_text(md)


if __name__ == "__main__":
    main()
