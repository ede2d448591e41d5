"""psr's CPU decode at each thread count beside llama.cpp on the same GGUF file, tok/s:
as psr runs (a model decoding on psr's kernels runs torch's own ops on one thread during
its decode steps, so torch's idle OpenMP workers never spin on the kernels' cores), with
torch's threads kept (as before), and with OMP_WAIT_POLICY=PASSIVE (torch's idle workers
sleep at once); the configurations alternate over rounds.

    PYTHONPATH=python:. .venv/bin/python bench/omp_wait.py \\
        --model /work/cache/gguf/olmoe-L16-Q4_K_M.gguf --threads 1,2 --rounds 3 \\
        --out bench/results/cpu/threads/olmoe-L16

psr's kernels run on a pool of their own beside torch's OpenMP one: which wait is better
depends on which does the work (a GGUF model's dense and expert weights run on psr's
kernels, a float checkpoint's dense layers on torch's). Each psr run is
bench/llamacpp_side.py's decode worker (64 tokens after an 8-token prompt, best of `--reps`)
in its own process; llama.cpp is `llama-bench -p 0 -n 64 -t T` (`--model default`, psr's
embedded model: no llama.cpp). Ratios only within a round: the machine is shared.
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

CONFIGS = ("llama.cpp", "psr", "psr, torch threads kept", "psr, OMP passive")
# Each psr configuration's environment: torch threads kept = the decode steps' torch ops on
# every thread, as before `OffloadedModel.decodes_on_kernels` (PSR_BENCH_KEEP_TORCH_THREADS).
_ENV = {
    "psr": {},
    "psr, torch threads kept": {"PSR_BENCH_KEEP_TORCH_THREADS": "1"},
    "psr, OMP passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def run(a: argparse.Namespace, config: str, threads: int) -> float | None:
    """Decode tok/s of one configuration at `threads` (None: not run)."""
    if config == "llama.cpp":
        if a.model_name == "default":
            return None
        return float(side.llama_bench(a, a.model, threads)["decode"]["tok_s"])
    os.environ.update(_ENV[config])
    try:
        return float(side.run_psr(a, a.model, threads, kind="decode")["decode"]["tok_s"])
    finally:
        for k in _ENV[config]:
            os.environ.pop(k, None)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| threads | round | llama.cpp | psr | psr, torch threads kept | psr, OMP passive |"
        " psr / kept | psr / llama.cpp |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        t = r["tok_s"]
        lc, p, k, q = (t.get(c) for c in CONFIGS)
        vs = "-" if lc is None or p is None else f"{p / lc:.2f}x"
        gain = "-" if p is None or k is None else f"{p / k:.2f}x"
        cells = [r["threads"], r["round"], _f(lc), _f(p), _f(k), _f(q), gain, vs]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file, or default (psr's embedded)")
    ap.add_argument("--llama", type=Path, default=Path("/work/cache/llama/build/bin"))
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="folder: runs.json and table.md")
    a = ap.parse_args()
    a.model_name = a.model
    root = Path(__file__).resolve().parents[1]
    a.model = root / "python/psr/models/default_model" if a.model == "default" else Path(a.model)
    a.decode_only, a.prompts = True, [side.PROMPT]
    if os.environ.get("OMP_WAIT_POLICY"):
        sys.exit("omp_wait.py: unset OMP_WAIT_POLICY first (the default is one configuration)")
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
