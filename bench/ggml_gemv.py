"""Each GGUF block format's expert GEMV beside psr's native and int4 rows, on the same shapes.

    .venv/bin/python bench/ggml_gemv.py [--shape 2048x768] [--top-k 8] [--formats ...]
                                        [--device cpu|cuda] [--json FILE]

One batch-1 MoE layer's routed experts (`top_k` of them: gate/up then down) per call, each
call over the next k rows of a buffer of `--mib` MiB (larger than the caches: the weights
stream from memory). GB/s counts each routed row's bytes once, as the store holds and copies
it (blocks, scales, padding). On CUDA every format runs its Triton kernel
(`psr_kernels.expert_ffn`); on the CPU the C++ kernels (`psr.store.cpu_expert_ffn`, the best
ISA path; `--torch-ref` adds the torch reference, dequantize then matmul, per GGUF format).
Rounds interleave the formats (A B A B) and the table shows medians with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import psr_kernels as pk

# name -> (fmt for expert_ffn, slab dtype); GGUF formats: the same type in every part,
# then Q4_K_M's mix (Q4_K gate/up, Q6_K down).
BASE = {"fp32": (None, torch.float32), "bf16": (None, torch.bfloat16), "int4": ("int4", None)}
GGUF = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q5_0", "Q4_0", "MXFP4", "F16")
DEFAULT = ["bf16", "int4", "Q4_K_M", *GGUF]


def fmt_of(name: str) -> tuple[str | None, torch.dtype | None]:
    if name in BASE:
        return BASE[name]
    if name == "Q4_K_M":
        return pk.ggml_format("Q4_K", "Q4_K", "Q6_K"), None
    return pk.ggml_format(name, name, name), None


def row_bytes(fmt: str | None, dtype: torch.dtype | None, H: int, F: int) -> int:
    if fmt is None:
        assert dtype is not None
        return 3 * H * F * dtype.itemsize
    if pk.is_ggml_format(fmt):
        return pk.GGMLLayout.of(fmt, H, F).nbytes
    return pk.QuantLayout.of(fmt, H, F, 128).nbytes


def rows_of(buf: torch.Tensor, fmt: str | None, dtype: torch.dtype | None, H: int, F: int):
    """`buf` as as many rows of the format as fit. Bytes 0x3a..0x3e are moderate normal
    numbers in every format (f16 scales near 0.7, nibbles 10 / 14 / 3, e8m0 near 2^-69 ...)."""
    n = row_bytes(fmt, dtype, H, F)
    k = buf.numel() // n
    rows = buf[: k * n].view(k, n)
    if fmt is not None and "MXFP4" in fmt:  # scale 2^-69 makes the FFN's intermediate
        rows = rows.clone()  # subnormal (slow on CPUs, in no real model): blocks at 2^0
        lay = pk.GGMLLayout.of(fmt, H, F)
        parts = zip(lay.types, (lay.gate, lay.up, lay.down), lay.part_bytes, strict=True)
        for t, at, nb in parts:
            if t == "MXFP4":
                rows[:, at : at + nb : 17] = 127
    return rows.view(dtype) if fmt is None and dtype is not None else rows


def time_call(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def runner(
    rows: torch.Tensor, fmt: str | None, H: int, F: int, k: int, dev: str, ref: bool = False
):
    """A batch-1 call over the next k rows each time (wrapping)."""
    x = torch.randn(1, H, device=dev)
    w = torch.rand(1, k, device=dev)
    at = [0]
    n = rows.shape[0]

    def call() -> None:
        slots = ((at[0] + torch.arange(k)) % n)[None].to(dev)
        at[0] = (at[0] + k) % n
        if dev == "cuda":
            pk.expert_ffn(x, rows, slots, w, H, F, fmt=fmt, check_slots=False)
            torch.cuda.synchronize()
        elif ref:
            pk.expert_ffn_ref(x, rows, slots, w, H, F, fmt=fmt, check_slots=False)
        else:
            from psr.store import cpu_expert_ffn

            cpu_expert_ffn(x, rows, slots, w, H, F, fmt=fmt, group_size=128)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048x768", help="H x F (Qwen3-30B-A3B's experts)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--formats", default=",".join(DEFAULT))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--torch-ref", action="store_true", help="CPU: also the torch reference")
    a = ap.parse_args()
    H, F = (int(v) for v in a.shape.split("x"))
    dev = a.device
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0x3A, 0x3F, (a.mib << 20,), dtype=torch.uint8, generator=g).to(dev)
    names = a.formats.split(",")
    calls = {}
    nbytes = {}
    for name in list(names):
        fmt, dt = fmt_of(name)
        rows = rows_of(buf, fmt, dt, H, F)
        variants = [(name, False)]
        if a.torch_ref and dev == "cpu" and fmt is not None and pk.is_ggml_format(fmt):
            variants.append((f"{name} (torch ref)", True))
            names.insert(names.index(name) + 1, f"{name} (torch ref)")
        for label, ref in variants:
            calls[label] = runner(rows, fmt, H, F, a.top_k, dev, ref)
            nbytes[label] = a.top_k * row_bytes(fmt, dt, H, F)
            calls[label]()  # compile / warm
    res: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(a.rounds):
        for name in names:
            res[name].append(nbytes[name] / time_call(calls[name], a.calls))
    med = {n: statistics.median(v) for n, v in res.items()}
    load = os.getloadavg()
    base = med.get("bf16")
    print(f"# expert GEMV, batch 1, top-{a.top_k}, H {H} x F {F}, {dev}; load {load[0]:.2f}")
    print("| format | bytes/expert | GB/s | ms/layer | GB/s vs bf16 |")
    print("|---|---|---|---|---|")
    out = []
    for n in names:
        ms = nbytes[n] / med[n] * 1e3
        rel = f"{med[n] / base:.2f}x" if base else "-"
        print(f"| {n} | {nbytes[n] // a.top_k} | {med[n] / 1e9:.2f} | {ms:.3f} | {rel} |")
        out.append(dict(format=n, row_bytes=nbytes[n] // a.top_k, bytes_per_s=med[n], ms=ms))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(load=load, device=dev, shape=[H, F], top_k=a.top_k, rounds=a.rounds)
        a.json.write_text(json.dumps(dict(meta=meta, rows=out), indent=2))


if __name__ == "__main__":
    main()
