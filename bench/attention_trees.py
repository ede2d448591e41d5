"""The row-invariant CPU attention (`psr.store.cpu_attention`), two builds side by side: each
tree's `python/` in its own process, the trees alternated round by round on the same
machine.

    OMP_NUM_THREADS=1 .venv/bin/python bench/attention_trees.py --trees BEFORE,AFTER \
        [--rounds 4] [--out FILE.md]

A tree is a checkout with its extension built in place. Cases: MHA (16 x 16 heads, OLMoE's)
and GQA (32 x 4, Qwen3's), D 128, bf16 and f32, one thread: a decode step at L = 4096 (T =
1), a whole 512-token prefill (T = L = 512) and a 512-token chunk after 1536 cached tokens
(T = 512, L = 2048). Each figure is a tree's best ms per call over its rounds (the
least-disturbed run on a shared machine), with the ratio last tree / first per round beside
(the rounds' spread is the noise).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common import built_trees, emit, tree_runs

CHILD = r"""
import json, time
import torch
torch.set_num_threads(1)
from psr.store import cpu_attention
res = {}
for hq, hkv in ((16, 16), (32, 4)):
    for name, T, L in (("decode 4096", 1, 4096), ("prefill 512", 512, 512),
                       ("prefill 512 at 1536", 512, 2048)):
        for dt in (torch.bfloat16, torch.float32):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(n, h, 128, generator=g).to(dt)
                       for n, h in ((T, hq), (L, hkv), (L, hkv)))
            best = float("inf")
            for _ in range(20 if T == 1 else 3):
                t = time.thread_time()
                cpu_attention(q, k, v, q_start=L - T, scale=128**-0.5, threads=1)
                best = min(best, time.thread_time() - t)
            res[f"{hq}x{hkv} {name} {str(dt).split('.')[-1]}"] = best * 1e3
print(json.dumps(res))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", required=True, help="comma-separated checkouts, built in place")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trees = built_trees(args.trees)
    runs: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for r, t, got in tree_runs(trees, args.rounds, [sys.executable, "-c", CHILD]):
        runs[t].append(got)
        print(f"round {r + 1}/{args.rounds} {t}; load {os.getloadavg()[0]:.2f}", flush=True)
    first, last = trees[0], trees[-1]
    head = ["case", *[f"{t.name} ms" for t in trees], f"{last.name} / {first.name} per round"]
    lines = [f"`{' '.join(sys.argv)}` (one thread; load {os.getloadavg()[0]:.2f})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for key in runs[first][0]:
        best = [min(d[key] for d in runs[t]) for t in trees]
        pairs = zip(runs[first], runs[last], strict=True)
        per = ", ".join(f"{b[key] / a[key]:.2f}" for a, b in pairs)
        lines.append(f"| {key} | " + " | ".join(f"{b:.2f}" for b in best) + f" | {per} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
