"""The expert row format table (psr_kernels.rowformat): words parse once into formats, the
formats carry what the kernels, the CPU kernels and the reports ask of them."""

from __future__ import annotations

import pytest

import psr_kernels as pk
from psr import vocab
from psr_kernels.rowformat import RowKind


def test_words_parse_to_one_format_each() -> None:
    assert pk.RowFormat.parse(None) is pk.NATIVE
    assert pk.RowFormat.parse("native") is pk.NATIVE
    assert pk.RowFormat.parse(pk.INT4) is pk.INT4
    for word in pk.EXPERT_FORMATS:
        f = pk.RowFormat.parse(word)
        assert f.name == word == str(f)
    g = pk.RowFormat.parse("gguf:Q4_K,Q4_K,Q6_K")
    assert g.kind is RowKind.BLOCKS and g == pk.RowFormat.blocks("Q4_K", "Q4_K", "Q6_K")
    assert [t.name for t in g.block_types] == ["Q4_K", "Q4_K", "Q6_K"]
    assert g.shown == "Q4_K,Q4_K,Q6_K" and g.kernel_fmt == g.name
    assert pk.BF16.is_float and pk.BF16.kernel_fmt is None and pk.BF16.dtype == "bfloat16"
    # The bookkeeping's torch-free word list is the table's.
    assert vocab.EXPERT_FORMATS == pk.EXPERT_FORMATS
    assert vocab.QUANT_FORMATS == pk.QUANT_FORMATS


def test_bad_words_are_named() -> None:
    with pytest.raises(ValueError, match="expert_format must be one of native, bf16, int8"):
        pk.RowFormat.parse("int2")
    with pytest.raises(ValueError, match=r"op: fmt must be None \(float slab rows\)"):
        pk.RowFormat.of_kernel("op", "bf16")  # the kernels read float rows of any dtype
    with pytest.raises(ValueError, match="not a GGML row format"):
        pk.RowFormat.parse("gguf:Q4_K")
    with pytest.raises(ValueError, match="'int8' is not a GGML row format"):
        pk.GGMLLayout.of(pk.INT8, 64, 64)


def test_layouts_and_row_bytes() -> None:
    H, F = 256, 512
    assert pk.NATIVE.row_bytes(H, F, itemsize=4) == 3 * H * F * 4
    assert pk.BF16.row_bytes(H, F, itemsize=4) == 3 * H * F * 2  # bf16 rows, whatever the model
    for word in pk.QUANT_FORMATS:
        f = pk.RowFormat.parse(word)
        assert f.layout(H, F, 64) == pk.QuantLayout.of(word, H, F, 64)
        assert f.row_bytes(H, F, 64) == pk.QuantLayout.of(word, H, F, 64).nbytes
    g = pk.RowFormat.parse("gguf:Q8_0,Q4_K,Q6_K")
    lay = g.layout(H, F)
    assert isinstance(lay, pk.GGMLLayout) and lay.type_ids == (8, 12, 14)
    assert lay.part_bytes == (F * H // 32 * 34, F * H // 256 * 144, H * F // 256 * 210)
    assert g.row_bytes(H, F) == lay.nbytes and lay.nbytes % 16 == 0
