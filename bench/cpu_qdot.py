"""The q8 path's row kernels against the fp32 path's on this CPU (csrc/cpu/ggml_qdot.h):
`cpu_linear` over one random GGUF block matrix [N, K], one thread, CPU time, the dots
alternated within each of `--rounds` rounds (best of rounds), per ISA path, block type and
T (1: the decode row dots; 64: the prefill GEMM). GMAC/s = N K T / CPU seconds.

    PYTHONPATH=python:tests:. .venv/bin/python bench/cpu_qdot.py --isas avx512,avx2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from ggml_blocks import random_blocks

import psr_kernels as pk
from psr import store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isas", type=lambda s: s.split(","), default=store.cpu_isas()[1:])
    ap.add_argument("--types", type=lambda s: s.split(","), default=["Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--dots", type=lambda s: s.split(","), default=["f32", "q8"])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.3, help="CPU time per dot and round")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| isa | type | T | " + " | ".join(f"{d} GMAC/s" for d in a.dots) + " | q8 / f32 |")
    print("|---|---|---|" + "---|" * (len(a.dots) + 1))
    for isa in a.isas:
        for t in a.types:
            raw = random_blocks(t, a.n, a.k, rng)
            w = torch.from_numpy(np.ascontiguousarray(raw)).reshape(a.n, -1)
            kw = dict(ggml_type=pk.ggml_type_id(t), in_features=a.k, threads=1, isa=isa)
            for T in (1, 64):
                x = torch.randn(T, a.k)
                best = dict.fromkeys(a.dots, 0.0)
                for _ in range(a.rounds):
                    for dot in a.dots:
                        c0, n = time.process_time(), 0
                        while time.process_time() - c0 < a.seconds:
                            store.cpu_linear(x, w, dot=dot, **kw)
                            n += 1
                        g = a.n * a.k * T * n / (time.process_time() - c0) / 1e9
                        best[dot] = max(best[dot], g)
                cells = " | ".join(f"{best[d]:.1f}" for d in a.dots)
                ratio = best.get("q8", 0.0) / best["f32"] if "f32" in best else 0.0
                print(f"| {isa} | {t} | {T} | {cells} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
