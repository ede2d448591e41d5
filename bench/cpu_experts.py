"""CPU expert kernels against the machine: each format's bytes/s beside a STREAM triad.

    .venv/bin/python bench/cpu_experts.py [--threads 1,2] [--rounds 5] [--out FILE.json]
    .venv/bin/python bench/cpu_experts.py --baseline DIR ...   # before / after, side by side

For each expert size (OLMoE H 2048 x F 1024, Qwen3-30B-A3B 2048 x 768, gpt-oss 2880 x 2880),
format (fp32, bf16, fp16, int8, fp8, int4, and GGUF's block types: Q8_0, Q6_K, Q5_K, Q4_K,
Q4_K_M's mix (Q4_K gate/up, Q6_K down), Q4_0, MXFP4; a K-quant only where 256 divides both
dims: not gpt-oss), ISA path and thread count: batch-1 calls of
`psr.store.cpu_expert_ffn` over top-k experts, each call the next k rows of a buffer of
`--mib` MiB (several times the last-level cache: the weights stream from memory); int4 groups of 128
(64 for gpt-oss, whose 2880 is no multiple of 128).
bytes/s counts each routed expert's row bytes once (codes, scales and padding); the
triad (a = b + s * c over 64 MiB arrays, 12 bytes per element) runs on the same thread
pool and thread count. Rounds interleave the configurations (A B A B ...) and the table
shows medians; the machine's load (`uptime`) is printed beside it: on a shared machine
the figures are noisy.

--baseline DIR compares two builds of the kernels: DIR holds another build's `psr` package
(python/psr's files beside another psr._C, as scripts/sanitize.sh lays one out). Rounds
alternate between it ("before") and this tree ("after"), each round of each in its own
process (one process loads one extension), and the table shows both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import psr_kernels as pk
from psr import store

SIZES = {"olmoe": (2048, 1024), "qwen3-30b": (2048, 768), "gpt-oss": (2880, 2880)}
FORMATS: dict[str, tuple[str | None, torch.dtype]] = {
    "fp32": (None, torch.float32),
    "bf16": (None, torch.bfloat16),
    "fp16": (None, torch.float16),
    "int8": ("int8", torch.uint8),
    "fp8": ("fp8", torch.uint8),
    "int4": ("int4", torch.uint8),
    **{
        t: (pk.ggml_format(t, t, t), torch.uint8)
        for t in ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "MXFP4")
    },
    "Q4_K_M": (pk.ggml_format("Q4_K", "Q4_K", "Q6_K"), torch.uint8),
}
DEFAULT_FORMATS = ("fp32", "bf16", "fp16", "int8", "fp8", "int4")


def _buffer(nbytes: int) -> torch.Tensor:
    """The rows every configuration reads: bytes 0x3a..0x3e, which are normal, moderate
    numbers in every format (fp32/bf16/fp16 weights and fp32 scales near 0.01 or 1, int8
    near 60, e4m3 near 1, int4 nibbles 3 / -5 ...): no denormals to slow anything."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0x3A, 0x3F, (nbytes,), dtype=torch.uint8, generator=g)


def group_size(H: int, F: int) -> int:
    """int4's scale group: 128 where it divides both dims, else the largest smaller power of
    two that does (gpt-oss's 2880 takes 64)."""
    return next(g for g in (128, 64, 32, 16) if H % g == 0 and F % g == 0)


def _fits(H: int, F: int, fmt: str | None) -> bool:
    """Whether the format's blocks tile both dims (K-quants: 256)."""
    if fmt is None or not pk.is_ggml_format(fmt):
        return True
    try:
        pk.GGMLLayout.of(fmt, H, F)
    except ValueError:
        return False
    return True


def _rows(buf: torch.Tensor, H: int, F: int, fmt: str | None, dtype: torch.dtype) -> torch.Tensor:
    """`buf` as as many expert rows of (H, F, format) as fit."""
    if fmt is not None and pk.is_ggml_format(fmt):
        nbytes = pk.GGMLLayout.of(fmt, H, F).nbytes
    elif fmt is None:
        nbytes = 3 * H * F * torch.empty((), dtype=dtype).element_size()
    else:
        nbytes = pk.QuantLayout.of(fmt, H, F, group_size(H, F)).nbytes
    n = buf.numel() // nbytes
    rows = buf[: n * nbytes].view(dtype).view(n, -1)
    return _mxfp4_scales(rows, fmt, H, F) if fmt is not None and "MXFP4" in fmt else rows


def _mxfp4_scales(rows: torch.Tensor, fmt: str, H: int, F: int) -> torch.Tensor:
    """A copy whose MXFP4 blocks have scale 2^0: the shared bytes' e8m0 (0x3a: 2^-69) makes
    the FFN's intermediate subnormal, which the CPU's floating point slows to a crawl and no
    real model has."""
    rows = rows.clone()
    lay = pk.GGMLLayout.of(fmt, H, F)
    for t, at, nb in zip(lay.types, (lay.gate, lay.up, lay.down), lay.part_bytes, strict=True):
        if t == "MXFP4":
            rows[:, at : at + nb : 17] = 127
    return rows


class _Walk:
    """Consecutive rows, wrapping: a row comes back only after the whole buffer (several
    times the last-level cache) was read, so every call streams from memory."""

    def __init__(self) -> None:
        self.at = 0

    def next(self, n: int, k: int) -> torch.Tensor:
        ids = (self.at + torch.arange(k)) % n
        self.at = (self.at + k) % n
        return ids[None]


def _time_call(rows, fmt, H, F, k, threads, isa, calls, walk) -> float:
    """Median seconds of `calls` batch-1 calls, each over the next k rows."""
    x, w = torch.randn(1, H), torch.rand(1, k)
    times = []
    for _ in range(calls):
        slots = walk.next(rows.shape[0], k)
        t0 = time.perf_counter()
        store.cpu_expert_ffn(
            x, rows, slots, w, H, F, fmt=fmt, group_size=group_size(H, F), threads=threads, isa=isa
        )
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help=", ".join(FORMATS))
    ap.add_argument("--isas", default="", help="default: the best this CPU runs")
    ap.add_argument("--mib", type=int, default=1024, help="MiB of rows (>> the L3 cache)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--calls", type=int, default=5, help="calls per round (median)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--baseline", type=Path, default=None, help="another build's psr package dir")
    ap.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # one child's rounds
    return ap.parse_args()


def _measure(a: argparse.Namespace) -> dict[str, list[float]]:
    """bytes/s of every configuration (and the triad) per round, keyed size/format/isa/threads."""
    threads = [int(t) for t in a.threads.split(",")]
    isas = a.isas.split(",") if a.isas else [store.cpu_isas()[-1]]
    buf = _buffer(a.mib << 20)
    walk = _Walk()
    slabs = {
        (s, f): _rows(buf, *SIZES[s], *FORMATS[f])
        for s in a.sizes.split(",")
        for f in a.formats.split(",")
        if _fits(*SIZES[s], FORMATS[f][0])
    }
    res: dict[str, list[float]] = {}
    for _ in range(a.rounds):  # A B A B: every configuration once per round
        for t in threads:
            res.setdefault(f"triad/{t}", []).append(store.cpu_triad(1 << 24, t, 3))
            for (s, f), slab in slabs.items():
                H, F = SIZES[s]
                for isa in isas:
                    dt = _time_call(slab, FORMATS[f][0], H, F, a.top_k, t, isa, a.calls, walk)
                    nbytes = a.top_k * slab.shape[1] * slab.element_size()
                    res.setdefault(f"{s}/{f}/{isa}/{t}", []).append(nbytes / dt)
    return res


def _compare(a: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Rounds alternating between the baseline package and this tree, one process each."""
    child = [sys.executable, __file__, "--raw", "--rounds", "1"]
    for k in ("threads", "sizes", "formats", "isas", "mib", "top_k", "calls"):
        child += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    res: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for _ in range(a.rounds):
        for label in res:
            env = dict(os.environ)
            if label == "before":
                env["PYTHONPATH"] = os.pathsep.join([str(a.baseline), env.get("PYTHONPATH", "")])
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
            for key, v in json.loads(out.stdout.splitlines()[-1]).items():
                res[label].setdefault(key, []).extend(v)
    return res


def _table(res: dict[str, dict[str, list[float]]]) -> list[dict[str, object]]:
    """Rows of the printed table: each configuration's median bytes/s per build, against one
    triad (the median of every build's triad rounds: the builds' kernels differ, not it)."""
    med = {lab: {k: statistics.median(v) for k, v in r.items()} for lab, r in res.items()}
    labels = list(med)
    names = [f"{lab} " if lab else "" for lab in labels]
    head = " | ".join(f"{n}GB/s | {n}of triad" for n in names)
    two = len(labels) > 1
    print(
        f"| size | format | isa | threads | {head} | triad GB/s |" + (" speedup |" if two else "")
    )
    print("|---" * (5 + 2 * len(labels) + two) + "|")
    rows: list[dict[str, object]] = []
    for key in med[labels[-1]]:
        if key.startswith("triad/"):
            continue
        s, f, isa, t = key.split("/")
        bw = {lab: med[lab][key] for lab in labels}
        tri = statistics.median(v for r in res.values() for v in r[f"triad/{t}"])
        cells = " | ".join(f"{bw[lab] / 1e9:.2f} | {bw[lab] / tri:.0%}" for lab in labels)
        extra = f" {bw[labels[-1]] / bw[labels[0]]:.2f}x |" if two else ""
        print(f"| {s} | {f} | {isa} | {t} | {cells} | {tri / 1e9:.1f} |{extra}")
        row: dict[str, object] = dict(size=s, format=f, isa=isa, threads=int(t), triad=tri)
        for lab in labels:
            row[f"{lab}_bytes_per_s" if two else "bytes_per_s"] = bw[lab]
        rows.append(row)
    return rows


def main() -> None:
    a = _args()
    if a.raw:
        print(json.dumps(_measure(a)))
        return
    res = _compare(a) if a.baseline else {"": _measure(a)}
    load = os.getloadavg()
    print(f"# CPU expert kernels, batch 1, top-{a.top_k}; load {load[0]:.2f} {load[1]:.2f}")
    print(f"# cpu isas: {', '.join(store.cpu_isas())}; medians of {a.rounds} rounds")
    rows = _table(res)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        args = vars(a) | {"out": str(a.out), "baseline": a.baseline and str(a.baseline)}
        meta = dict(load=load, isas=store.cpu_isas(), args=args)
        a.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
