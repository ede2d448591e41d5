"""Each psr kernel against its torch reference, side by side, at real MoE shapes.

    python bench/bench_kernels.py [--json bench/results/kernels.json] [--tiny]
    pytest bench/bench_kernels.py --benchmark-enable

On a GPU the ratios (reference time / kernel time) are what we report. Without
one the kernels run under the Triton interpreter: the script only proves they
run (one repeat, and the ratio is meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

import pytest

import psr_kernels as pk

# name: (E, k, H, F)
SHAPES = {
    "olmoe-1b-7b": (64, 8, 2048, 1024),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}
TINY = {"tiny": (16, 4, 64, 32)}  # --tiny: the CPU rehearsal of bench/gpu_bench.sh


def make_case(name: str, device: str, dtype: torch.dtype = torch.bfloat16):
    E, k, H, F = {**SHAPES, **TINY}[name]
    gen = torch.Generator().manual_seed(0)
    C = E // 2
    case = {
        "E": E,
        "k": k,
        "H": H,
        "F": F,
        "logits": torch.randn(1, E, generator=gen).to(device),
        "hidden": torch.randn(1, H, generator=gen).to(dtype).to(device),
        "gate": (torch.randn(E, H, generator=gen) / H**0.5).to(dtype).to(device),
        "norm": torch.ones(H, dtype=dtype, device=device),
        "mask": (torch.arange(E) % 2 == 0).to(device),
        "slab": (torch.randn(C, 3 * H * F, generator=gen) / H**0.5).to(dtype).to(device),
        "slots": torch.randperm(C, generator=gen)[:k][None].to(device),
        "weights": torch.rand(1, k, generator=gen).to(device),
    }
    # A prefill chunk for the grouped GEMM: P tokens, each routed to k distinct slots.
    P = 8 if name in TINY else 512
    case["chunk_x"] = torch.randn(P, H, generator=gen).to(dtype).to(device)
    ids = torch.stack([torch.randperm(C, generator=gen)[:k] for _ in range(P)])
    case["chunk_ids"] = ids.to(device)
    case["chunk_w"] = torch.rand(P, k, generator=gen).to(device)
    return case


def ops(c: dict) -> dict[str, tuple[Callable, Callable]]:
    """op name -> (kernel call, reference call)."""
    k, H, F = c["k"], c["H"], c["F"]
    biased, router = pk.RouteSpec(k, lam=0.3), pk.RouteSpec(k)
    return {
        "route": (
            lambda: pk.route(c["logits"], biased, mask=c["mask"], check_finite=False),
            lambda: pk.route_ref(c["logits"], biased, mask=c["mask"], check_finite=False),
        ),
        "route_hidden": (
            lambda: pk.route_hidden(
                c["hidden"], c["gate"], biased, mask=c["mask"], check_finite=False
            ),
            lambda: pk.route_hidden_ref(
                c["hidden"], c["gate"], biased, mask=c["mask"], check_finite=False
            ),
        ),
        "predict_next": (
            lambda: pk.predict_next(
                c["hidden"], c["norm"], c["gate"], 1, router, mask=c["mask"], check_finite=False
            ),
            lambda: pk.predict_next_ref(
                c["hidden"], c["norm"], c["gate"], 1, router, mask=c["mask"], check_finite=False
            ),
        ),
        "expert_ffn": (
            lambda: pk.expert_ffn(
                c["hidden"], c["slab"], c["slots"], c["weights"], H, F, check_slots=False
            ),
            lambda: pk.expert_ffn_ref(
                c["hidden"], c["slab"], c["slots"], c["weights"], H, F, check_slots=False
            ),
        ),
        # prefill: a chunk's experts, the grouped GEMM against each expert by the reference
        "grouped_expert_ffn": (
            lambda: pk.grouped_expert_ffn(
                c["chunk_x"], c["slab"], c["chunk_ids"], c["chunk_w"], H, F, check_slots=False
            ),
            lambda: pk.grouped_expert_ffn_ref(
                c["chunk_x"], c["slab"], c["chunk_ids"], c["chunk_w"], H, F, check_slots=False
            ),
        ),
    }


def time_fn(fn: Callable, repeats: int, device: str) -> float:
    """Median seconds per call."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
    else:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run(repeats: int | None = None, shapes: dict | None = None) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    repeats = repeats or (100 if device == "cuda" else 1)
    rows = []
    for name in shapes or SHAPES:
        c = make_case(name, device)
        for op, (kern, ref) in ops(c).items():
            tk, tr = time_fn(kern, repeats, device), time_fn(ref, repeats, device)
            rows.append(
                {
                    "shape": name,
                    "op": op,
                    "kernel_us": tk * 1e6,
                    "torch_ref_us": tr * 1e6,
                    "speedup": tr / tk,
                    "device": device,
                    "interpreted": os.environ.get("TRITON_INTERPRET") == "1",
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    out = ["| shape | op | kernel us | torch ref us | ref/kernel |", "|---|---|---|---|---|"]
    out += [
        f"| {r['shape']} | {r['op']} | {r['kernel_us']:.1f} | {r['torch_ref_us']:.1f} | "
        f"{r['speedup']:.2f}x |"
        for r in rows
    ]
    if rows and rows[0]["interpreted"]:
        out.append("\n(Triton interpreter: kernel times are not meaningful)")
    return "\n".join(out)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize(
    "op", ["route", "route_hidden", "predict_next", "expert_ffn", "grouped_expert_ffn"]
)
@pytest.mark.parametrize("impl", ["kernel", "ref"])
def test_kernel(benchmark, name: str, op: str, impl: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and impl == "kernel" and op in ("expert_ffn", "grouped_expert_ffn"):
        pytest.skip("too slow under the interpreter")
    fn = ops(make_case(name, device))[op][0 if impl == "kernel" else 1]
    benchmark(fn)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="one tiny shape (rehearsal)")
    args = p.parse_args(argv)
    rows = run(args.repeats, TINY if args.tiny else None)
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
