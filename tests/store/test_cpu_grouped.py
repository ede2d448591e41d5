"""The grouped CPU expert FFN (csrc/cpu/expert_gemv.cpp: one read of an expert's row block
for every token routed to it) is batch invariant: each token of a T-token call is
bit-identical to the same token computed alone (T = 1), whatever its co-tokens (sharing
its experts or not), their order, duplicates and the thread count, on every ISA path and
in every format; and the grouped call still matches the torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_blocks import expert_rows
from test_cpu_experts import _close, _slab

import psr_kernels as pk
from psr import store

# The fp32-activation path's references (the q8 path's: test_cpu_qdot.py).
pytestmark = pytest.mark.usefixtures("f32_dots")

ISAS = store.cpu_isas()
THREADS = sorted({1, min(2, store.cpu_max_threads())})
BATCHES = (2, 3, 5, 8)
K_ROUTED = 3

# (name, fmt, float dtype, H, F, int4 group): odd shapes (not multiples of 16 or 4) for the
# formats without blocks; GGML rows need whole blocks (K-quants: 256).
NATIVE = [
    ("bf16", None, torch.bfloat16, 72, 54),
    ("fp32", None, torch.float32, 41, 23),
    ("fp16", None, torch.float16, 130, 66),
    ("int8", "int8", None, 72, 54),
    ("fp8", "fp8", None, 41, 23),
    ("int4", "int4", None, 96, 80),
]
GGML = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("IQ4_XS", "IQ4_XS", "IQ4_NL")]


def _native(name: str, fmt: str | None, dtype: torch.dtype | None, H: int, F: int, C: int):
    gs = 16 if fmt == "int4" else 256  # int4: several groups per row
    return _slab(H, F, C, fmt, dtype, gs), dict(fmt=fmt, group_size=gs)


def _ggml(types: tuple[str, str, str], C: int):
    rng = np.random.default_rng(3)
    H, F = 256, 256
    slab = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(C)])
    return slab, dict(fmt=pk.ggml_format(*types)), H, F


def _pools(C: int, g: torch.Generator) -> list[torch.Tensor]:
    """Token routes: 8 tokens sharing three experts, and 4 tokens with disjoint experts."""
    shared = torch.stack([torch.randperm(3, generator=g)[:K_ROUTED] for _ in range(8)])
    disjoint = torch.arange(3, 3 + 4 * K_ROUTED).reshape(4, K_ROUTED) % C
    return [shared, disjoint]


def _check_batches(slab: torch.Tensor, H: int, F: int, kw: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    slots = torch.cat(_pools(slab.shape[0], g))
    P = slots.shape[0]
    x = torch.randn(P, H, generator=g)
    w = torch.rand(P, K_ROUTED, generator=g)
    for isa in ISAS:
        solo = [
            store.cpu_expert_ffn(
                x[p : p + 1], slab, slots[p : p + 1], w[p : p + 1], H, F, isa=isa, threads=1, **kw
            )[0]
            for p in range(P)
        ]
        for T in BATCHES:
            # shared only, disjoint only, and a random mix with repeats
            picks = [torch.arange(T) % 8, 8 + torch.arange(T) % 4, torch.randint(0, P, (T,))]
            for idx in picks:
                for threads in THREADS:
                    y = store.cpu_expert_ffn(
                        x[idx], slab, slots[idx], w[idx], H, F, isa=isa, threads=threads, **kw
                    )
                    for t, p in enumerate(idx.tolist()):
                        assert torch.equal(y[t], solo[p]), (isa, T, threads, t, p)
        ref = pk.expert_ffn_ref(x, slab, slots, w, H, F, **kw)
        _close(store.cpu_expert_ffn(x, slab, slots, w, H, F, isa=isa, **kw), ref)


@pytest.mark.parametrize(("name", "fmt", "dtype", "H", "F"), NATIVE, ids=[n[0] for n in NATIVE])
def test_native_rows_are_batch_invariant(name, fmt, dtype, H, F) -> None:
    slab, kw = _native(name, fmt, dtype, H, F, 16)
    _check_batches(slab, H, F, kw, seed=1)


@pytest.mark.parametrize("types", GGML, ids=lambda t: "-".join(t))
def test_ggml_rows_are_batch_invariant(types) -> None:
    slab, kw, H, F = _ggml(types, 16)
    _check_batches(slab, H, F, kw, seed=2)


def test_absent_experts_and_slot_table_are_batch_invariant() -> None:
    """With a slot table and skip_absent (experts_on's split), a token whose expert is
    absent still equals its solo call when co-tokens compute that expert's neighbours."""
    H, F = 72, 54
    slab = _slab(H, F, 4, None, torch.bfloat16, 256)
    table = torch.tensor([2, -1, 0, 3, -1, 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    ids = torch.tensor([[0, 1, 2], [1, 4, 0], [3, 5, 0], [2, 1, 5], [0, 3, 4]])
    x = torch.randn(5, H, generator=g)
    w = torch.rand(5, 3, generator=g)
    kw = dict(slot_table=table, skip_absent=True)
    for isa in ISAS:
        y = store.cpu_expert_ffn(x, slab, ids, w, H, F, isa=isa, threads=THREADS[-1], **kw)
        for t in range(5):
            one = store.cpu_expert_ffn(
                x[t : t + 1], slab, ids[t : t + 1], w[t : t + 1], H, F, isa=isa, threads=1, **kw
            )
            assert torch.equal(y[t], one[0])
