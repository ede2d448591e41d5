"""psr_kernels.ggml: experts in GGUF's GGML blocks, against gguf-py's own dequantization.

Blocks come from gguf-py's quantizers where it has one, else (the K-quants) from random
bytes with small positive f16 scales: valid blocks llama.cpp decodes. The reference for
every value is `gguf.quants.dequantize` (an implementation independent of psr's).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from ggml_blocks import LOW_BIT_MIXES, MIXES, expert_rows, gguf_dequant, random_blocks

import psr_kernels as pk
from psr_kernels import ggml


def test_block_sizes_are_gguf_py_s() -> None:
    for t in ggml.GGML_TYPES:
        assert ggml.ggml_block(t) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]


def _decoders_equal_gguf_py(raw: np.ndarray, t: str, shape: tuple[int, int]) -> None:
    """The torch reference and the kernels' decoder equal gguf-py on `raw`, bit for bit."""
    want = gguf_dequant(raw, t, shape)
    data = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1)
    torch.testing.assert_close(ggml.dequantize_ggml(data, t, shape), want, rtol=0, atol=0)
    torch.testing.assert_close(ggml.decode_ggml(data, t, shape), want, rtol=0, atol=0)


@pytest.mark.parametrize("t", ggml.GGML_TYPES)
def test_reference_and_kernel_decoder_equal_gguf_py(t: str) -> None:
    rng = np.random.default_rng(hash(t) % 2**32)
    R, K = 16, 512
    _decoders_equal_gguf_py(random_blocks(t, R, K, rng), t, (R, K))


def test_generated_cpu_tables_are_gguf_py_s() -> None:
    """csrc/cpu/ggml_tables.h (written by gen_ggml_tables.py) holds gguf-py's arrays."""
    text = (Path(__file__).parents[2] / "csrc/cpu/ggml_tables.h").read_text()
    arrays = {
        name: [int(v) for v in body.replace("\n", " ").split(",")]
        for name, body in re.findall(r"(\w+)\[\d+\] = \{([^}]*)\};", text)
    }
    q = gguf.quants
    want = {
        "kIq4Levels": list(q.IQ4_NL.kvalues),
        "kKsigns": list(q.IQ2_XXS.ksigns),
        "kIq1Delta8": [int(q.IQ1_S.delta * 8)],
    }
    for cls in (q.IQ2_XXS, q.IQ2_XS, q.IQ2_S, q.IQ3_XXS, q.IQ3_S, q.IQ1_S):
        cls.init_grid()
        want["k" + cls.__name__.title().replace("_", "")] = (
            cls.grid.reshape(-1).astype(int).tolist()
        )
    assert arrays == want


def test_iq4_every_level_in_both_nibbles() -> None:
    """IQ4_NL blocks holding each of the 16 levels in the low and the high nibble."""
    b = np.zeros((2, 18), dtype=np.uint8)
    b[:, 0:2] = np.array([0.5, -3.0], dtype=np.float16).view(np.uint8).reshape(2, 2)
    i = np.arange(16, dtype=np.uint8)
    b[:, 2:] = i | ((15 - i) << 4)
    _decoders_equal_gguf_py(b.reshape(1, -1), "IQ4_NL", (1, 64))


def test_mxfp4_extreme_scales_and_every_code() -> None:
    """e8m0 exponents 0, 1, 200 (2^-127 is subnormal) with every fp4 code in both nibbles."""
    b = np.zeros((3, 17), dtype=np.uint8)
    b[:, 0] = [0, 1, 200]
    i = np.arange(16, dtype=np.uint8)
    b[:, 1:] = i | ((15 - i) << 4)
    _decoders_equal_gguf_py(b.reshape(1, -1), "MXFP4", (1, 96))


def test_fp8_b128_blocks_equal_the_checkpoint_s_tile_scaling() -> None:
    """Block-wise FP8 (DeepSeek-V3's weight + weight_scale_inv) as FP8_B128 rows: every value
    is its e4m3 code times its 128 x 128 tile's scale, through both decoders."""
    g = torch.Generator().manual_seed(3)
    R, K = 200, 256  # two tile rows, the second partial (as real out dims can be)
    w = torch.randn(R, K, generator=g)
    codes = w.to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 2, generator=g) + 0.5
    want = codes.float() * scale_inv.repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)
    rows = ggml.pack_fp8_b128(codes, scale_inv)
    assert rows.shape == (R, 2 * 132)
    data = rows.reshape(-1)
    torch.testing.assert_close(ggml.dequantize_ggml(data, "FP8_B128", (R, K)), want, rtol=0, atol=0)
    torch.testing.assert_close(ggml.decode_ggml(data, "FP8_B128", (R, K)), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"scale_inv must be \[2, 2\]"):
        ggml.pack_fp8_b128(codes, scale_inv[:1])


@pytest.mark.parametrize(
    "types", [m for m in MIXES if m not in LOW_BIT_MIXES[:-1]], ids=lambda t: "-".join(t)
)
def test_expert_ffn_on_ggml_rows_equals_the_gguf_py_twin(types: tuple[str, str, str]) -> None:
    rng = np.random.default_rng(1)
    H, F, E, T, k = 256, 256, 3, 2, 2
    rows, mats = zip(*(expert_rows(types, H, F, rng) for _ in range(E)), strict=True)
    slab = torch.stack(rows)
    fmt = ggml.ggml_format(*types)
    x = torch.randn(T, H)
    slots = torch.tensor([[2, 0], [1, 2]])
    w = torch.rand(T, k)
    y = pk.expert_ffn(x, slab, slots, w, H, F, fmt=fmt)
    ref = pk.expert_ffn_ref(x, slab, slots, w, H, F, fmt=fmt)
    twin = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            g, u, d = mats[int(slots[t, j])]
            twin[t] += w[t, j] * pk.swiglu_ref(x[t : t + 1], g, u, d)[0]
    torch.testing.assert_close(ref, twin, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, twin, rtol=1e-4, atol=1e-4)


def test_low_bit_rows_of_odd_shapes_equal_the_gguf_py_twin() -> None:
    """Rows of 3 super-blocks (H = 768) and down rows of 3 IQ4_NL blocks (F = 96): tiles that
    straddle blocks and a partial last tile, through the Triton kernels."""
    rng = np.random.default_rng(4)
    H, F, types = 768, 96, ("IQ4_XS", "Q2_K", "IQ4_NL")
    rows, mats = zip(*(expert_rows(types, H, F, rng) for _ in range(2)), strict=True)
    slab = torch.stack(rows)
    x, w, slots = torch.randn(1, H), torch.rand(1, 2), torch.tensor([[1, 0]])
    y = pk.expert_ffn(x, slab, slots, w, H, F, fmt=ggml.ggml_format(*types))
    twin = sum(w[0, j] * pk.swiglu_ref(x, *mats[int(slots[0, j])]) for j in range(2))
    torch.testing.assert_close(y, twin, rtol=1e-4, atol=1e-4)


def test_ggml_rows_with_slot_table_bias_and_scaled_input() -> None:
    """The expert kinds' options go through the GGML kernels as through the others."""
    rng = np.random.default_rng(2)
    H, F = 256, 64  # F = 64: down rows of 64 inputs (no K-quant), as real files fall back
    types = ("Q4_K", "Q4_K", "Q8_0")
    rows, _ = zip(*(expert_rows(types, H, F, rng) for _ in range(2)), strict=True)
    slab = torch.stack(rows)
    fmt = ggml.ggml_format(*types)
    x, w = torch.randn(1, H), torch.rand(1, 2)
    ids = torch.tensor([[1, 0]])
    table = torch.tensor([1, 0])  # expert e lives in slot 1 - e
    bias = torch.randn(1, 2, 2 * F + H)
    act = pk.Activation("clamped", alpha=1.702, limit=7.0)  # gpt-oss's kind
    kw = dict(fmt=fmt, slot_table=table, bias=bias, act=act)
    torch.testing.assert_close(
        pk.expert_ffn(x, slab, ids, w, H, F, **kw),
        pk.expert_ffn_ref(x, slab, ids, w, H, F, **kw),
        rtol=1e-4,
        atol=1e-4,
    )
    kw = dict(fmt=fmt, scale_input=True)
    torch.testing.assert_close(
        pk.expert_ffn(x, slab, ids, w, H, F, **kw),
        pk.expert_ffn_ref(x, slab, ids, w, H, F, **kw),
        rtol=1e-4,
        atol=1e-4,
    )


def test_layout_parts_are_aligned_and_keep_the_file_bytes() -> None:
    lay = ggml.GGMLLayout.of("gguf:MXFP4,Q5_0,Q8_0", 64, 96)
    assert lay.gate == 0 and lay.up % 16 == 0 and lay.down % 16 == 0 and lay.nbytes % 16 == 0
    assert lay.part_bytes == (96 * 2 * 17, 96 * 2 * 22, 64 * 3 * 34)
    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in lay.part_bytes]
    row = ggml.pack_ggml_expert(lay, parts)
    for p, off in zip(parts, (lay.gate, lay.up, lay.down), strict=True):
        assert torch.equal(row[off : off + p.numel()], p)


def test_bad_formats_and_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"TQ2_0.*not one psr's expert kernels compute"):
        ggml.ggml_format("TQ2_0", "Q4_K", "Q4_K")
    with pytest.raises(ValueError, match="not a GGML row format"):
        ggml.GGMLLayout.of("gguf:Q4_K,Q4_K", 256, 256)
    with pytest.raises(ValueError, match="down rows: a Q4_K row holds whole blocks of 256"):
        ggml.GGMLLayout.of("gguf:Q4_K,Q4_K,Q4_K", 256, 96)
    lay = ggml.GGMLLayout.of("gguf:Q8_0,Q8_0,Q8_0", 64, 64)
    with pytest.raises(ValueError, match="up must be"):
        n = lay.part_bytes
        parts = [torch.zeros(m, dtype=torch.uint8) for m in (n[0], n[1] + 1, n[2])]
        ggml.pack_ggml_expert(lay, parts)
    slab = torch.zeros(2, lay.nbytes + 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"slab rows hold .* bytes, expected"):
        pk.expert_ffn(
            torch.randn(1, 64), slab, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
            64, 64, fmt=lay.fmt,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs 68 bytes"):
        ggml.dequantize_ggml(torch.zeros(70, dtype=torch.uint8), "Q8_0", (2, 32))
