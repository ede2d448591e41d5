"""The row-invariant CPU attention (`psr.store.cpu_attention`) side by side with torch's SDPA.

    .venv/bin/python bench/cpu_attention.py [--rounds 5] [--isa auto] [--heads 32x4]
        [--out FILE.json]

Hq x Hkv heads (default 32 x 4, GQA; 16x16 is OLMoE's MHA), D 128, one thread
(torch.set_num_threads(1), the kernel's threads=1), bf16 and f32: a decode step at L = 512
and 4096 (T = 1; SDPA without a mask, which is the causal one for the last position), a
512-token prefill (T = L = 512; SDPA is_causal, and SDPA one query row at a time, which is
what a row-invariant attention costs without this kernel), and a 512-token prefill chunk
after 1536 cached tokens (T = 512, L = 2048; SDPA with the causal mask of the chunk). Run it
with another tree's python/ on PYTHONPATH for that tree's kernel: SDPA is the yardstick
common to both runs. Inputs are in transformers' layout ([1, H, L, D]); the kernel reads them as
[L, H, D] views in place. Rounds interleave every configuration and alternate the compared
calls; the table gives each call's best CPU time (thread_time) over the rounds, and the
ratios SDPA / kernel (> 1: the kernel is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as tF
from common import write_json

from psr import store

D = 128
CASES = [
    ("decode L=512", 1, 512),
    ("decode L=4096", 1, 4096),
    ("prefill 512", 512, 512),
    ("prefill 512 at 1536", 512, 2048),
]
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def _calls(
    T: int, L: int, dtype: torch.dtype, isa: str, HQ: int, HKV: int
) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, T, D, generator=g).to(dtype)
    k = torch.randn(1, HKV, L, D, generator=g).to(dtype)
    v = torch.randn(1, HKV, L, D, generator=g).to(dtype)
    scale = D**-0.5
    qt, kt, vt = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
    # T = 1 at the last position: every key, no mask; a chunk at depth: its causal mask
    mask = torch.ones(T, L, dtype=torch.bool).tril(L - T) if 1 < T < L else None

    def kernel() -> object:
        return store.cpu_attention(qt, kt, vt, q_start=L - T, scale=scale, threads=1, isa=isa)

    def sdpa() -> object:
        return tF.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=T == L > 1, scale=scale, enable_gqa=True
        )

    def sdpa_row(t: int) -> object:  # query row t over its keys 0..p
        p = L - T + t
        return tF.scaled_dot_product_attention(
            q[:, :, t : t + 1], k[:, :, : p + 1], v[:, :, : p + 1], scale=scale, enable_gqa=True
        )

    def sdpa_rows() -> object:
        return [sdpa_row(t) for t in range(T)]

    calls: dict[str, Callable[[], object]] = {"cpu_attention": kernel, "sdpa": sdpa}
    if T == L > 1:  # row by row at depth: minutes, and no longer the alternative
        calls["sdpa per row"] = sdpa_rows
    return calls


def _cpu_time(fn: Callable[[], object]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isa", default="auto", help="the kernel's ISA path (store.cpu_isas())")
    ap.add_argument("--heads", default="32x4", help="query x kv heads, e.g. 16x16")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    HQ, HKV = (int(x) for x in args.heads.split("x"))
    torch.set_num_threads(1)
    isa = store.cpu_isas()[-1] if args.isa == "auto" else args.isa
    setups = {
        (name, dn): _calls(T, L, dt, args.isa, HQ, HKV)
        for name, T, L in CASES
        for dn, dt in DTYPES.items()
    }
    times: dict[tuple[str, str], dict[str, list[float]]] = {
        key: {c: [] for c in calls} for key, calls in setups.items()
    }
    for calls in setups.values():  # warm-up
        for fn in calls.values():
            fn()
    for _ in range(args.rounds):
        for key, calls in setups.items():
            for c, fn in calls.items():
                times[key][c].append(_cpu_time(fn))
    print(f"load average {os.getloadavg()[0]:.1f}; one thread; Hq {HQ}, Hkv {HKV}, D {D}; "
          f"best CPU ms of {args.rounds} rounds; isa {isa}")  # fmt: skip
    print("| case | dtype | cpu_attention ms | sdpa ms | sdpa / kernel | sdpa per row ms "
          "| per row / kernel |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    rows = []
    for (name, dn), t in times.items():
        best = {c: min(v) * 1e3 for c, v in t.items()}
        kern = best["cpu_attention"]
        per_row = best.get("sdpa per row")
        pr = f"{per_row:.2f} | {per_row / kern:.2f}" if per_row else "- | -"
        print(f"| {name} | {dn} | {kern:.2f} | {best['sdpa']:.2f} | "
              f"{best['sdpa'] / kern:.2f} | {pr} |")  # fmt: skip
        rows.append({
            "case": name, "dtype": dn, "best_ms": best,
            "median_ms": {c: statistics.median(v) * 1e3 for c, v in t.items()},
        })  # fmt: skip
    if args.out:
        write_json(args.out, {"rounds": args.rounds, "isa": isa, "heads": [HQ, HKV],
                              "rows": rows, "load": os.getloadavg()[0]})  # fmt: skip


if __name__ == "__main__":
    main()
