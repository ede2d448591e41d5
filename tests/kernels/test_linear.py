"""psr_kernels.linear: `x W^T` with W in its stored format (every GGML block type psr
computes, int8 / fp8 / int4 codes with scales), against gguf-py's dequantization (the
independent reference) and `linear_ref`; rows bit-identical for any T (batch invariance).
Grids stay tiny: the kernels run under Triton's interpreter here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_blocks import gguf_dequant, random_blocks

import psr_kernels as pk
from psr_kernels.linear import BLOCK_M, BLOCK_N, LinearFormat


def _inputs(t: str) -> int:
    """Inputs per row: whole blocks, a masked tail tile where the type allows one."""
    qk = pk.BLOCK_TYPE_TRAITS[t].block_len
    return {1: 77, 32: 160, 128: 256, 256: 256}[qk]


def _ggml_weight(t: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored rows uint8 [n, row bytes], gguf-py's fp32 dequantization [n, k])."""
    raw = random_blocks(t, n, k, np.random.default_rng(seed))
    q = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(n, -1)
    return q, gguf_dequant(raw, t, (n, k))


@pytest.mark.parametrize("t", pk.BLOCK_TYPES)
def test_every_block_type_equals_the_gguf_py_twin(t: str) -> None:
    """N = 37 outputs (two column tiles, the second masked), T = 3 rows, a masked K tail."""
    n, k = BLOCK_N + 5, _inputs(t)
    q, w = _ggml_weight(t, n, k, seed=len(t))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    fmt = LinearFormat.parse(t)
    want = x.double() @ w.double().T
    y = pk.linear(x, q, fmt, k)
    ref = pk.linear_ref(x, q, fmt, k)
    scale = want.abs().max().item()
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(ref.double(), want, rtol=0, atol=1e-5 * scale)


QUANT = [("int8", None), ("fp8", None), ("int4", 16), ("int8", 32), ("fp8", 64), ("int4", 128)]


@pytest.mark.parametrize(("word", "group"), QUANT)
def test_int8_fp8_int4_per_channel_and_group(word: str, group: int | None) -> None:
    k = 77 if group is None else 2 * group + (0 if group >= 64 else 3 * group)  # odd groups
    n = BLOCK_N + 3
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.1, 3.0, n)[:, None]
    fmt = LinearFormat.parse(word, group)
    q, s = pk.quantize_weight(w, fmt)
    assert q.shape == (n, fmt.row_bytes(k)) and s.shape == fmt.scale_shape(n, k)
    deq = pk.dequantize_weight(q, fmt, k, s)
    # the codes' own rounding: half a step of the group's scale at most (fp8: 1/16 relative)
    step = s.repeat_interleave(fmt.group_of(k), 1)
    bound = step * (0.5 if word != "fp8" else 448 / 16)
    assert ((deq - w).abs() <= bound + 1e-6).all()
    x = torch.randn(4, k, generator=g)
    bias = torch.randn(n, generator=g)
    y = pk.linear(x, q, fmt, k, s, bias=bias)
    want = x.double() @ deq.double().T + bias.double()
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(pk.linear_ref(x, q, fmt, k, s, bias=bias), y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", ["Q8_0", "Q4_K", "BF16"])
def test_half_inputs_and_outputs(t: str, dtype: torch.dtype) -> None:
    """bf16 / fp16 x widened exactly, fp32 accumulation, the output rounded once (the
    interpreter truncates where CUDA rounds: within one unit in the last place)."""
    n, k = 24, 256
    q, w = _ggml_weight(t, n, k, seed=3)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    bias = torch.randn(n).to(dtype)
    fmt = LinearFormat.parse(t)
    y = pk.linear(x, q, fmt, k, bias=bias)
    assert y.dtype == dtype
    want = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(y.double(), want, rtol=2**-7, atol=1e-3)
    y32 = pk.linear(x, q, fmt, k, bias=bias, out_dtype=torch.float32)
    torch.testing.assert_close(y32.double(), want, rtol=1e-5, atol=1e-5)
    ref = pk.linear_ref(x, q, fmt, k, bias=bias, out_dtype=torch.float32)
    torch.testing.assert_close(ref, y32, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("word", "group"), [("Q4_K", None), ("Q6_K", None), ("int8", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_bit_identical_for_any_batch(word: str, group, dtype: torch.dtype) -> None:
    """Row t of a batch equals row t computed in a smaller batch, and a row computed alone
    equals the same row at another place of a batch (two row tiles: T up to BLOCK_M + 3)."""
    n, k = 40, 256
    g = torch.Generator().manual_seed(5)
    fmt = LinearFormat.parse(word, group)
    if fmt.block is not None:
        q, _ = _ggml_weight(word, n, k, seed=6)
        s = None
    else:
        q, s = pk.quantize_weight(torch.randn(n, k, generator=g), fmt)
    x = torch.randn(BLOCK_M + 3, k, generator=g).to(dtype)
    full = pk.linear(x, q, fmt, k, s)
    for t in (1, 2, BLOCK_M - 1, BLOCK_M + 1):
        assert torch.equal(pk.linear(x[:t], q, fmt, k, s), full[:t]), t
    for i in (1, BLOCK_M + 2):
        assert torch.equal(pk.linear(x[i : i + 1], q, fmt, k, s), full[i : i + 1]), i
    shuffled = x[[BLOCK_M + 2, 0, 5]]
    assert torch.equal(pk.linear(shuffled, q, fmt, k, s), full[[BLOCK_M + 2, 0, 5]])


@pytest.mark.parametrize(("t", "cols"), [("Q8_0", 64), ("Q4_K", 256), ("F16", 40)])
def test_heads_of_transposed_blocks(t: str, cols: int) -> None:
    """`linear_heads_t`: 3 heads' W_h [K, C] as rows h * K + k (MLA's attn_k_b), against
    gguf-py's twin; rows bit-identical for any T."""
    heads, k = 3, 48
    q, w = _ggml_weight(t, heads * k, cols, seed=8)
    x = torch.randn(BLOCK_M + 2, k, generator=torch.Generator().manual_seed(9))
    fmt = LinearFormat.parse(t)
    want = torch.einsum("tk,hkc->thc", x.double(), w.double().reshape(heads, k, cols))
    y = pk.linear_heads_t(x, q, fmt, heads)
    torch.testing.assert_close(y.double(), want.reshape(len(x), -1), rtol=0, atol=1e-5)
    ref = pk.linear_heads_t_ref(x, q, fmt, heads)
    torch.testing.assert_close(ref, y, rtol=1e-5, atol=1e-5)
    assert torch.equal(pk.linear_heads_t(x[BLOCK_M : BLOCK_M + 1], q, fmt, heads), y[BLOCK_M:-1])
    with pytest.raises(ValueError, match="144 rows are not 5 heads' matrices"):
        pk.linear_heads_t(x, q, fmt, 5)


def test_decode_rows_and_empty_batches() -> None:
    q, w = _ggml_weight("Q5_K", 8, 256, seed=7)
    fmt = LinearFormat.parse("Q5_K")
    torch.testing.assert_close(pk.decode_rows(q[[3, 1]], fmt, 256), w[[3, 1]], rtol=0, atol=0)
    assert pk.linear(torch.zeros(0, 256), q, fmt, 256).shape == (0, 8)
    assert fmt.nbytes(8, 256) == q.numel() and str(LinearFormat.parse("int4", 32)) == "int4/g32"


def test_bad_formats_and_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"'TQ2_0' is not a dense weight format psr computes"):
        LinearFormat.parse("TQ2_0")
    with pytest.raises(ValueError, match="int4 needs a group_size"):
        LinearFormat.parse("int4")
    with pytest.raises(ValueError, match="Q8_0 blocks carry their own scales"):
        LinearFormat.parse("Q8_0", 32)
    fmt = LinearFormat.parse("Q8_0")
    q = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"a Q8_0 weight of 64 inputs is uint8 \[N, 68\]"):
        pk.linear(torch.zeros(1, 64), q, fmt, 64)
    with pytest.raises(ValueError, match=r"x must be \[T, 32\]"):
        pk.linear(torch.zeros(1, 64), q, fmt, 32)
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        pk.linear(torch.zeros(1, 32), q, fmt, 32, bias=torch.zeros(5))
    i8 = LinearFormat.parse("int8")
    with pytest.raises(ValueError, match=r"int8 needs fp32 scales \[4, 1\], got None"):
        pk.linear(torch.zeros(1, 32), torch.zeros(4, 32, dtype=torch.uint8), i8, 32)
    with pytest.raises(ValueError, match="a Q4_K row holds whole blocks of 256"):
        pk.linear(torch.zeros(1, 96), q, LinearFormat.parse("Q4_K"), 96)
