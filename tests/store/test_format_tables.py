"""The expert row format table has two homes that must agree: psr_kernels/rowformat.py
(Python: layouts, the Triton kernels' flags) and csrc/cpu/expert_gemv.h (C++: the CPU
kernels' `Fmt`, GGML block type traits, the `Layout` the bindings fill). The bindings
expose the C++ tables; these tests compare them field for field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import psr._C as _C
import psr_kernels as pk
import psr_kernels.rowformat as rf
from psr import store


def test_block_type_traits_agree() -> None:
    py = [
        (b.name, b.type_id, b.block_len, b.block_bytes, b.vec_dot)
        for b in pk.BLOCK_TYPE_TRAITS.values()
    ]
    assert [tuple(t) for t in _C.ggml_type_traits()] == py


def test_cpu_formats_agree() -> None:
    cpp = dict(_C.cpu_formats())
    py = {**rf.CPU_FLOAT_FMT, **{f: pk.RowFormat.parse(f).cpu_code for f in pk.QUANT_FORMATS}}
    py["ggml"] = rf.CPU_GGML_FMT
    assert cpp == py
    blocks = pk.RowFormat.blocks("Q4_K", "Q4_K", "Q6_K")
    assert blocks.cpu_code == cpp["ggml"]


def test_cpu_layout_fields_agree() -> None:
    assert _C.cpu_layout_fields() == [f.name for f in dataclasses.fields(pk.CpuLayout)]


@pytest.mark.parametrize(
    ("fmt", "dtype", "n"),
    [
        (None, torch.bfloat16, 14),
        ("int4", torch.uint8, 14),
        ("gguf:Q8_0,Q4_K,Q6_K", torch.uint8, 18),
    ],
)
def test_cpu_layout_is_the_tables(fmt: str | None, dtype: torch.dtype, n: int) -> None:
    """store.cpu_layout writes the table's CpuLayout: its fields, by name, in C++'s order."""
    H, F = 256, 512
    f = pk.RowFormat.of_kernel("test", fmt)
    lay = f.layout(H, F, 64)
    nbytes = f.row_bytes(H, F, 64, dtype.itemsize)
    ints = store.cpu_layout(fmt, dtype, H, F, 64, nbytes)
    named = dict(zip(_C.cpu_layout_fields(), ints, strict=False))
    assert len(ints) == n and named["row_bytes"] == nbytes
    assert (named["hidden"], named["ffn"], named["down"]) == (
        H,
        F,
        lay.down * (dtype.itemsize if f.is_float else 1),
    )
    if f.is_blocks:
        assert (named["t_gate"], named["t_up"], named["t_down"]) == (8, 12, 14)
