"""The CPU expert kernels on GGUF's GGML blocks (csrc/cpu/ggml_dot.h through
psr.store.cpu_expert_ffn) against the torch reference and gguf-py's twin: every block type
(mixed per part as real files mix them), every ISA path this CPU runs, one and two threads
bit-identical, clamped activation, and no read past a row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_blocks import MIXES, expert_rows
from test_cpu_experts import _guarded

import psr_kernels as pk
from psr import store

# The fp32-activation path's references (the q8 path's: test_cpu_qdot.py).
pytestmark = pytest.mark.usefixtures("f32_dots")

ISAS = store.cpu_isas()


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("types", MIXES, ids=lambda t: "-".join(t))
def test_ggml_rows_match_the_reference_on_every_isa(types) -> None:
    rng = np.random.default_rng(5)
    H, F = 256, 256
    rows, mats = zip(*(expert_rows(types, H, F, rng) for _ in range(3)), strict=True)
    slab = torch.stack(rows)
    fmt = pk.ggml_format(*types)
    x, w = torch.randn(3, H), torch.rand(3, 2)
    slots = torch.tensor([[2, 0], [1, 2], [0, 0]])
    ref = pk.expert_ffn_ref(x, slab, slots, w, H, F, fmt=fmt)
    twin = torch.stack(
        [
            sum(w[t, j] * pk.swiglu_ref(x[t : t + 1], *mats[int(slots[t, j])])[0] for j in range(2))
            for t in range(3)
        ]
    )
    _close(ref, twin)
    for isa in ISAS:
        one = store.cpu_expert_ffn(x, slab, slots, w, H, F, fmt=fmt, isa=isa, threads=1)
        _close(one, ref)
        if store.cpu_max_threads() > 1:
            two = store.cpu_expert_ffn(x, slab, slots, w, H, F, fmt=fmt, isa=isa, threads=2)
            assert torch.equal(one, two)


@pytest.mark.parametrize(
    "types",
    [
        ("Q4_K", "Q5_K", "Q6_K"),
        ("Q4_0", "Q6_K", "Q4_0"),
        ("Q2_K", "Q3_K", "IQ4_XS"),
        ("IQ4_XS", "IQ4_NL", "Q2_K"),
        ("IQ3_XXS", "IQ2_S", "IQ1_M"),
        ("IQ1_S", "IQ2_XS", "IQ3_S"),
    ],
    ids=lambda t: "-".join(t),
)
def test_ggml_rows_of_several_super_blocks_match_the_reference(types) -> None:
    """Rows of 2 and 3 super-blocks (K-quants: scales decoded once per super-block) and Q4_0
    rows of 16 and 24 blocks (scales converted 16 blocks at a time: one whole group, then a
    whole and a partial one), on every ISA path."""
    rng = np.random.default_rng(8)
    H, F = 512, 768
    slab = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(2)])
    fmt = pk.ggml_format(*types)
    x, w, slots = torch.randn(2, H), torch.rand(2, 2), torch.tensor([[1, 0], [0, 0]])
    ref = pk.expert_ffn_ref(x, slab, slots, w, H, F, fmt=fmt)
    for isa in ISAS:
        _close(store.cpu_expert_ffn(x, slab, slots, w, H, F, fmt=fmt, isa=isa, threads=1), ref)


def test_ggml_rows_with_clamped_activation_and_slot_table() -> None:
    rng = np.random.default_rng(6)
    H, F = 256, 64  # down rows of 64 inputs: no K-quant, as files fall back to Q8_0
    types = ("Q4_K", "Q4_K", "Q8_0")
    slab = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(2)])
    fmt = pk.ggml_format(*types)
    x, w = torch.randn(1, H), torch.rand(1, 2)
    ids, table = torch.tensor([[1, 0]]), torch.tensor([1, 0])
    act = pk.Activation("clamped", alpha=1.702, limit=7.0)
    ref = pk.expert_ffn_ref(x, slab, ids, w, H, F, fmt=fmt, slot_table=table, act=act)
    y = store.cpu_expert_ffn(
        x, slab, ids, w, H, F, fmt=fmt, slot_table=table, activation="swiglu_oai"
    )
    _close(y, ref)


@pytest.mark.parametrize(
    "types",
    [
        ("MXFP4", "Q5_0", "Q6_K"),
        ("Q4_K", "Q5_K", "Q4_0"),
        ("IQ4_NL", "Q3_K", "IQ4_XS"),
        ("IQ2_XXS", "IQ3_S", "IQ1_M"),
    ],
    ids=lambda t: "-".join(t),
)
def test_ggml_rows_never_read_past_a_row(types) -> None:
    rng = np.random.default_rng(7)
    H, F = 256, 256
    src = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(2)])
    nbytes = src.numel()
    _mm, view, at = _guarded(nbytes)
    try:
        rows = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=at).view(src.shape)
        rows.copy_(src)
        fmt = pk.ggml_format(*types)
        x, w, slots = torch.randn(1, H), torch.rand(1, 2), torch.tensor([[1, 1]])
        ref = pk.expert_ffn_ref(x, src, slots, w, H, F, fmt=fmt)
        for isa in ISAS:
            _close(store.cpu_expert_ffn(x, rows, slots, w, H, F, fmt=fmt, isa=isa), ref)
        del rows
    finally:
        view.release()


def test_ggml_rows_of_the_wrong_size_are_refused() -> None:
    lay = pk.GGMLLayout.of("gguf:Q8_0,Q8_0,Q8_0", 64, 64)
    rows = torch.zeros(2, lay.nbytes + 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"rows hold \d+ bytes, expected"):
        store.cpu_expert_ffn(
            torch.randn(1, 64), rows, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
            64, 64, fmt=lay.fmt,
        )  # fmt: skip
