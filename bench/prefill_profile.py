"""Where a CPU prefill's time goes (issue 36): psr.load(FILE, "exact", 1.0, device="cpu",
threads=1), a warm-up, then one `generate(512 ids, max_new_tokens=1)` with psr's CPU kernels
(`_C.cpu_linear` by shape, `cpu_expert_ffn`, `cpu_attention`) timed in process CPU time around
each call; the rest is attention in torch, norms, routing and Python.

    PYTHONPATH=python:. OMP_NUM_THREADS=1 python bench/prefill_profile.py FILE [--tokens 512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import psr
    from psr import _C

    spent: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            c = time.process_time()
            y = fn(*args, **kw)
            key = name if name != "cpu_linear" else f"{name} T={args[1]} K={args[2]} N={args[4]}"
            spent[key] = spent.get(key, 0.0) + time.process_time() - c
            return y

        return run

    for name in ("cpu_linear", "cpu_expert_ffn", "cpu_attention"):
        setattr(_C, name, timed(name, getattr(_C, name)))  # the extension's entry points
    model = psr.load(a.file, "exact", 1.0, device="cpu", threads=a.threads, progress=False)
    ids = torch.randint(0, 2048, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    model.generate(ids[:, :16], max_new_tokens=2)
    spent.clear()
    c = time.process_time()
    model.generate(ids, max_new_tokens=1)
    total = time.process_time() - c
    print(f"{a.file}: prefill {a.tokens} tokens, {total:.3f} CPU s ({a.tokens / total:.1f} tok/s)")
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {k:48s} {v:7.3f} s  {100 * v / total:5.1f}%")
    rest = total - sum(spent.values())
    rest_name = "rest (torch attention, norms, router, Python)"
    print(f"  {rest_name:48s} {rest:7.3f} s  {100 * rest / total:5.1f}%")


if __name__ == "__main__":
    main()
