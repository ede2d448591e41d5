"""The row-invariant CPU forward's fused attention (runtime/attention.py `fuse`: the rotary
embedding, the cache write and rows_attention in one kernel call) against the module's own
forward, and the plain (chunked) forward beside them: decode ms/token of one model in one
process, the three configurations alternating per round (ratios within a round: the
machine is shared), and whether the fused and unfused row-invariant tokens agree.

    OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python bench/fused_attention.py \\
        --model /work/cache/gguf/olmoe-L16-Q4_K_M.gguf --rounds 3 \\
        --out bench/results/cpu/fused_attention/olmoe-L16.md

`psr.load(FILE, "exact", 1.0, device="cpu", threads=1)`; per configuration a warm-up, then
per round `generate` of `--tokens` + 1 tokens from an 8-token prompt, timed from the first
new token to the last (a streamer's timestamps).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import psr
from psr.runtime import attention

CONFIGS = ("plain", "rows", "fused")


class _Clock:
    def __init__(self) -> None:
        self.t: list[float] = []

    def put(self, _value: Any) -> None:
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def _configure(model: Any, name: str) -> None:
    """plain: the chunked forward; rows: the row-invariant one with the modules' attention;
    fused: the row-invariant one as it runs (the fused attention)."""
    model.set_row_invariant(name != "plain")
    if name != "plain":
        attention.fuse(model.hf, name == "fused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="a GGUF / checkpoint, or default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="a markdown file for the table")
    a = ap.parse_args()
    torch.set_num_threads(1)
    src = psr.DEFAULT_MODEL if a.model == "default" else a.model
    model = psr.load(src, "exact", 1.0, device="cpu", threads=1, progress=False)
    ids = torch.randint(0, 2048, (1, 8), generator=torch.Generator().manual_seed(0))
    ms: dict[str, list[float]] = {c: [] for c in CONFIGS}
    tokens: dict[str, list[int]] = {}
    for c in CONFIGS:
        _configure(model, c)
        model.generate(ids, max_new_tokens=8)
    for r in range(a.rounds):
        for c in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            _configure(model, c)
            clock = _Clock()
            out = model.generate(ids, max_new_tokens=a.tokens + 1, streamer=clock)
            ms[c].append(1e3 * (clock.t[-1] - clock.t[1]) / a.tokens)
            tokens[c] = out[0, -a.tokens :].tolist()
        print(f"round {r}: " + ", ".join(f"{c} {ms[c][-1]:.2f} ms" for c in CONFIGS), flush=True)
    lines = [
        f"`{' '.join(sys.argv)}` (load {os.getloadavg()[0]:.2f})",
        "",
        f"{Path(str(src)).name}, decode ms/token, one thread",
        "",
        "| round | plain | row-invariant | row-invariant, fused | fused / row-invariant |"
        " fused / plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in range(a.rounds):
        p, w, f = (ms[c][r] for c in CONFIGS)
        lines.append(f"| {r} | {p:.2f} | {w:.2f} | {f:.2f} | {f / w:.3f} | {f / p:.3f} |")
    same = tokens["rows"] == tokens["fused"]
    lines += ["", f"fused and unfused row-invariant tokens equal: {same}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
