"""psr_kernels.quant: quantized slab rows (int8, fp8 e4m3, int4) and the kernels that run
experts straight from them, against plain computations written here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import psr_kernels as pk
from psr_kernels import quant

FORMATS = ("int8", "fp8", "int4")

# (dtype, atol, rtol) of the default-dtype output against the experts computed one by one
# in fp32 from this file's own dequantization. Kernel vs reference is checked at fp32 level.
DTYPE_TOLS = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def test_formats_are_exported() -> None:
    assert quant.FORMATS == pk.QUANT_FORMATS == FORMATS


# --------------------------------------------------------------------------- plain decoding


def plain_fp8(code: int) -> float:
    """e4m3fn by the textbook formula: bias 7, subnormals at exponent 0, S.1111.111 NaN."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    mag = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def plain_codes(codes: torch.Tensor, fmt: str, K: int) -> torch.Tensor:
    """Integer/fp8 values [R, K] of one code matrix [R, bytes per row], element by element."""
    rows = []
    for r in codes.tolist():
        if fmt == "int8":
            vals = [b - 256 if b > 127 else b for b in r]
        elif fmt == "fp8":
            vals = [plain_fp8(b) for b in r]
        else:  # low nibble first, two's complement
            nib = [n for b in r for n in (b & 15, b >> 4)]
            vals = [n - 16 if n > 7 else n for n in nib][:K]
        rows.append(vals)
    return torch.tensor(rows, dtype=torch.float64)


def plain_dequant(row: torch.Tensor, fmt: str, H: int, F: int, group_size: int = 128):
    """fp64 (gate, up, down) of one row, reading the parts where QuantLayout says."""
    lay = pk.QuantLayout.of(fmt, H, F, group_size)
    out = []
    for R, K, at, s_at, G, rb in (
        (F, H, lay.gate, lay.gate_scale, lay.group_h, lay.row_bytes_h),
        (F, H, lay.up, lay.up_scale, lay.group_h, lay.row_bytes_h),
        (H, F, lay.down, lay.down_scale, lay.group_f, lay.row_bytes_f),
    ):
        q = plain_codes(row[at : at + R * rb].reshape(R, rb), fmt, K)
        s = row[s_at : s_at + 4 * R * (K // G)].clone().view(torch.float32).double()
        out.append(q * s.reshape(R, K // G).repeat_interleave(G, dim=1))
    return tuple(out)


def make_expert(H: int, F: int, seed: int, std: float = 0.02):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen) * std for shape in ((F, H), (F, H), (H, F)))


# --------------------------------------------------------------------------- layout


def test_layout_offsets_by_hand() -> None:
    lay = pk.QuantLayout.of("int8", 48, 16)
    # gate, up, down: 16*48 bytes each; scales: 16, 16, 48 fp32.
    assert (lay.gate, lay.up, lay.down) == (0, 768, 1536)
    assert (lay.gate_scale, lay.up_scale, lay.down_scale, lay.nbytes) == (2304, 2368, 2432, 2624)
    assert (lay.group_h, lay.group_f, lay.groups_h, lay.groups_f) == (48, 16, 1, 1)
    assert pk.QuantLayout.of("fp8", 48, 16).nbytes == 2624
    lay = pk.QuantLayout.of("int4", 256, 64, group_size=32)
    assert (lay.row_bytes_h, lay.row_bytes_f, lay.groups_h, lay.groups_f) == (128, 32, 8, 2)
    assert (lay.gate, lay.up, lay.down) == (0, 8192, 16384)
    assert (lay.gate_scale, lay.up_scale, lay.down_scale, lay.nbytes) == (
        24576,
        26624,
        28672,
        30720,
    )
    # Odd sizes: each part is padded to 16 bytes; short int4 rows are one group.
    lay = pk.QuantLayout.of("int4", 50, 15, group_size=64)
    assert (lay.group_h, lay.group_f, lay.row_bytes_h, lay.row_bytes_f) == (50, 15, 25, 8)
    assert (lay.up, lay.down, lay.gate_scale) == (384, 768, 1168)  # 375 -> 384, 768 + 400
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.nbytes = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fmt", "H", "F"),
    [
        (fmt, H, F)
        for fmt in FORMATS
        for H, F in [(48, 16), (130, 40), (256, 64), (50, 15), (7, 3)]
        if not (fmt == "int4" and H == 130)  # not a multiple of an int4 group: test_bad_layouts
    ],
)
def test_layout_parts_are_aligned_and_disjoint(fmt, H, F) -> None:
    lay = pk.QuantLayout.of(fmt, H, F)
    nib = fmt == "int4"
    rb = (lambda k: (k + 1) // 2) if nib else (lambda k: k)
    parts = [
        (lay.gate, F * rb(H)),
        (lay.up, F * rb(H)),
        (lay.down, H * rb(F)),
        (lay.gate_scale, 4 * F * lay.groups_h),
        (lay.up_scale, 4 * F * lay.groups_h),
        (lay.down_scale, 4 * H * lay.groups_f),
    ]
    ends = 0
    for at, size in parts:
        assert at % 16 == 0 and at >= ends and at - ends < 16
        ends = at + size
    assert lay.nbytes % 16 == 0 and 0 <= lay.nbytes - ends < 16


def test_bytes_ratio_for_olmoe() -> None:
    H, F, hf = 2048, 1024, 2048 * 1024
    bf16 = 3 * hf * 2
    # int8/fp8: 3*H*F code bytes + (F + F + H) fp32 scales.
    want8 = (3 * hf + 4 * (F + F + H)) / bf16
    # int4 (group 128): 3*H*F/2 bytes + (F*H/128 + F*H/128 + H*F/128) fp32 scales.
    want4 = (3 * hf // 2 + 4 * 3 * hf // 128) / bf16
    assert pk.bytes_ratio("int8", H, F) == pytest.approx(want8, rel=1e-12)
    assert pk.bytes_ratio("fp8", H, F) == pytest.approx(want8, rel=1e-12)
    assert pk.bytes_ratio("int4", H, F) == pytest.approx(want4, rel=1e-12)
    assert pk.bytes_ratio("int8", H, F, base_itemsize=4) == pytest.approx(want8 / 2)
    for fmt in FORMATS:
        assert pk.bytes_ratio(fmt, H, F) == pk.QuantLayout.of(fmt, H, F).nbytes / bf16


def test_bad_layouts() -> None:
    with pytest.raises(ValueError, match=r"fmt must be one of 'int8', 'fp8', 'int4', got 'nf4'"):
        pk.QuantLayout.of("nf4", 64, 32)
    with pytest.raises(ValueError, match=r"int4 group_size 64 must divide hidden_size 130"):
        pk.QuantLayout.of("int4", 130, 64, group_size=64)
    with pytest.raises(ValueError, match=r"int4 group_size 128 must divide ffn_size 192"):
        pk.QuantLayout.of("int4", 256, 192)
    with pytest.raises(ValueError, match=r"int4 group_size must be one of \(16, 32, 64, 128, 256"):
        pk.QuantLayout.of("int4", 96, 96, group_size=48)
    with pytest.raises(ValueError, match="must be positive"):
        pk.QuantLayout.of("int8", 0, 32)
    pk.QuantLayout.of("int8", 130, 192, group_size=48)  # the group matters for int4 only
    with pytest.raises(ValueError, match="int4 group_size 64 must divide hidden_size 130"):
        pk.bytes_ratio("int4", 130, 64, group_size=64)


# --------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("H", "F", "group"), [(48, 16, 128), (256, 64, 32), (50, 15, 64)])
def test_quantize_matches_plain_computation(fmt, H, F, group) -> None:
    gate, up, down = make_expert(H, F, seed=H + F)
    down[3].zero_()  # an all-zero row: scale 1, codes 0
    row = pk.quantize_expert(gate.bfloat16(), up.bfloat16(), down.bfloat16(), fmt, group_size=group)
    lay = pk.QuantLayout.of(fmt, H, F, group)
    assert row.dtype == torch.uint8 and row.shape == (lay.nbytes,) and row.device.type == "cpu"
    deq = pk.dequantize_expert(row, H, F, fmt, group_size=group)
    plain = plain_dequant(row, fmt, H, F, group)
    qmax = {"int8": 127, "fp8": 448, "int4": 7}[fmt]
    for w, d, p, G in zip(
        (gate, up, down), deq, plain, (lay.group_h, lay.group_h, lay.group_f), strict=True
    ):
        assert d.dtype == torch.float32 and d.shape == w.shape
        assert torch.equal(d, p.float())  # the reference is the plain decode (fp32 product)
        wb = w.bfloat16().double()  # quantized from the bf16 values, in fp32
        s = wb.reshape(w.shape[0], -1, G).abs().amax(-1) / qmax
        s = torch.where(s == 0, torch.ones_like(s), s).repeat_interleave(G, dim=1)
        err = (wb - p).abs()
        if fmt == "fp8":  # 3 mantissa bits: half a step, 2^-4 relative (2^-10 * s subnormal)
            bound = torch.maximum(wb.abs() * 2.0**-4, s * 2.0**-10)
        else:
            bound = s / 2
        assert bool((err <= bound * (1 + 1e-5) + 1e-12).all()), (err / bound).max()
    assert bool((deq[2][3] == 0).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_representable_values_round_trip_exactly(fmt) -> None:
    H, F, G = 64, 32, 16
    gen = torch.Generator().manual_seed(7)
    if fmt == "fp8":
        finite = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=torch.uint8)
        levels = finite.view(torch.float8_e4m3fn).float()
        qmax = 448.0
    else:
        qmax = 127.0 if fmt == "int8" else 7.0
        levels = torch.arange(-qmax, qmax + 1)

    def matrix(R: int, K: int) -> torch.Tensor:
        q = levels[torch.randint(len(levels), (R, K), generator=gen)]
        q[:, ::G] = qmax  # every row (int8/fp8) and group (int4) reaches the extreme
        scale = 2.0 ** torch.randint(-12, -4, (R, 1), generator=gen).float()  # exact powers
        return q * scale

    gate, up, down = matrix(F, H), matrix(F, H), -matrix(H, F)
    row = pk.quantize_expert(gate, up, down, fmt, group_size=G)
    deq = pk.dequantize_expert(row, H, F, fmt, group_size=G)
    for w, d in zip((gate, up, down), deq, strict=True):
        assert torch.equal(w, d)


def test_fp8_decoder_agrees_with_torch_on_all_256_codes() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    kernel = quant.decode_fp8_e4m3(codes)  # the kernels' integer decoder, run by Triton
    ref = codes.view(torch.float8_e4m3fn).float()
    plain = torch.tensor([plain_fp8(c) for c in range(256)])
    nan = ref.isnan()
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(kernel.isnan(), nan) and torch.equal(plain.isnan(), nan)
    # Bitwise, so -0.0 (0x80) must decode as -0.0.
    assert torch.equal(kernel[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    assert torch.equal(plain[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    assert ref[0x7E] == 448 and ref[0x01] == 2.0**-9 and ref[0x08] == 2.0**-6


def test_fp8_quantization_saturates_and_rounds_to_nearest_even() -> None:
    H, F = 16, 16
    gate = torch.zeros(F, H)
    gate[0, 0] = 448.0  # scale 1 for row 0
    gate[0, 1] = 9.0  # representable: the step in [8, 16) is 1
    gate[0, 2] = 8.5  # halfway between 8 and 9: even mantissa -> 8
    gate[0, 3] = 9.5  # halfway between 9 and 10: even mantissa -> 10
    gate[0, 4] = 17.0  # halfway between 16 and 18 (step 2 in [16, 32)): even -> 16
    row = pk.quantize_expert(gate, gate, gate.t(), "fp8")
    g, _, _ = pk.dequantize_expert(row, H, F, "fp8")
    assert g[0, :5].tolist() == [448.0, 9.0, 8.0, 10.0, 16.0]
    gate[1, 0] = 1e30  # saturates at the row's max: never a NaN code
    row = pk.quantize_expert(gate, gate, gate.t(), "fp8")
    codes = row[: pk.QuantLayout.of("fp8", H, F).gate_scale]
    assert not bool(((codes & 0x7F) == 0x7F).any())
    assert pk.dequantize_expert(row, H, F, "fp8")[0][1, 0] == 1e30


def test_quantize_and_dequantize_bad_input() -> None:
    g, u, d = make_expert(32, 16, 0)
    with pytest.raises(ValueError, match="fmt must be one of 'int8', 'fp8', 'int4'"):
        pk.quantize_expert(g, u, d, "int2")
    with pytest.raises(ValueError, match=r"expected gate/up \[F, H\] and down \[H, F\]"):
        pk.quantize_expert(g, u, g, "int8")
    with pytest.raises(ValueError, match="gate must be a 2-D float tensor"):
        pk.quantize_expert(g.int(), u, d, "int8")
    row = pk.quantize_expert(g, u, d, "int8")
    with pytest.raises(ValueError, match=r"rows hold 1792 bytes, expected 1920 \(int8, H=32, F=17"):
        pk.dequantize_expert(row, 32, 17, "int8")
    with pytest.raises(ValueError, match="row must be a uint8 tensor"):
        pk.dequantize_expert(row.float(), 32, 16, "int8")
    # A batch of rows dequantizes row by row.
    batch = torch.stack([row, pk.quantize_expert(u, g, d, "int8")])[[1, 0, 1]]
    bg, bu, bd = pk.dequantize_expert(batch, 32, 16, "int8")
    assert bg.shape == (3, 16, 32) and bd.shape == (3, 32, 16)
    assert torch.equal(bg[1], pk.dequantize_expert(row, 32, 16, "int8")[0])
    assert torch.equal(bg[0], bu[1])


def test_quantization_error_on_an_olmoe_sized_slice() -> None:
    """N(0, 0.02) weights: mean abs error relative to the weight std stays small."""
    H, F = 512, 256  # an OLMoE-1B-7B expert is 2048 x 1024; the statistics are per row/group
    gate, up, down = make_expert(H, F, seed=1)
    limits = {"int8": 0.01, "fp8": 0.03, "int4": 0.15}  # measured ~0.006, ~0.019, ~0.10
    for fmt, limit in limits.items():
        deq = pk.dequantize_expert(pk.quantize_expert(gate, up, down, fmt), H, F, fmt)
        err = torch.cat(
            [(w - d).abs().flatten() for w, d in zip((gate, up, down), deq, strict=True)]
        )
        assert err.mean().item() / 0.02 < limit, fmt


# --------------------------------------------------------------------------- kernels


def make_quant_slab(C: int, H: int, F: int, fmt: str, group: int, seed: int = 0):
    experts = [make_expert(H, F, seed=seed * 100 + c, std=1.0 / H**0.5) for c in range(C)]
    slab = torch.stack([pk.quantize_expert(*e, fmt, group_size=group) for e in experts])
    return slab


def routed_inputs(T: int, k: int, H: int, C: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    slots = torch.stack([torch.randperm(C, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    return x, slots, weights


# (T, k, H, F, group, dtype): odd sizes; int4 with several groups per row (H = 48 and 256)
# and whole-row groups (H = 50 and F < group; H = 130 is no multiple of an int4 group, so
# int4 takes 50). Several groups along F: test_quantized_expert_ffn_is_deterministic_...
CASES = [
    (1, 1, 48, 16, 16, torch.float32),
    (3, 3, 130, 40, 64, torch.bfloat16),
    (1, 8, 256, 64, 64, torch.float16),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("T", "k", "H", "F", "group", "dtype"), CASES)
def test_quantized_expert_ffn_matches_reference(fmt, T, k, H, F, group, dtype) -> None:
    if fmt == "int4" and H == 130:
        H = 50
    C = max(k, 4)
    slab = make_quant_slab(C, H, F, fmt, group, seed=H)
    x, slots, weights = routed_inputs(T, k, H, C, dtype, seed=k)
    args = (x, slab, slots, weights, H, F)
    kw = dict(fmt=fmt, group_size=group)
    y = pk.expert_ffn(*args, **kw, out_dtype=torch.float32)
    y_ref = pk.expert_ffn_ref(*args, **kw, out_dtype=torch.float32)
    assert y.shape == y_ref.shape == (T, H) and y.is_contiguous() and y_ref.is_contiguous()
    # Both dequantize exactly and accumulate in fp32: only summation order differs.
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5 * y_ref.abs().max().item())
    # ... and against the experts computed one by one from this file's own decoding; the
    # kernel stores its fp32 accumulator in the output dtype, as y.to(dtype) does.
    experts = {c: plain_dequant(slab[c], fmt, H, F, group) for c in set(slots.flatten().tolist())}
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            g, u, d = experts[int(slots[t, j])]
            xt = x[t].double()
            want[t] += weights[t, j].double() * (d @ (torch.nn.functional.silu(g @ xt) * (u @ xt)))
    atol, rtol = DTYPE_TOLS[dtype]
    torch.testing.assert_close(y.to(dtype).double(), want, rtol=rtol, atol=atol)
    assert pk.expert_ffn_ref(*args, **kw).dtype == dtype


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_expert_ffn_is_deterministic_reads_views_and_skips_bad_slots(fmt) -> None:
    H, F, G = 48, 64, 16  # int4: 3 groups along H, 4 along F
    big = make_quant_slab(6, H, F, fmt, G, seed=3)
    slab = big[1:5]  # a view with an offset, as a store's slab slice would be (16-aligned)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([[3, 0], [1, 1]], dtype=torch.int32)
    w = torch.tensor([[0.7, 0.3], [0.5, 0.25]])
    kw = dict(fmt=fmt, group_size=G)
    y1 = pk.expert_ffn(x, slab, slots, w, H, F, **kw)
    y2 = pk.expert_ffn(x, slab, slots, w, H, F, **kw)
    assert torch.equal(y1, y2)  # bitwise, run to run
    torch.testing.assert_close(y1, pk.expert_ffn_ref(x, big, slots + 1, w, H, F, **kw))
    # The output dtype follows x by default.
    yb = pk.expert_ffn(x.bfloat16(), slab, slots, w, H, F, **kw)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, pk.expert_ffn_ref(x.bfloat16(), slab, slots, w, H, F, **kw))
    # Unchecked out-of-range slots read as zeros (no fault).
    bad = torch.tensor([[3, 9], [-1, 1]])
    y3 = pk.expert_ffn(x, slab, bad, w, H, F, **kw, check_slots=False)
    kept = torch.tensor([[0.7], [0.25]])  # the weights of the in-range slots
    want = pk.expert_ffn_ref(x, slab, torch.tensor([[3], [1]]), kept, H, F, **kw)
    torch.testing.assert_close(y3, want)
    # No experts, or no tokens: zeros of the right shape.
    assert torch.equal(
        pk.expert_ffn(x, slab, slots[:, :0], w[:, :0], H, F, **kw), torch.zeros(2, H)
    )
    y0 = pk.expert_ffn(x[:0], slab, slots[:0], w[:0], H, F, **kw)
    assert y0.shape == (0, H)


def _with_fmt(ffn):
    """`ffn` taking the format as its 7th positional argument."""

    def fn(x, slab, slots, w, H, F, fmt, **kw):
        return ffn(x, slab, slots, w, H, F, fmt=fmt, **kw)

    return fn


def test_quantized_expert_ffn_bad_input() -> None:
    H, F = 32, 16
    slab = make_quant_slab(4, H, F, "int8", 128)
    nbytes = slab.shape[1]
    x = torch.randn(1, H)
    slots = torch.tensor([[0, 1]])
    w = torch.rand(1, 2)
    for fn in (_with_fmt(pk.expert_ffn), _with_fmt(pk.expert_ffn_ref)):
        with pytest.raises(
            ValueError, match=r"fmt must be None \(float slab rows\), one of 'int8', 'fp8', "
        ):
            fn(x, slab, slots, w, H, F, "q8")
        with pytest.raises(ValueError, match=r"or a GGML row format .*, got 'bf16'"):
            fn(x, slab, slots, w, H, F, "bf16")
        with pytest.raises(TypeError, match=r"slab must be a 2-D uint8 tensor \[C, nbytes\]"):
            fn(x, slab.float(), slots, w, H, F, "int8")
        with pytest.raises(TypeError, match="slab must be a 2-D uint8 tensor"):
            fn(x, slab[0], slots, w, H, F, "int8")
        with pytest.raises(ValueError, match=rf"slab rows hold {nbytes} bytes, expected \d+ \(fp8"):
            fn(x, slab, slots, w, H, F + 16, "fp8")
        with pytest.raises(ValueError, match="rows hold"):
            fn(x, slab, slots, w, H, F, "int4")  # int4 rows are shorter
        with pytest.raises(ValueError, match="int4 group_size 32 must divide ffn_size 48"):
            fn(x, slab, slots, w, H, 48, "int4", group_size=32)
        with pytest.raises(IndexError, match=r"slot ids must be in \[0, 4\)"):
            fn(x, slab, torch.tensor([[0, 4]]), w, H, F, "int8")
        with pytest.raises(ValueError, match="x has hidden size 32, expected 31"):
            fn(x, slab, slots, w, 31, F, "int8")
        with pytest.raises(ValueError, match=r"weights \[1, 3\] and slots \[1, 2\] differ"):
            fn(x, slab, slots, torch.rand(1, 3), H, F, "int8")
        with pytest.raises(TypeError, match="slots must be an int32/int64 tensor"):
            fn(x, slab, slots.float(), w, H, F, "int8")
        with pytest.raises(ValueError, match="slab rows must be contiguous"):
            fn(x, slab.t().contiguous().t(), slots, w, H, F, "int8")
        with pytest.raises(TypeError, match="x dtype must be float32, bfloat16 or float16"):
            fn(x.int(), slab, slots, w, H, F, "int8")
    # The kernel reads fp32 scales at 16-byte offsets of each row: rows must be aligned.
    padded = torch.zeros(4, nbytes + 4, dtype=torch.uint8)
    padded[:, :nbytes] = slab
    with pytest.raises(ValueError, match="16-byte aligned"):
        pk.expert_ffn(x, padded[:, :nbytes], slots, w, H, F, fmt="int8")
    flat = torch.zeros(4 * nbytes + 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16-byte aligned"):
        pk.expert_ffn(x, flat[4:].view(4, nbytes), slots, w, H, F, fmt="int8")
    # The reference does not care.
    pk.expert_ffn_ref(x, padded[:, :nbytes], slots, w, H, F, fmt="int8")
    # A uint8 slab is not float rows: fmt=None refuses it.
    with pytest.raises(TypeError, match="slab dtype must be float32, bfloat16 or float16"):
        pk.expert_ffn(x, slab, slots, w, H, F)


# --------------------------------------------------------------------------- dispatch, op


def test_launch_config_is_computed_once_per_layout() -> None:
    H, F, G = 48, 64, 16
    slab = make_quant_slab(4, H, F, "int4", G, seed=3)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(0))
    slots, w = torch.tensor([[3, 0]]), torch.tensor([[0.7, 0.3]])
    quant.quant_launch_config.cache_clear()
    for _ in range(3):
        pk.expert_ffn(x, slab, slots, w, H, F, fmt="int4", group_size=G)
    info = quant.quant_launch_config.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def _op_cases():
    gen = torch.Generator().manual_seed(1)
    H, F = 24, 8
    x = torch.randn(3, H, generator=gen)
    slots = torch.tensor([[0, 2], [3, 1], [2, 2]])
    w = torch.rand(3, 2, generator=gen)
    op = torch.ops.psr.expert_ffn.default
    cases = []
    for fmt in FORMATS:
        slab = make_quant_slab(4, H, F, fmt, 128, seed=2)
        cases.append((op, (x, slab, slots, w, H, F), {"fmt": fmt}))
    slab = make_quant_slab(4, H, F, "int8", 128, seed=2)
    cases.append((op, (x.half(), slab, slots.int(), w, H, F, None, "int8", 128), {}))
    cases.append((op, (x, slab, slots, w, H, F), {"fmt": "int8", "out_dtype": torch.bfloat16}))
    return cases


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PSR_COMPUTE", "torch")


@pytest.mark.usefixtures("torch_path")
def test_quantized_expert_ffn_op_passes_opcheck_and_its_fake_matches() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    for op, args, kwargs in _op_cases():
        torch.library.opcheck(op, args, kwargs)
        real = op(*args, **kwargs)
        mode = FakeTensorMode()
        fargs, fkwargs = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        with mode:
            fake = op(*fargs, **fkwargs)
        assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)
        kw = dict(zip(("out_dtype", "fmt", "group_size"), args[6:], strict=False)) | kwargs
        ref = pk.expert_ffn_ref(*args[:6], **kw)
        torch.testing.assert_close(real, ref)
