"""Q4_K rows against Q4_K_X8 tiles (csrc/cpu/expert_gemv.h's tile_q4k) on the CPU kernels'
integer-dot path, side by side in one process, calls alternated, one thread:

* the dense linear at T = 1 on one matrix (from cache) and on many (streaming), and at
  T = 4 / 16 / 64 (prefill chunks);
* the routed expert FFN (cpu_expert_ffn, top-8, OLMoE's H 2048 x F 1024, Q4_K gate / up and
  a Q4_K or Q6_K down) over `--experts` rows, 8 new ones a call (streaming).

* with `--model FILE` (a GGUF), end to end: two loads of the file in one process, expert
  rows tiled at load or not (PSR_CPU_TILES 1 / 0, switched with them for the dense
  weights), `psr.load(FILE, "exact", 1.0, device="cpu", threads=1)` as
  bench/llamacpp_side.py loads it; decode (32 new tokens after an 8-token prompt, tok/s
  of the whole generate) and prefill (a 128-token prompt, one new token), alternated.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python bench/cpu_tiles.py [--reps 15] [--out F.md]
        [--model FILE --rounds 6]

Prints (and writes) a markdown table: median ms of each side and the median of the per-pair
ratios rows / tiles with its interquartile range (pairs of calls taken back to back).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ggml_blocks import random_blocks

import psr._C as _C
import psr_kernels as pk
from psr.store import cpu_kernels as ck

Q4_K, Q4_K_X8, GGML_FMT = 12, 201, 6


def _pairs(a: Callable[[], None], b: Callable[[], None], reps: int) -> tuple[list[float], ...]:
    ta, tb = [], []
    a(), b()  # warm
    for r in range(reps):
        for f, out in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            t = time.perf_counter()
            f()
            out.append(time.perf_counter() - t)
    return ta, tb


def _row(name: str, ta: list[float], tb: list[float], per: int = 1) -> str:
    r = np.array(ta) / np.array(tb)
    q1, q3 = np.percentile(r, [25, 75])
    ma, mb = 1e3 * np.median(ta) / per, 1e3 * np.median(tb) / per
    return f"| {name} | {ma:.3f} | {mb:.3f} | {np.median(r):.2f}x ({q1:.2f}-{q3:.2f}) |"


def linear_rows(reps: int) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for n, k, mats, tokens in ((2048, 2048, 1, (1,)), (2048, 2048, 160, (1, 4, 16, 64))):
        ws = [torch.from_numpy(random_blocks("Q4_K", n, k, rng).copy()).reshape(n, -1)
              for _ in range(mats)]  # fmt: skip
        ts = [ck.tile_q4k(w, k) for w in ws]
        for T in tokens:
            x, y = torch.randn(T, k), torch.empty(T, n)

            def call(
                bufs: list[torch.Tensor], gt: int, T: int = T, x: torch.Tensor = x,
                y: torch.Tensor = y, n: int = n, k: int = k,
            ) -> Callable[[], None]:  # fmt: skip
                def f() -> None:
                    for w in bufs:
                        _C.cpu_linear(x.data_ptr(), T, k, w.data_ptr(), n, w.stride(0), GGML_FMT,
                                      gt, 0, y.data_ptr(), 1, "auto", "q8")  # fmt: skip

                return f

            ta, tb = _pairs(call(ws, Q4_K), call(ts, Q4_K_X8), reps)
            mib = mats * n * k // 256 * 144 / 2**20
            where = "from cache" if mats == 1 else "streaming"
            out.append(_row(f"linear {n}x{k} x{mats} ({mib:.0f} MiB, {where}), T = {T}", ta, tb))
    return out


def ffn_rows(reps: int, experts: int) -> list[str]:
    H, F = 2048, 1024
    out = []
    for down in ("Q4_K", "Q6_K"):
        types = ("Q4_K", "Q4_K", down)
        fmt = pk.RowFormat.blocks(*types)
        tfmt = fmt.tiled(H, F)
        lay = pk.GGMLLayout.of(fmt, H, F)
        rng = np.random.default_rng(1)
        shapes = ((F, H), (F, H), (H, F))
        parts = [torch.from_numpy(random_blocks(t, r, k, rng).copy()).reshape(-1)
                 for t, (r, k) in zip(types, shapes, strict=True)]  # fmt: skip
        one = pk.pack_ggml_expert(lay, parts)
        tone = one.clone()
        for off, nb, (r, k), t in zip((lay.gate, lay.up, lay.down), lay.part_bytes, shapes, types,
                                      strict=True):  # fmt: skip
            if t == "Q4_K":
                tone[off : off + nb] = ck.tile_q4k(one[off : off + nb].view(r, -1), k).reshape(-1)
        slab, tslab = one.repeat(experts, 1), tone.repeat(experts, 1)
        x, w = torch.randn(1, H), torch.rand(1, 8)
        calls = experts // 8

        def run(s: torch.Tensor, f: pk.RowFormat, calls: int = calls, x: torch.Tensor = x,
                w: torch.Tensor = w) -> Callable[[], None]:  # fmt: skip
            def g() -> None:
                for c in range(calls):
                    sl = torch.arange(8 * c, 8 * c + 8).view(1, 8)
                    ck.cpu_expert_ffn(x, s, sl, w, H, F, fmt=f, threads=1, dot="q8")

            return g

        ta, tb = _pairs(run(slab, fmt), run(tslab, tfmt), reps)
        mib = experts * one.numel() / 2**20
        out.append(_row(f"expert FFN, down {down}, {experts} experts ({mib:.0f} MiB), per call",
                        ta, tb, calls))  # fmt: skip
    return out


def model_rows(path: str, rounds: int) -> list[str]:
    import psr

    def tiles(on: bool) -> None:
        os.environ[ck.CPU_TILES_ENV] = "1" if on else "0"
        ck.cpu_tiles_on.cache_clear()

    models = {}
    for on in (False, True):
        tiles(on)
        models[on] = psr.load(path, "exact", 1.0, device="cpu", threads=1, progress=False)
        assert models[on].runtime.computes[0].expert_format.has_tiles == on
    g = torch.Generator().manual_seed(0)
    out = []
    cases = (
        ("generate 32 new tokens after 8 (ms a new token)", 8, 33),
        ("prefill 128 tokens (ms a prompt token)", 128, 1),
    )
    for name, prompt, new in cases:
        ids = torch.randint(0, 2048, (1, prompt), generator=g)

        def run(on: bool, ids: torch.Tensor = ids, new: int = new) -> Callable[[], None]:
            def f() -> None:
                tiles(on)
                models[on].generate(ids, max_new_tokens=new)

            return f

        ta, tb = _pairs(run(False), run(True), rounds)
        n = prompt if new == 1 else new - 1
        out.append(_row(f"{Path(path).name}: {name}", ta, tb, n))
    os.environ.pop(ck.CPU_TILES_ENV)
    ck.cpu_tiles_on.cache_clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", help="a GGUF file: the end-to-end rows (alone)")
    ap.add_argument("--rounds", type=int, default=6, help="pairs of generations (--model)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    head = [
        f"# Q4_K rows against Q4_K_X8 tiles{', end to end' if a.model else ''} (issue 39)",
        "",
        "Both sides in one process, calls alternated in pairs (the order swapped every pair);",
        "a figure is the median over the pairs, the ratio the median of the per-pair ratios",
        "with its interquartile range. Random Q4_K / Q6_K blocks (tests/ggml_blocks.py).",
        "",
        "    OMP_NUM_THREADS=1 PYTHONPATH=python:. python bench/cpu_tiles.py"
        + (f" --model {a.model} --rounds {a.rounds}" if a.model else f" --reps {a.reps}")
        + (f" --out {a.out}" if a.out else ""),
        "",
        f"isa {ck.cpu_isas()[-1]}, one thread, load {os.getloadavg()[0]:.2f}",
        "",
        "| case | rows ms | tiles ms | rows / tiles (IQR) |",
        "|---|---|---|---|",
    ]
    rows = model_rows(a.model, a.rounds) if a.model else []
    lines = head + (rows or linear_rows(a.reps) + ffn_rows(a.reps, a.experts))
    lines.append(f"\nload after {os.getloadavg()[0]:.2f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
