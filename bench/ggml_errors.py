"""Each block type's error: the decoders against gguf-py, and the expert FFN (Triton under
the interpreter, the CPU kernels' best ISA, the torch reference) against the fp64 twin
(gguf-py's dequantization), relative to the output's largest value; H = F = 256, two
routed experts, random blocks (tests/ggml_blocks.py).

    .venv/bin/python bench/ggml_errors.py > bench/results/gguf/format_errors.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numpy as np
import torch
from ggml_blocks import expert_rows

import psr_kernels as pk
from psr import store

H = F = 256


def rel(y: torch.Tensor, twin: torch.Tensor) -> str:
    return f"{float((y.double() - twin).abs().max()) / float(twin.abs().max()):.1e}"


def main() -> None:
    rng = np.random.default_rng(11)
    isa = store.cpu_isas()[-1]
    print(f"| type | decoders vs gguf-py | Triton FFN | CPU kernels ({isa}) | torch reference |")
    print("|---|---|---|---|---|")
    for t in pk.BLOCK_TYPES:
        types = (t, t, t)
        rows, mats = zip(*(expert_rows(types, H, F, rng) for _ in range(2)), strict=True)
        slab, fmt = torch.stack(rows), pk.ggml_format(*types)
        x, slots, w = torch.randn(1, H), torch.tensor([[1, 0]]), torch.tensor([[0.6, 0.4]])
        twin = sum(
            float(w[0, j])
            * pk.swiglu_ref(
                x.double(), *(m.double() for m in mats[int(slots[0, j])]), dtype=torch.float64
            )[0]
            for j in range(2)
        )
        assert isinstance(twin, torch.Tensor)
        y_t = pk.expert_ffn(x, slab, slots, w, H, F, fmt=fmt)[0]
        y_c = store.cpu_expert_ffn(x, slab, slots, w, H, F, fmt=fmt, isa=isa)[0]
        y_r = pk.expert_ffn_ref(x, slab, slots, w, H, F, fmt=fmt)[0]
        exact = "0 (bit-exact, tests/kernels/test_ggml.py)"
        print(f"| {t} | {exact} | {rel(y_t, twin)} | {rel(y_c, twin)} | {rel(y_r, twin)} |")


if __name__ == "__main__":
    main()
