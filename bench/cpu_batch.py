"""CPU kernels with several tokens per weight read, side by side with one token per call.

    .venv/bin/python bench/cpu_batch.py [--threads 1,2] [--rounds 3] [--out FILE.json]

(a) The grouped expert FFN (`psr.store.cpu_expert_ffn`): T = 1, 2, 4, 8 tokens routed to the
    same top-k experts in one call, against T separate T = 1 calls over those experts (what a
    batch costs without grouping), Qwen3-30B-A3B-shaped experts (H 2048, F 768, top-8, 128
    experts in the rows: each call takes the next 8, so its first read streams from memory),
    Q4_K and bf16 rows.
(b) The dense `psr.store.cpu_linear` against torch's `F.linear` (bf16 weights and inputs,
    torch's threads set to the same count) at T = 1, 4, 8 for a [4096, 2048] projection and
    an LM-head-like [32000, 2048]; and cpu_linear at T = 8 against 8 T = 1 calls.
Rounds interleave every configuration, and within one the compared calls alternate (A B A B
...); the tables give each call's best time over all rounds (the least-disturbed run on a
loaded machine; medians in the JSON) and their ratios. The machine's load is printed
beside them: on a shared machine absolute figures are noisy, the ratios less so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as tF
from cpu_experts import _buffer, _rows

import psr_kernels as pk
from psr import store

H, F, TOP_K, EXPERTS = 2048, 768, 8, 128
EXPERT_FORMATS: dict[str, tuple[str | None, torch.dtype]] = {
    "Q4_K": (pk.ggml_format("Q4_K", "Q4_K", "Q4_K"), torch.uint8),
    "bf16": (None, torch.bfloat16),
}
TOKENS = (1, 2, 4, 8)
LINEARS = {"proj 4096x2048": (4096, 2048), "lm_head 32000x2048": (32000, 2048)}
LINEAR_TOKENS = (1, 4, 8)


class _Experts:
    """128 experts' rows of one format; each call routes all its tokens to the next 8."""

    def __init__(self, fmt: str | None, dtype: torch.dtype, isa: str) -> None:
        nbytes = pk.GGMLLayout.of(fmt, H, F).nbytes if fmt else 3 * H * F * dtype.itemsize
        self.fmt, self.isa = fmt, isa
        self.rows = _rows(_buffer(EXPERTS * nbytes), H, F, fmt, dtype)
        assert self.rows.shape[0] == EXPERTS
        self.at = 0

    def next_slots(self, T: int) -> torch.Tensor:
        ids = (self.at + torch.arange(TOP_K)) % EXPERTS
        self.at = (self.at + TOP_K) % EXPERTS
        return ids[None].expand(T, TOP_K).contiguous()

    def call(self, x: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, threads: int) -> None:
        store.cpu_expert_ffn(
            x, self.rows, slots, w, H, F, fmt=self.fmt, threads=threads, isa=self.isa
        )


def _alternate(fns: list[Callable[[], object]], reps: int) -> list[list[float]]:
    """Seconds of each of `fns` over `reps` alternating calls (f0 f1 .. f0 f1 ..)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return times


def _experts_round(ex: _Experts, T: int, threads: int, reps: int) -> list[list[float]]:
    """Seconds of one T-token call and of T one-token calls, over the same experts."""
    x, w = torch.randn(T, H), torch.rand(T, TOP_K)

    def grouped() -> None:
        ex.call(x, ex.next_slots(T), w, threads)

    def separate() -> None:
        slots = ex.next_slots(T)
        for t in range(T):
            ex.call(x[t : t + 1], slots[t : t + 1], w[t : t + 1], threads)

    return _alternate([grouped, separate], reps)


def _linear_round(W: torch.Tensor, T: int, threads: int, reps: int, isa: str) -> list[list[float]]:
    """Seconds of cpu_linear at T, F.linear at T, and (T = 8) 8 one-token cpu_linear calls."""
    x = torch.randn(T, W.shape[1]).to(torch.bfloat16)
    torch.set_num_threads(threads)
    rows = [x[t : t + 1] for t in range(T)]
    fns: list[Callable[[], object]] = [
        lambda: store.cpu_linear(x, W, threads=threads, isa=isa),
        lambda: tF.linear(x, W),
    ]
    if T == 8:
        fns.append(lambda: [store.cpu_linear(r, W, threads=threads, isa=isa) for r in rows])
    return _alternate(fns, reps)


def _extend(res: dict, key: tuple[str, int, int], times: list[list[float]]) -> None:
    """Adds one round's times per compared call to res[key]."""
    old = res.setdefault(key, [[] for _ in times])
    for acc, new in zip(old, times, strict=True):
        acc.extend(new)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="calls per configuration per round")
    ap.add_argument("--isa", default="auto", help="auto or one of psr.store.cpu_isas()")
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


def main() -> None:
    a = _args()
    threads = [int(t) for t in a.threads.split(",")]
    experts = {name: _Experts(*spec, a.isa) for name, spec in EXPERT_FORMATS.items()}
    g = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
        for name, (n, k) in LINEARS.items()
    }
    ex_res: dict[tuple[str, int, int], list[list[float]]] = {}
    lin_res: dict[tuple[str, int, int], list[list[float]]] = {}
    load0 = os.getloadavg()
    for _ in range(a.rounds):
        for t in threads:
            for name, ex in experts.items():
                for T in TOKENS:
                    _extend(ex_res, (name, t, T), _experts_round(ex, T, t, a.reps))
            for name, W in weights.items():
                for T in LINEAR_TOKENS:
                    _extend(lin_res, (name, t, T), _linear_round(W, T, t, a.reps, a.isa))
    load1 = os.getloadavg()
    print(f"# load before {load0[0]:.2f} {load0[1]:.2f}, after {load1[0]:.2f} {load1[1]:.2f}")
    isa = store.cpu_isas()[-1] if a.isa == "auto" else a.isa
    print(f"# isa {isa}; best of {a.rounds} rounds x {a.reps} alternating calls")
    print("\n(a) grouped expert FFN, Qwen3-30B-A3B experts (2048 x 768, top-8 of 128 rows)")
    print("| format | threads | T | one T-token call ms | T one-token calls ms | ratio |")
    print("|---|---|---|---|---|---|")
    rows: list[dict[str, object]] = []
    for (name, t, T), v in ex_res.items():
        one, sep = (min(x) for x in v)
        print(f"| {name} | {t} | {T} | {one * 1e3:.2f} | {sep * 1e3:.2f} | {sep / one:.2f}x |")
        rows.append(dict(part="experts", format=name, threads=t, tokens=T, grouped_s=one,
                         separate_s=sep, medians_s=[statistics.median(x) for x in v]))  # fmt: skip
    print("\n(b) cpu_linear against torch F.linear, bf16 weights and inputs")
    print("| weight | threads | T | cpu_linear ms | F.linear ms | F.linear / cpu_linear |"
          " 8 x T=1 cpu_linear ms | 8 x T=1 / T=8 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for (name, t, T), v in lin_res.items():
        ours, theirs = min(v[0]), min(v[1])
        obo = min(v[2]) if len(v) > 2 else None
        tail = f"{obo * 1e3:.2f} | {obo / ours:.2f}x" if obo else "- | -"
        print(f"| {name} | {t} | {T} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | "
              f"{theirs / ours:.2f}x | {tail} |")  # fmt: skip
        rows.append(dict(part="linear", weight=name, threads=t, tokens=T, cpu_linear_s=ours,
                         f_linear_s=theirs, one_by_one_s=obo,
                         medians_s=[statistics.median(x) for x in v]))  # fmt: skip
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(load=[load0, load1], isas=store.cpu_isas(), args=vars(a) | {"out": str(a.out)})
        a.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
