"""Long-prompt prefill on the CPU: the row-invariant forward (what `psr serve` runs with its
prompt cache) against the plain chunked forward, for this tree and another (`--before`),
side by side in one run.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. .venv/bin/python bench/prefill_depth.py \\
        --model /work/cache/gguf/olmoe-L4-Q4_K_M.gguf --before /work/ab/before \\
        --lengths 512,2048 --rounds 2 --out bench/results/cpu/prefill_depth

Per tree and round one worker process (bench/common.py `tree_runs`: the trees alternate
round by round, one thread) loads `--model` with `psr.load(FILE, "exact", 1.0,
device="cpu", threads=1)` and a context of the longest prompt + 8, then times, per prompt
length and forward, `generate(prompt, max_new_tokens=1)` (the prefill and the first
token) in the process's CPU seconds, with the attention kernel's own CPU seconds beside
(its calls wrapped). Each figure is the best of `--reps`. Each configuration's first token
is compared across trees and rounds: a faster prefill must not change a token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import tree_runs, write_json

ROOT = Path(__file__).resolve().parents[1]
FORWARDS = ("plain", "rows")


def worker(model_path: str, lengths: list[int], reps: int) -> dict[str, Any]:
    import torch

    import psr  # the worker's tree (PYTHONPATH)
    from psr.runtime import attention
    from psr.store import cpu_kernels

    torch.set_num_threads(1)
    m = psr.load(model_path, "exact", 1.0, device="cpu", threads=1, progress=False,
                 context=max(lengths) + 8)  # fmt: skip
    spent = [0.0]
    for mod, name in ((cpu_kernels, "cpu_rope_attention"), (attention, "rows_attention")):
        fn = getattr(mod, name)

        def timed(*a: Any, _fn: Any = fn, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                spent[0] += time.thread_time() - t0

        setattr(mod, name, timed)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for n in lengths:
        ids = torch.randint(0, 2048, (1, n), generator=gen)
        for fwd in FORWARDS:
            m.set_row_invariant(fwd == "rows")
            best = (float("inf"), 0.0)
            for _ in range(reps):
                spent[0] = 0.0
                t0 = time.process_time()
                tok = int(m.generate(ids, max_new_tokens=1)[0, -1])
                best = min(best, (time.process_time() - t0, spent[0]))
            out[f"{n} {fwd}"] = {"cpu_s": best[0], "attention_s": best[1], "token": tok}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or checkpoint")
    ap.add_argument("--before", type=Path, default=None, help="the tree to compare with")
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1, help="timed prefills per worker")
    ap.add_argument("--out", type=Path, default=None, help="a folder for table.md, runs.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.worker:
        print(json.dumps(worker(a.model, lengths, a.reps)))
        return
    trees = [ROOT] + ([a.before.resolve()] if a.before else [])
    name = {ROOT: "after"} | ({trees[1]: "before"} if a.before else {})
    cmd = [sys.executable, __file__, "--worker", "--model", a.model, "--lengths", a.lengths,
           "--reps", str(a.reps)]  # fmt: skip
    runs: list[dict[str, Any]] = []
    for r, tree, got in tree_runs(trees, a.rounds, cmd):
        runs.append({"round": r, "tree": name[tree], **got})
        print(f"round {r} {name[tree]}: " + ", ".join(
            f"{k} {v['cpu_s']:.2f} s (attention {v['attention_s']:.2f})" for k, v in got.items()
        ), flush=True)  # fmt: skip
    keys = [f"{n} {f}" for n in lengths for f in FORWARDS]
    same = all(run[k]["token"] == runs[0][k]["token"] for run in runs for k in keys)
    lines = [
        f"`{' '.join(sys.argv)}` (load {os.getloadavg()[0]:.2f})",
        "",
        f"{Path(a.model).name}, one thread; prefill + first token, CPU s (attention kernel "
        "s), per round; each configuration's first token the same across trees and rounds: "
        f"{'yes' if same else 'NO'}",
        "",
        "| round | tree | " + " | ".join(f"{n} {f}" for n in lengths for f in FORWARDS)
        + " | " + " | ".join(f"{n} rows / plain" for n in lengths) + " |",
        "|---|---|" + "---|" * (len(lengths) * (len(FORWARDS) + 1)),
    ]  # fmt: skip
    for run in runs:
        cells = [
            f"{run[f'{n} {f}']['cpu_s']:.2f} ({run[f'{n} {f}']['attention_s']:.2f})"
            for n in lengths
            for f in FORWARDS
        ]
        cells += [f"{run[f'{n} rows']['cpu_s'] / run[f'{n} plain']['cpu_s']:.2f}" for n in lengths]
        lines.append(f"| {run['round']} | {run['tree']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "table.md").write_text("\n".join(lines) + "\n")
        write_json(a.out / "runs.json", runs)


if __name__ == "__main__":
    main()
