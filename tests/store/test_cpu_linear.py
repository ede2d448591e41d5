"""The batch-invariant dense CPU linear (csrc/cpu/expert_gemv.cpp `linear`, psr.store.cpu_linear)
against `x @ dequant(W)^T` for float rows of every dtype and GGUF blocks of several types
(dequantized by gguf-py), on every ISA path; every output row bit-identical whatever T, the
other rows and the thread count; clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_blocks import gguf_dequant, random_blocks

import psr_kernels as pk
from psr import store

# The fp32-activation path's references (the q8 path's: test_cpu_qdot.py).
pytestmark = pytest.mark.usefixtures("f32_dots")

ISAS = store.cpu_isas()
THREADS = sorted({1, min(2, store.cpu_max_threads())})
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
# Block types of dense layers in real files (attention / output head: Q4_K, Q6_K, Q8_0, ...)
# and one of each family: legacy 32-blocks, K-quants, IQ grids, MXFP4, float.
# Q8_0 and the K-quants Q4_K / Q5_K / Q6_K take the several-input kernels (a block decoded once
# for up to four tokens), the others one token at a time.
GGML = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_1", "Q2_K", "IQ4_XS", "IQ2_XXS", "MXFP4"]
GGML += ["F16", "BF16"]


def _close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    # fp32 sums in another order: a few ulps of the sum of |x| |w| per output
    bound = (x.abs() @ w.abs().T) * 1e-5 + 1e-30
    assert bool(((y - ref).abs() <= bound).all()), float(((y - ref).abs() / bound).max())


def _invariant(x: torch.Tensor, weight: torch.Tensor, **kw) -> torch.Tensor:
    """cpu_linear of x on each ISA path; asserts that every subset of rows, in any order,
    at any thread count, gives the same rows bit for bit. Returns the best path's output."""
    g = torch.Generator().manual_seed(9)
    T = x.shape[0]
    for isa in ISAS:
        full = store.cpu_linear(x, weight, isa=isa, threads=1, **kw)
        for n in (1, 2, 3, 5, T):
            idx = torch.randperm(T, generator=g)[:n]
            for threads in THREADS:
                part = store.cpu_linear(x[idx], weight, isa=isa, threads=threads, **kw)
                assert torch.equal(part, full[idx]), (isa, n, threads)
    return full


@pytest.mark.parametrize("wdtype", FLOATS, ids=str)
@pytest.mark.parametrize("xdtype", FLOATS, ids=str)
def test_float_weights_match_matmul_and_are_batch_invariant(wdtype, xdtype) -> None:
    g = torch.Generator().manual_seed(1)
    N, K = 37, 70  # odd: partial quads and vector tails
    x = torch.randn(8, K, generator=g).to(xdtype)
    w = torch.randn(N, K, generator=g).to(wdtype)
    bias = torch.randn(N, generator=g)
    y = _invariant(x, w, bias=bias, out_dtype=torch.float32)
    _close(y, x.float() @ w.float().T + bias, x.float(), w.float())
    assert store.cpu_linear(x, w).dtype == xdtype
    assert store.cpu_linear(x, w, out_dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize("t", GGML)
def test_ggml_weights_match_the_dequantized_twin(t) -> None:
    rng = np.random.default_rng(2)
    N, K = 19, 512
    raw = random_blocks(t, N, K, rng)
    weight = torch.from_numpy(np.ascontiguousarray(raw)).reshape(N, -1)
    twin = gguf_dequant(raw, t, (N, K))
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(3))
    y = _invariant(x, weight, ggml_type=pk.ggml_type_id(t), in_features=K)
    _close(y, x @ twin.T, x, twin)


@pytest.mark.parametrize("t", ["F32", "F16", "BF16"])
def test_ggml_float_types_are_their_float_format_bit_for_bit(t) -> None:
    """A GGUF F32 / F16 / BF16 matrix runs its float format's row kernels (several tokens
    per weight read), so it gives the float tensor's bits on every ISA path."""
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[t]
    g = torch.Generator().manual_seed(4)
    N, K = 21, 70  # a partial quad and a vector tail
    w = torch.randn(N, K, generator=g).to(dtype)
    raw = w.view(torch.uint8).reshape(N, -1)
    x = torch.randn(9, K, generator=g)
    for isa in ISAS:
        got = store.cpu_linear(x, raw, ggml_type=pk.ggml_type_id(t), in_features=K, isa=isa)
        assert torch.equal(got, store.cpu_linear(x, w, isa=isa)), isa


def test_float_rows_with_a_row_stride_and_no_tokens() -> None:
    x = torch.randn(3, 40)
    big = torch.randn(11, 64)
    w = big[:, :40]  # rows 64 floats apart
    torch.testing.assert_close(store.cpu_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert store.cpu_linear(x[:0], w).shape == (0, 11)


def test_bad_input_is_a_clear_error() -> None:
    x, w = torch.randn(2, 32), torch.randn(5, 32)
    q = torch.zeros(5, 18, dtype=torch.uint8)  # Q4_0 rows of 32
    q40 = pk.ggml_type_id("Q4_0")
    cases = [
        (dict(x=x.double().int(), weight=w), "x must be float"),
        (dict(x=x[0], weight=w), "x must be a 2-D"),
        (dict(x=x, weight=w[:, :31]), "weight"),
        (dict(x=x, weight=w.double()), "weight must be float32"),
        (dict(x=x, weight=q, ggml_type=q40), "in_features is required"),
        (dict(x=x, weight=q, ggml_type=q40, in_features=31), "in_features=31"),
        (dict(x=x, weight=q[:, :17], ggml_type=q40, in_features=32), "hold 18 bytes"),
        (dict(x=x, weight=w, ggml_type=q40, in_features=32), "must be uint8"),
        (dict(x=x, weight=q, ggml_type=4, in_features=32), "ggml_type 4"),
        (dict(x=x, weight=w, bias=torch.zeros(4)), "bias"),
        (dict(x=x, weight=w, threads=0), "threads"),
        (dict(x=x, weight=w, isa="sse9"), "isa 'sse9'"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            store.cpu_linear(**kw)
