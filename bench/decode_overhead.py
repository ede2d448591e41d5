"""Per-call cost of a decode token's small dense ops on the CPU, each path beside the one it
replaced, in one process (issue 39: the token's time outside the weight kernels): a dense
layer (`QuantLinear`: its prepared `LinearPlan` call against its forward before it,
`dense_linear`'s checked `cpu_linear` call; both with cpu_max_threads and PSR_COMPUTE read
once, which the earlier tree read per call) and an RMS norm (psr's row kernel against the
norm class's torch forward), at the 16-layer OLMoE file's shapes, one token, one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. .venv/bin/python bench/decode_overhead.py [--reps 3]

Each figure: the best over `--reps` of the mean thread-CPU microseconds over `--calls`
calls; the paths alternate within each rep, so the ratios are side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    t = time.thread_time()
    for _ in range(calls):
        fn()
    return 1e6 * (time.thread_time() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from ggml_blocks import random_blocks
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from psr.runtime.dense import QuantLinear, dense_linear, row_aligned
    from psr.runtime.norms import row_norms
    from psr_kernels.linear import LinearFormat

    H = 2048
    fmt = LinearFormat.parse("Q4_K", None)
    raw = random_blocks("Q4_K", 64, H, np.random.default_rng(0))  # few rows: the call, not bytes
    q = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(64, -1)
    lin = QuantLinear(q, fmt, H, compute="auto")

    class Before(QuantLinear):
        """QuantLinear's forward before LinearPlan (dense_linear -> cpu_linear per call)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            y = dense_linear(
                x.reshape(-1, self.in_features), self.qweight, self.fmt, self.in_features,
                self.scales, self.bias, self.compute,
            )  # fmt: skip
            return row_aligned(y.reshape(*lead, self.out_features))

    before = Before(q, fmt, H, compute="auto")
    x = torch.randn(1, 1, H)
    norm = OlmoeRMSNorm(H)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    holder = torch.nn.Sequential(norm)
    row_norms(holder)
    cases: dict[str, Callable[[], object]] = {
        "dense layer [1, 2048] x Q4_K [64, 2048]: forward before (cpu_linear)": lambda: before(x),
        "dense layer: QuantLinear (LinearPlan)": lambda: lin(x),
        "RMS norm [1, 1, 2048]: the class's torch forward": lambda: OlmoeRMSNorm.forward(norm, x),
        "RMS norm: psr's row kernel (module call)": lambda: norm(x),
    }
    best = dict.fromkeys(cases, float("inf"))
    with torch.no_grad():
        for _ in range(a.reps):
            for name, fn in cases.items():
                best[name] = min(best[name], _us(fn, a.calls))
    names = list(cases)
    print("| op | CPU us / call | new / old |\n|---|---|---|")
    for i, name in enumerate(names):
        ratio = f"{best[name] / best[names[i - 1]]:.2f}x" if i % 2 else ""
        print(f"| {name} | {best[name]:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
