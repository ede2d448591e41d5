"""The expert FFN's launch tuning (`set_ffn_tuning`): SPLIT_K (the down kernel one routed
expert a program, the partials summed in expert order after) keeps every output bit, for
float, int8 / int4 and GGML rows, slot tables, absent experts and odd shapes; other tiles
stay within the reference's tolerance; bad keys are named."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import import_module

import numpy as np
import pytest
import torch
from ggml_blocks import expert_rows

import psr_kernels as pk
from psr_kernels import ggml
from psr_kernels._common import sum_experts
from psr_kernels.expert_ffn import set_ffn_tuning
from psr_kernels.rowformat import RowFormat, RowKind

ffn = import_module("psr_kernels.expert_ffn")  # the module (the package exports the op)


@contextmanager
def tuned(kind: RowKind, **down: int) -> Iterator[None]:
    prev = set_ffn_tuning(kind, down=down)
    try:
        yield
    finally:
        set_ffn_tuning(kind)
        if prev is not None:
            set_ffn_tuning(kind, *prev)


def _float_rows(C: int, H: int, F: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(C * H + F)
    mats = [torch.randn(3, F * H, generator=g) / H**0.5 for _ in range(C)]
    return torch.stack([m.reshape(-1) for m in mats])


def _case(fmt: str | None, H: int, F: int, C: int) -> tuple[torch.Tensor, object]:
    if fmt is None:
        return _float_rows(C, H, F), None
    if fmt in ("int8", "int4"):
        rows = _float_rows(C, H, F)
        parts = [pk.unpack_expert(r, H, F) for r in rows]
        return torch.stack([pk.quantize_expert(*p, fmt, group_size=32) for p in parts]), fmt
    rng = np.random.default_rng(C)
    types = ("Q8_0", "Q4_0", "Q8_0")  # 32-value blocks: small shapes under the interpreter
    rows_, _ = zip(*(expert_rows(types, H, F, rng) for _ in range(C)), strict=True)
    return torch.stack(rows_), ggml.ggml_format(*types)


@pytest.mark.parametrize(
    ("fmt", "H", "F"), [(None, 72, 40), ("int8", 64, 96), ("int4", 96, 64), ("ggml", 64, 96)]
)
def test_split_k_keeps_every_bit(
    fmt: str | None, H: int, F: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    C, T, k = 5, 2, 3
    slab, f = _case(None if fmt is None else fmt, H, F, C)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g)
    slots = torch.tensor([[4, 0, 2], [1, 3, 4]])
    w = torch.rand(T, k, generator=g)
    kw = dict(fmt=f, group_size=32)
    sums = []  # the split path's second pass ran (a tuning that is ignored would pass too)
    monkeypatch.setattr(ffn, "sum_experts", lambda p, y: (sums.append(p.shape), sum_experts(p, y)))
    kind = RowFormat.parse(f).kind
    with tuned(kind, SPLIT_K=0):
        plain = pk.expert_ffn(x, slab, slots, w, H, F, **kw)
    assert sums == []
    with tuned(kind, SPLIT_K=1):
        split = pk.expert_ffn(x, slab, slots, w, H, F, **kw)
        again = pk.expert_ffn(x, slab, slots, w, H, F, **kw)
    default = pk.expert_ffn(x, slab, slots, w, H, F, **kw)  # SPLIT_K_DEFAULT: split
    assert torch.equal(split, plain) and torch.equal(again, plain) and torch.equal(default, plain)
    assert sums == [(T, k, H)] * 3
    assert not torch.equal(split, torch.zeros_like(split))


def test_split_k_with_a_slot_table_and_absent_experts() -> None:
    """The device step's call: expert ids through the slot map, -1 = computed elsewhere."""
    H, F, C = 48, 32, 4
    slab = _float_rows(C, H, F)
    table = torch.tensor([2, -1, 0, 3, 1, -1], dtype=torch.int32)
    ids = torch.tensor([[0, 1, 3, 5]])
    x = torch.randn(1, H)
    w = torch.rand(1, 4).to(torch.bfloat16)
    kw = dict(slot_table=table, skip_absent=True)
    with tuned(RowKind.FLOAT, SPLIT_K=0):
        plain = pk.expert_ffn(x, slab, ids, w, H, F, **kw)
    with tuned(RowKind.FLOAT, SPLIT_K=1, BLOCK_H=32):
        assert torch.equal(pk.expert_ffn(x, slab, ids, w, H, F, **kw), plain)


def test_other_tiles_stay_within_the_reference() -> None:
    H, F, C = 80, 48, 3
    slab = _float_rows(C, H, F)
    x = torch.randn(1, H)
    slots = torch.tensor([[2, 0]])
    w = torch.rand(1, 2)
    ref = pk.expert_ffn_ref(x, slab, slots, w, H, F)
    prev = set_ffn_tuning(
        RowKind.FLOAT, gate_up=dict(BLOCK_F=16, BLOCK_H=32), down=dict(BLOCK_F=16)
    )
    try:
        got = pk.expert_ffn(x, slab, slots, w, H, F)
    finally:
        set_ffn_tuning(RowKind.FLOAT)
    assert prev is None
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bad_tuning_keys_are_named() -> None:
    with pytest.raises(ValueError, match=r"gate_up takes .*not \['SPLIT_K'\]"):
        set_ffn_tuning(RowKind.FLOAT, gate_up=dict(SPLIT_K=1))
    with pytest.raises(ValueError, match=r"down takes .*not \['FMT'\]"):
        set_ffn_tuning(RowKind.QUANT, down=dict(FMT=2))
    assert set_ffn_tuning(RowKind.FLOAT) is None  # nothing was set
