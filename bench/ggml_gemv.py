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
On CUDA each timed call includes the op's host side (argument checks, the slot ids' copy, two
launches and a synchronize): a decode step in CUDA graphs pays none of it.

`--sweep` (CUDA; the CPU rehearsal runs it under the interpreter, untimed) times the kernels
alone: each launch configuration in SWEEP (`psr_kernels.expert_ffn.set_ffn_tuning`: tile
sizes, warps, SPLIT_K) replayed as one CUDA graph of 8 layers over distinct experts (more
bytes than the L2), per format; the table gives us a layer, GB/s, the speedup over the
default configuration and whether its output is bit-identical to the default's.
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


# (label, gate/up constexprs, down constexprs) over each kind's defaults; "default" first.
SWEEP: list[tuple[str, dict[str, int], dict[str, int]]] = [
    ("default", {}, {}),  # SPLIT_K_DEFAULT (psr_kernels/_common.py): split since run 3
    ("unsplit", {}, {"SPLIT_K": 0}),
    ("split", {}, {"SPLIT_K": 1}),
    ("split, down 32 rows", {}, {"SPLIT_K": 1, "BLOCK_H": 32}),
    ("gate/up 8 rows", {"BLOCK_F": 8}, {}),
    ("gate/up 8 warps", {"num_warps": 8}, {}),
    ("gate/up 8 rows + split", {"BLOCK_F": 8}, {"SPLIT_K": 1}),
]
SWEEP_FORMATS = "bf16,int4,Q4_K_M,Q8_0"


def sweep(buf: torch.Tensor, H: int, F: int, k: int, formats: list[str], dev: str) -> list[dict]:
    """Each SWEEP configuration per format: us a layer (graph replay on CUDA), its output
    bit-equal to the default's or not."""
    from psr_kernels.expert_ffn import set_ffn_tuning as set_tuning
    from psr_kernels.rowformat import RowFormat

    layers = 8 if dev == "cuda" else 1  # distinct experts per replay: past the L2
    out = []
    for name in formats:
        fmt, dt = fmt_of(name)
        rows = rows_of(buf, fmt, dt, H, F)
        kind = RowFormat.parse(fmt).kind
        x = torch.randn(1, H, device=dev)
        w = torch.rand(1, k, device=dev)
        slot_sets = [
            ((i * k + torch.arange(k)) % rows.shape[0])[None].to(dev) for i in range(layers)
        ]

        def layer_calls(rows=rows, fmt=fmt, x=x, w=w, slot_sets=slot_sets) -> list:
            return [
                pk.expert_ffn(x, rows, s, w, H, F, fmt=fmt, check_slots=False) for s in slot_sets
            ]

        base_out, base_us = None, None
        for label, c1, c2 in SWEEP:
            set_tuning(kind, gate_up=c1, down=c2)
            try:
                got = layer_calls()
                if dev == "cuda":
                    import triton.testing

                    us = triton.testing.do_bench_cudagraph(layer_calls, rep=20) * 1e3 / layers
                else:
                    t0 = time.perf_counter()
                    layer_calls()
                    us = (time.perf_counter() - t0) * 1e6 / layers
                err = ""
            except Exception as e:  # a configuration the compiler rejects: say so, go on
                got, us, err = None, float("nan"), f"{type(e).__name__}: {str(e)[:80]}"
            finally:
                set_tuning(kind)
            if label == "default":
                base_out, base_us = got, us
            same = got is not None and base_out is not None
            same = same and all(torch.equal(a, b) for a, b in zip(got, base_out, strict=True))
            nb = k * row_bytes(fmt, dt, H, F)
            out.append(
                dict(
                    format=name, config=label, gate_up=c1, down=c2, us=us,
                    gb_s=nb / us / 1e3 if us == us else float("nan"),
                    speedup=(base_us / us) if base_us and us == us else float("nan"),
                    bit_equal=bool(same), error=err,
                )
            )  # fmt: skip
    return out


def sweep_table(rows: list[dict], dev: str) -> str:
    note = "" if dev == "cuda" else "; interpreter: times not meaningful"
    lines = [
        f"# expert FFN launch sweep ({dev}{note})",
        "",
        "| format | configuration | us / layer | GB/s | vs default | bit-equal to default |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = f" ({r['error']})" if r["error"] else ""
        lines.append(
            f"| {r['format']} | {r['config']}{note} | {r['us']:.1f} | {r['gb_s']:.1f} | "
            f"{r['speedup']:.2f}x | {r['bit_equal']} |"
        )
    best = {}
    for r in rows:
        if r["us"] == r["us"] and (r["format"] not in best or r["us"] < best[r["format"]]["us"]):
            best[r["format"]] = r
    lines.append("")
    for f, r in best.items():
        lines.append(f"best {f}: {r['config']} {r['speedup']:.2f}x (bit-equal {r['bit_equal']})")
    return "\n".join(lines)


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
    ap.add_argument("--sweep", action="store_true", help="launch configurations (SWEEP)")
    ap.add_argument("--sweep-formats", default=SWEEP_FORMATS)
    ap.add_argument("--out", type=Path, default=None, help="--sweep: a markdown file too")
    a = ap.parse_args()
    H, F = (int(v) for v in a.shape.split("x"))
    dev = a.device
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0x3A, 0x3F, (a.mib << 20,), dtype=torch.uint8, generator=g).to(dev)
    if a.sweep:
        rows = sweep(buf, H, F, a.top_k, a.sweep_formats.split(","), dev)
        table = sweep_table(rows, dev)
        print(table)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(table + "\n")
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            meta = dict(load=os.getloadavg(), device=dev, shape=[H, F], top_k=a.top_k)
            a.json.write_text(json.dumps(dict(meta=meta, sweep=rows), indent=2))
        return
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
