"""CPU decode speed and dense bytes of one GGUF file loaded with `dense_format="native"`
(the dense matrices in their Q8_0 blocks) and `"float"` (dequantized), side by side.

    OMP_NUM_THREADS=1 PYTHONPATH=python:.:tests python bench/dense_decode.py \
        [--threads 1] [--tokens 16] [--rounds 3] [--dense Q8_0] [--out FILE.json]

The file: a random Qwen3-MoE (tests/gguf_files.py, llama.cpp's names and blocks) with
hidden 1024, 4 layers, 4 query / 2 KV heads of 256 (gguf_tiny_model's), 8 experts of FFN
512 (Q8_0), an 8192-token vocabulary, its dense matrices in `--dense`. Each
configuration loads once (residency 1.0: no copies), decodes `--tokens` greedy tokens after
an untimed warm-up; rounds interleave the configurations (A B A B ...); the table shows
medians of decode tok/s = N / (time from the first new token to the (N+1)-th, a
streamer's timestamps), threads set explicitly (`threads=`). On the CPU the native path
runs `psr.store.cpu_kernels.cpu_linear` where the extension has it, else the torch
reference (dequantize + F.linear per call); which one ran is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


class _Clock:
    """A transformers streamer: the time of each put (the first is the prompt)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def put(self, value: Any) -> None:
        self.marks.append(time.perf_counter())

    def end(self) -> None:
        pass


def _decode(model: Any, prompt: torch.Tensor, n: int) -> tuple[float, list[int]]:
    clock = _Clock()
    out = model.generate(prompt, max_new_tokens=n + 1, streamer=clock)
    return n / (clock.marks[-1] - clock.marks[1]), out[0, prompt.shape[1] :].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dense", default="Q8_0")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from gguf_files import gguf_tiny_model, write_gguf

    import psr
    from psr.store import cpu_kernels

    work = Path(tempfile.mkdtemp(prefix="psr-dense-decode-"))
    path = work / "dense.gguf"
    m = gguf_tiny_model("qwen3_moe", hidden=1024, ffn=512, layers=4, experts=8, vocab=8192)
    write_gguf(m, path, {"experts": "Q8_0", "dense": a.dense})
    opts = dict(residency=1.0, device="cpu", threads=a.threads, progress=False)
    runs = {fmt: psr.load(path, "exact", dense_format=fmt, **opts) for fmt in ("native", "float")}
    prompt = torch.tensor([list(range(300, 308))])
    for model in runs.values():
        model.generate(prompt, max_new_tokens=2)  # warm-up
    res: dict[str, list[float]] = {}
    toks: dict[str, list[int]] = {}
    for _ in range(a.rounds):
        for fmt, model in runs.items():
            tps, t = _decode(model, prompt, a.tokens)
            res.setdefault(fmt, []).append(tps)
            toks.setdefault(fmt, t)
    path.unlink()
    cpu = "cpu_linear" if hasattr(cpu_kernels, "cpu_linear") else "torch reference"
    load = os.getloadavg()
    print(f"# dense {a.dense}, {a.threads} thread(s), {a.tokens} tokens, medians of {a.rounds}")
    same = len({tuple(t) for t in toks.values()}) == 1
    print(f"# native CPU path: {cpu}; load {load[0]:.2f}; same tokens: {same}")
    print("| dense_format | device dense MiB | decode tok/s | vs float |")
    print("|---|---|---|---|")
    rows = []
    base = statistics.median(res["float"])
    for fmt, model in runs.items():
        tps = statistics.median(res[fmt])
        mib = model.memory()["device_dense"] / 2**20
        rows.append(dict(dense_format=fmt, dense_mib=mib, tok_s=tps, runs=res[fmt]))
        print(f"| {fmt} | {mib:.1f} | {tps:.2f} | {tps / base:.2f}x |")
    if a.out:
        meta = dict(load=load, cpu_path=cpu, args={k: str(v) for k, v in vars(a).items()})
        a.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
