"""psr_kernels.ggml: experts in GGUF's GGML blocks, against gguf-py's own dequantization.

Blocks come from gguf-py's quantizers where it has one, else (the K-quants) from random
bytes with small positive f16 scales: valid blocks llama.cpp decodes. The reference for
every value is `gguf.quants.dequantize` (an implementation independent of psr's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psr_kernels as pk
from psr_kernels import ggml

gguf = pytest.importorskip("gguf")

QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "BF16"}


def random_blocks(t: str, R: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 `[R, bytes]`: R rows of K values in GGML type `t`."""
    if t == "FP8_B128":
        w = torch.from_numpy(rng.standard_normal((R, K)).astype(np.float32))
        s = torch.from_numpy(rng.random(((R + 127) // 128, K // 128)).astype(np.float32)) + 0.01
        return ggml.pack_fp8_b128(w.to(torch.float8_e4m3fn), s * 0.01).numpy()
    qt = gguf.GGMLQuantizationType[t]
    if t in ("Q4_K", "Q5_K", "Q6_K"):
        qk, bs = gguf.GGML_QUANT_SIZES[qt]
        b = rng.integers(0, 256, size=(R, K // qk, bs), dtype=np.uint8)

        def half() -> np.ndarray:
            d = (rng.random((R, K // qk)) * 2e-3 + 1e-4).astype(np.float16)
            return d.view(np.uint8).reshape(R, K // qk, 2)

        if t == "Q6_K":
            b[..., 208:210] = half()
        else:
            b[..., 0:2], b[..., 2:4] = half(), half()
        return b.reshape(R, -1)
    w = rng.standard_normal((R, K)).astype(np.float32) * 0.1
    if t == "F32":
        return w.view(np.uint8)
    if t == "F16":
        return w.astype(np.float16).view(np.uint8)
    assert t in QUANTIZABLE
    return gguf.quants.quantize(w, qt)


def gguf_dequant(raw: np.ndarray, t: str, shape: tuple[int, ...]) -> torch.Tensor:
    if t == "FP8_B128":  # psr's own block: its plain formula
        b = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1, 132)
        s = b[:, :4].contiguous().view(torch.float32)
        return (s * b[:, 4:].contiguous().view(torch.float8_e4m3fn).float()).reshape(shape)
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t]).astype(np.float32)
    return torch.from_numpy(out.reshape(shape))


def test_block_sizes_are_gguf_py_s() -> None:
    for t in ggml.GGML_TYPES:
        assert ggml.ggml_block(t) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]


@pytest.mark.parametrize("t", ggml.GGML_TYPES)
def test_reference_and_kernel_decoder_equal_gguf_py(t: str) -> None:
    rng = np.random.default_rng(hash(t) % 2**32)
    R, K = 16, 512
    raw = random_blocks(t, R, K, rng)
    want = gguf_dequant(raw, t, (R, K))
    data = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1)
    torch.testing.assert_close(ggml.dequantize_ggml(data, t, (R, K)), want, rtol=0, atol=0)
    torch.testing.assert_close(ggml.decode_ggml(data, t, (R, K)), want, rtol=0, atol=0)


def test_mxfp4_extreme_scales_and_every_code() -> None:
    """e8m0 exponents 0, 1, 200 (2^-127 is subnormal) with every fp4 code in both nibbles."""
    b = np.zeros((3, 17), dtype=np.uint8)
    b[:, 0] = [0, 1, 200]
    i = np.arange(16, dtype=np.uint8)
    b[:, 1:] = i | ((15 - i) << 4)
    raw = b.reshape(1, -1)
    data = torch.from_numpy(raw.copy()).reshape(-1)
    want = gguf_dequant(raw, "MXFP4", (1, 96))
    torch.testing.assert_close(ggml.dequantize_ggml(data, "MXFP4", (1, 96)), want, rtol=0, atol=0)
    torch.testing.assert_close(ggml.decode_ggml(data, "MXFP4", (1, 96)), want, rtol=0, atol=0)


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


def _expert(types: tuple[str, str, str], H: int, F: int, rng: np.random.Generator):
    """One expert's row and its fp32 matrices by gguf-py."""
    lay = ggml.GGMLLayout.of(ggml.ggml_format(*types), H, F)
    shapes = ((F, H), (F, H), (H, F))
    raws = [random_blocks(t, *s, rng) for t, s in zip(types, shapes, strict=True)]
    parts = [torch.from_numpy(np.ascontiguousarray(r)).reshape(-1) for r in raws]
    mats = [gguf_dequant(r, t, s) for r, t, s in zip(raws, types, shapes, strict=True)]
    return ggml.pack_ggml_expert(lay, parts), mats


# Mixed rows as real files have them (Q4_K_M: Q4_K gate/up, Q6_K down), each block family.
MIXES = [
    ("Q4_K", "Q4_K", "Q6_K"),
    ("Q5_K", "Q8_0", "Q5_0"),
    ("MXFP4", "Q4_1", "Q5_1"),
    ("F16", "BF16", "F32"),
    ("Q4_0", "Q4_0", "Q8_0"),
    ("FP8_B128", "FP8_B128", "FP8_B128"),
]


@pytest.mark.parametrize("types", MIXES, ids=lambda t: "-".join(t))
def test_expert_ffn_on_ggml_rows_equals_the_gguf_py_twin(types: tuple[str, str, str]) -> None:
    rng = np.random.default_rng(1)
    H, F, E, T, k = 256, 256, 3, 2, 2
    rows, mats = zip(*(_expert(types, H, F, rng) for _ in range(E)), strict=True)
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


def test_ggml_rows_with_slot_table_bias_and_scaled_input() -> None:
    """The expert kinds' options go through the GGML kernels as through the others."""
    rng = np.random.default_rng(2)
    H, F = 256, 64  # F = 64: down rows of 64 inputs (no K-quant), as real files fall back
    types = ("Q4_K", "Q4_K", "Q8_0")
    rows, _ = zip(*(_expert(types, H, F, rng) for _ in range(2)), strict=True)
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
    with pytest.raises(ValueError, match=r"Q3_K.*not one psr's expert kernels compute"):
        ggml.ggml_format("Q3_K", "Q4_K", "Q4_K")
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
