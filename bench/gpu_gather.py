"""Gather vs DMA: the two ways psr can move an expert from pinned host memory to its slot.

    python bench/gpu_gather.py --out bench/results/gpu            # GPU: OLMoE-1B-7B rows
    python bench/gpu_gather.py --out DIR --tiny                   # CPU rehearsal: tiny rows

  gather       ExpertStore.gather(side=False): the store's copy kernel reads the host rows
               through their mapped device pointer (cudaHostAllocMapped) into slab slots, on
               the current stream (the sync-free decode step's misses);
  gather+join  ExpertStore.gather(side=True) then join(): the same kernel on the store's
               side stream, forked from the current stream and joined back (its prefetches);
  DMA          ExpertStore.enqueue_copies + acquire: cudaMemcpyAsync per row from the same
               pinned memory on the copy engine (the host-driven step).
Per expert format (rows of each format's byte size at OLMoE-1B-7B's H x F: bf16, int8,
fp8, int4; the bytes are random: a copy moves bytes, whatever they encode) and per number
of CTAs per row ($PSR_GATHER_CTAS, read by the CUDA backend when it launches a gather; a
store per setting, the variable set while it is used; "default" is the backend's own
choice, about one CTA per 16 KiB of row, at most 1024). k rows per call (default 8: a
decode token's misses in a layer), alternating between two sets of k experts (2k x row
bytes, more than the L2 at OLMoE rows). Each figure is the median of `--repeats` timed
calls after one warm-up, each call timed alone (CUDA events; the CPU backend:
perf_counter), GB/s = k x row bytes / time. After the gathers the slots are checked
against their host rows (`verified`).

On the CPU backend (--tiny) the same calls run on tiny rows ($PSR_GATHER_CTAS has no effect
there): the times mean nothing, the table's shape and the code paths are what is rehearsed.
Writes DIR/gather.json (rewritten after every store) and DIR/gather.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from common import write_json

from psr.eval.microbench import COPY_FORMATS, format_row_bytes
from psr.store import ExpertStore, LayerSpec, current_backend

OLMOE_HF = (2048, 1024)
TINY_HF = (64, 32)
SETTINGS = ("8", "32", "128", "512", "default")
ENV = "PSR_GATHER_CTAS"


def default_ctas(row_bytes: int) -> int:
    """The CUDA backend's own CTAs per row (csrc/cuda/cuda_backend.cu gather_ctas): one
    per 256 threads x 4 uint4 loads (16 KiB) of row, in [1, 1024]."""
    per_cta = 256 * 16 * 4
    return max(1, min(1024, -(-row_bytes // per_cta)))


@contextmanager
def gather_ctas(setting: str) -> Iterator[None]:
    """$PSR_GATHER_CTAS set to `setting` ("default": unset) for the block, then restored."""
    old = os.environ.get(ENV)
    if setting == "default":
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = setting
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


class _Timer:
    """Seconds of one call: CUDA events on the current stream, or perf_counter (CPU)."""

    def __init__(self, store: ExpertStore) -> None:
        self.store = store
        self.cuda = store.backend == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        self.store.synchronize()
        if not self.cuda:
            t = time.perf_counter()
            fn()
            self.store.synchronize()
            return time.perf_counter() - t
        torch.cuda.synchronize(self.store.device)
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e-3


def measure(
    row_bytes: int,
    k: int = 8,
    repeats: int = 7,
    backend: str | None = None,
    setting: str = "default",
    dma: bool = True,
) -> dict:
    """One store of 2k rows of `row_bytes` (k slots) under CTA `setting`: the median time
    of a k-row gather (inline; side + join) and of k DMA copies (module docstring)."""
    with gather_ctas(setting):
        store = ExpertStore([LayerSpec(2 * k, k, row_bytes)], torch.uint8, backend=backend)
        try:
            return _measure(store, row_bytes, k, repeats, setting, dma)
        finally:
            store.close()


def _measure(
    store: ExpertStore, row_bytes: int, k: int, repeats: int, setting: str, dma: bool
) -> dict:
    row = torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=torch.Generator())
    for e in range(2 * k):
        row[:8] = e  # rows differ: the check below tells a wrong expert from the right one
        store.register(0, e, row)
    slots = list(range(k))
    sets = [[s + k * j for s in slots] for j in (0, 1)]
    dev = store.device
    lists = [
        torch.tensor(
            [[s, e, 0] for s, e in zip(slots, es, strict=True)], dtype=torch.int32, device=dev
        )
        for es in sets
    ]
    count = torch.tensor([k], dtype=torch.int32, device=dev)
    timer = _Timer(store)

    def gather(j: int) -> None:
        store.gather(0, lists[j], count, side=False)

    def side(j: int) -> None:
        store.gather(0, lists[j], count, side=True)
        store.join(0)

    def copies(j: int) -> None:
        store.enqueue_copies(0, slots, sets[j])
        store.acquire(0, slots)
        store.release(0, slots)  # a held slot's next copy would wait for its release

    out = {"setting": setting, "row_bytes": row_bytes, "k": k}
    for name, fn in (("gather", gather), ("side", side), ("dma", copies)):
        if name == "dma" and not dma:
            continue
        times = [timer(lambda f=fn, j=r % 2: f(j)) for r in range(repeats + 1)][1:]  # 0 warms up
        t = statistics.median(times)
        out[f"{name}_ms"] = t * 1e3
        out[f"{name}_gbps"] = k * row_bytes / t / 1e9
    # Gathers bypass the store's slot bookkeeping: adopt what this one wrote, then compare.
    gather(0)
    store.adopt_slots(0, sets[0])
    out["verified"] = all(store.verify(0, s) for s in slots)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| format | row MB | CTAs per row | gather GB/s | gather+join GB/s | DMA GB/s | "
        "gather / DMA | gather+join / DMA | verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ctas = r["setting"]
        if ctas == "default" and r["ctas"] is not None:
            ctas = f"default ({r['ctas']})"
        lines.append(
            f"| {r['format']} | {r['row_bytes'] / 1e6:.3g} | {ctas} | {r['gather_gbps']:.2f} | "
            f"{r['side_gbps']:.2f} | {r['dma_gbps']:.2f} | {r['gather_vs_dma']:.2f} | "
            f"{r['side_vs_dma']:.2f} | {r['verified']} |"
        )
    return "\n".join(lines)


def best(rows: list[dict]) -> dict[str, dict]:
    """Per format, the CTA setting with the highest inline gather GB/s."""
    out: dict[str, dict] = {}
    for r in rows:
        b = out.get(r["format"])
        if b is None or r["gather_gbps"] > b["gather_gbps"]:
            out[r["format"]] = {
                k: r[k] for k in ("setting", "ctas", "gather_gbps", "gather_vs_dma", "dma_gbps")
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--tiny", action="store_true", help="tiny rows (the CPU rehearsal)")
    ap.add_argument("--backend", default=None, help="cpu or cuda (default: psr's current)")
    ap.add_argument("--k", type=int, default=8, help="rows per gather (default 8)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls (7; tiny 3)")
    ap.add_argument("--formats", default=",".join(COPY_FORMATS))
    ap.add_argument("--ctas", default=",".join(SETTINGS), help="CTA settings, 'default' too")
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.tiny else 7)
    H, F = TINY_HF if args.tiny else OLMOE_HF
    backend = args.backend or current_backend()
    formats = [f for f in args.formats.split(",") if f]
    settings = [s for s in args.ctas.split(",") if s]
    for s in settings:
        if s != "default" and not (s.isdigit() and 1 <= int(s) <= 65535):
            ap.error(f"--ctas: {s!r} is neither 'default' nor an int in [1, 65535]")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = {
        "status": "running",
        "backend": backend,
        "device": torch.cuda.get_device_name() if backend == "cuda" else "cpu",
        "shape": [H, F],
        "k": args.k,
        "repeats": repeats,
        "settings": settings,
        "rows": [],
    }
    for fmt in formats:
        nb = format_row_bytes(fmt, H, F)
        for s in settings:
            r = measure(nb, args.k, repeats, backend, s)
            r["format"] = fmt
            r["ctas"] = (
                None if backend != "cuda" else default_ctas(nb) if s == "default" else int(s)
            )
            r["gather_vs_dma"] = r["gather_gbps"] / r["dma_gbps"]
            r["side_vs_dma"] = r["side_gbps"] / r["dma_gbps"]
            result["rows"].append(r)
            result["best"] = best(result["rows"])
            result["seconds"] = time.time() - t0
            write_json(out / "gather.json", result)
            (out / "gather.md").write_text(table(result["rows"]) + "\n")
            print(
                f"{fmt:>5} {nb / 1e6:7.2f} MB x {args.k}, CTAs {s:>7}: gather "
                f"{r['gather_gbps']:7.2f} GB/s, +join {r['side_gbps']:7.2f}, DMA "
                f"{r['dma_gbps']:7.2f} (gather/DMA {r['gather_vs_dma']:.2f}), "
                f"verified {r['verified']}",
                flush=True,
            )
    print(table(result["rows"]))
    result["status"] = "complete"
    result["seconds"] = time.time() - t0
    write_json(out / "gather.json", result)
    return 0 if all(r["verified"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
