"""The float formats' dense `cpu_linear` (BF16 / F16 / F32 weights [N, K]) at T tokens, two
builds side by side: each tree's `python/` in its own process, the trees alternated round by
round on the same machine.

    OMP_NUM_THREADS=1 .venv/bin/python bench/float_linear_trees.py --trees BASE,MAIN \
        [--tokens 1,3,4,5,8,32] [--rounds 3] [--out FILE.md]

A tree is a checkout with its extension built in place (`python setup.py build_ext
--inplace`), run as common.tree_runs runs one (its order alternating round by round). Each
figure is a tree's best ms per call over the rounds (the least-disturbed run on a shared
machine), the ratio first tree / others beside it; one thread.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common import built_trees, emit, tree_runs

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from psr.store.cpu_kernels import cpu_linear
N, K, tokens = int(sys.argv[1]), int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
torch.manual_seed(0)
res = {}
for dt in (torch.bfloat16, torch.float16, torch.float32):
    ws = [torch.randn(N, K).to(dt) for _ in range(2)]  # two: the second streams from memory
    for T in tokens:
        x = torch.randn(T, K)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for w in ws:
                cpu_linear(x, w, threads=1)
            best = min(best, (time.perf_counter() - t) / len(ws))
        res[f"{str(dt).split('.')[-1]} T={T}"] = best * 1e3
print(json.dumps(res))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", required=True, help="comma-separated checkouts, built in place")
    ap.add_argument("--tokens", default="1,3,4,5,8,32")
    ap.add_argument("--shape", default="4096,2048", help="N,K")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trees = built_trees(args.trees)
    N, K = args.shape.split(",")
    runs: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    child = [sys.executable, "-c", CHILD, N, K, args.tokens]
    for r, t, got in tree_runs(trees, args.rounds, child):
        runs[t].append(got)
        print(f"round {r + 1}/{args.rounds} {t}; load {os.getloadavg()[0]:.2f}", flush=True)
    names = [t.name for t in trees]
    head = ["case", *[f"{n} ms" for n in names], *[f"{names[0]} / {n}" for n in names[1:]]]
    lines = [f"`{' '.join(sys.argv)}` (N, K = {N}, {K}; one thread)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for key in runs[trees[0]][0]:
        best = [min(d[key] for d in runs[t]) for t in trees]
        ratios = [f"{best[0] / b:.2f}x" for b in best[1:]]
        lines.append(f"| {key} | " + " | ".join([*(f"{b:.2f}" for b in best), *ratios]) + " |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
