"""psr_kernels.grouped_ffn (the grouped prefill dequant-GEMM) against its per-expert
reference and the decode kernels' reference, every row format, under the interpreter.

Tolerances: kernel vs `grouped_expert_ffn_ref` (both fp32 math on the same stored weights)
at 1e-4 of the output's scale for every format and dtype (on a GPU, bf16 / fp16
activations dot in TF32: 5e-3); the reference itself against `expert_ffn_ref` (the decode
path's reference, independent grouping) at 1e-5.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from ggml_blocks import MIXES, expert_rows

import psr_kernels as pk
from psr_kernels import ggml
from psr_kernels.grouped_ffn import (
    GROUP_M,
    expert_groups,
    grouped_expert_ffn,
    grouped_expert_ffn_ref,
)


def make_slab(C: int, H: int, F: int, dtype: torch.dtype, seed: int = 0):
    """`[C, 3HF]` float rows of C random experts in `dtype`, and their fp32 matrices."""
    gen = torch.Generator().manual_seed(seed)
    mats = [[torch.randn(*s, generator=gen) / s[1] ** 0.5 for s in ((F, H), (F, H), (H, F))]
            for _ in range(C)]  # fmt: skip
    return torch.stack([pk.pack_expert(*m) for m in mats]).to(dtype), mats


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * max(1.0, ref.abs().max().item()))


def _routes(T: int, k: int, used: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids `[T, k]` over experts 0..used-1 (distinct per token), weights `[T, k]`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(T)])
    return ids, torch.rand(T, k, generator=gen)


def _check(x, slab, ids, w, H, F, **kw) -> torch.Tensor:
    y = grouped_expert_ffn(x, slab, ids, w, H, F, out_dtype=torch.float32, **kw)
    ref = grouped_expert_ffn_ref(x, slab, ids, w, H, F, out_dtype=torch.float32, **kw)
    _close(y, ref, 1e-4 if x.dtype == torch.float32 or pk.interpreting() else 5e-3)
    if kw.get("bias") is not None:  # the decode reference's: per routed pair
        kw = {**kw, "bias": kw["bias"][ids].contiguous()}
    dec = pk.expert_ffn_ref(x, slab, ids, w, H, F, out_dtype=torch.float32, **kw)
    _close(ref, dec, 1e-5)
    assert y.shape == (x.shape[0], H) and y.is_contiguous()
    return y


# (T, k): tokens not a multiple of GROUP_M (an expert's run spans two tiles), one token.
SHAPES = [(GROUP_M + 5, 2), (1, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ["x's dtype", "bf16"])
@pytest.mark.parametrize(("T", "k"), SHAPES)
def test_float_rows(T, k, dtype, rows) -> None:
    H, F, C = 40, 24, 5  # neither a multiple of the blocks; expert 4 is never routed
    slab, _ = make_slab(C, H, F, dtype if rows == "x's dtype" else torch.bfloat16, seed=T)
    ids, w = _routes(T, k, C - 1, seed=k)
    x = torch.randn(T, H).to(dtype)
    _check(x, slab, ids, w, H, F)
    assert grouped_expert_ffn(x, slab, ids, w, H, F).dtype == dtype  # x's by default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", pk.QUANT_FORMATS)
def test_quantized_rows(fmt, dtype) -> None:
    H, F, C, G = 64, 48, 4, 16  # int4: 4 scale groups along H, 3 along F
    gen = torch.Generator().manual_seed(3)
    experts = [
        (torch.randn(F, H, generator=gen), torch.randn(F, H, generator=gen),
         torch.randn(H, F, generator=gen))
        for _ in range(C)
    ]  # fmt: skip
    slab = torch.stack([pk.quantize_expert(*e, fmt, group_size=G) for e in experts])
    for T, k in SHAPES:
        ids, w = _routes(T, k, C - 1, seed=T)
        x = (torch.randn(T, H, generator=gen) / 8).to(dtype)
        _check(x, slab, ids, w, H, F, fmt=fmt, group_size=G)


@pytest.mark.parametrize("types", MIXES, ids=lambda t: "-".join(t))
def test_ggml_rows(types) -> None:
    """Every block type the decode kernels compute (ggml_blocks.MIXES), FP8_B128 included."""
    rng = np.random.default_rng(5)
    H, F, C = 256, 256, 3
    slab = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(C)])
    ids, w = _routes(GROUP_M + 3, 1, 2, seed=1)  # experts 0, 1 only; 35 pairs
    x = torch.randn(GROUP_M + 3, H)
    _check(x, slab, ids, w, H, F, fmt=ggml.ggml_format(*types))


def test_table_absent_bias_clamped_and_scaled_input() -> None:
    H, F, C, E, T, k = 32, 16, 3, 5, 9, 2
    slab, _ = make_slab(C, H, F, torch.float32, seed=7)
    ids, w = _routes(T, k, E, seed=2)
    table = torch.tensor([2, -1, 0, 1, -1])  # experts 1 and 4 absent (computed elsewhere)
    bias = torch.randn(E, 2 * F + H)
    act = pk.Activation("clamped", alpha=1.702, limit=0.5)
    x = torch.randn(T, H)
    kw = dict(slot_table=table, skip_absent=True, bias=bias, act=act)
    _check(x, slab, ids, w, H, F, **kw)
    _check(x, slab, ids, w, H, F, **kw, scale_input=True)
    # Unchecked slots out of range read nothing, as skip_absent's absent experts
    kw2 = dict(slot_table=table, bias=bias, act=act)
    y = grouped_expert_ffn(x, slab, ids, w, H, F, **kw2, check_slots=False)
    assert torch.equal(y, grouped_expert_ffn(x, slab, ids, w, H, F, **kw))
    # A token whose experts are all absent gets exactly nothing, bias included.
    gone = torch.tensor([[1, 4]])
    y = grouped_expert_ffn(x[:1], slab, gone, w[:1], H, F, **kw)
    assert torch.equal(y, torch.zeros(1, H))


def _interpreted_dot_rows_move() -> bool:
    """Whether Triton's interpreter (tl.dot is numpy's matmul) gives a row of a tile other
    bits at another position in it: this CPU's BLAS kernels do on AVX2 (seen here)."""
    import numpy as np

    if not os.environ.get("TRITON_INTERPRET"):
        return False
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 48)).astype(np.float32)
    b = rng.standard_normal((48, 32)).astype(np.float32)
    full = a @ b
    for i in range(16):
        alone = np.zeros_like(a)
        alone[0] = a[i]
        if not np.array_equal((alone @ b)[0], full[i]):
            return True
    return False


def test_a_token_s_result_does_not_depend_on_the_others() -> None:
    """Block sizes are fixed per layout: a token alone gives the bits it gives in a batch
    (what keeps chunk-major and layer-major prefill identical). Under the interpreter the
    tile's dot is numpy's BLAS, whose rows are not position-invariant on every CPU: there
    the bits are not the kernel's to keep (the GPU run checks them)."""
    if _interpreted_dot_rows_move():
        pytest.skip("the interpreter's tl.dot (numpy BLAS) moves a row's bits on this CPU")
    H, F, C, T = 48, 32, 4, GROUP_M + 9
    slab = torch.stack(
        [pk.quantize_expert(*e, "int8") for e in make_slab(C, H, F, torch.float32)[1]]
    )
    ids, w = _routes(T, 2, C, seed=4)
    x = torch.randn(T, H)
    y = grouped_expert_ffn(x, slab, ids, w, H, F, fmt="int8")
    for t in (0, GROUP_M, T - 1):
        one = grouped_expert_ffn(x[t : t + 1], slab, ids[t : t + 1], w[t : t + 1], H, F, fmt="int8")
        assert torch.equal(one[0], y[t])


def test_one_row_slab_takes_the_cached_grouping_with_the_same_bits() -> None:
    """Prefill's per-expert calls (a one-row slab) group without sorting: the bits of the
    general grouping of the same pairs."""
    H, F, T = 40, 24, GROUP_M + 5
    slab, _ = make_slab(2, H, F, torch.float32, seed=3)
    x, w = torch.randn(T, H), torch.rand(T, 1)
    ids = torch.zeros(T, 1, dtype=torch.long)
    one = grouped_expert_ffn(x, slab[:1], ids, w, H, F)
    assert torch.equal(one, grouped_expert_ffn(x, slab, ids, w, H, F))  # 2 rows: sorted


def test_expert_groups_cover_each_expert_s_pairs_once() -> None:
    ids = torch.tensor([[3, 0], [0, 3], [3, 1], [0, 2], [3, 0]])
    present = ids != 2
    order, tiles = expert_groups(ids, 5, present, block_m=2)
    assert order[:9].tolist() == [1, 2, 6, 9, 5, 0, 3, 4, 8]  # by expert, pairs ascending
    # (expert, first row, end of its run): expert 0's 4 pairs in two tiles of 2, expert 1's
    # one, expert 3's 4; experts 2 (absent) and 4 (unused) in none; then the bound's
    # 10 // 2 + 5 = 10 tiles filled with empty ones (no host sync to count them)
    used = [[0, 0, 4], [0, 2, 4], [1, 4, 5], [3, 5, 9], [3, 7, 9]]
    assert tiles.tolist() == used + [[4, 0, 0]] * 5
    empty = expert_groups(torch.zeros(0, 2, dtype=torch.long), 4)
    assert empty[0].numel() == 0 and empty[1].shape == (0, 3)
    # one expert: its run's tiles, and at most one empty tile
    _, one = expert_groups(torch.zeros(5, 1, dtype=torch.long), 1, block_m=2)
    assert one.tolist() == [[0, 0, 5], [0, 2, 5], [0, 4, 5]]


def test_bad_input_is_named() -> None:
    H, F = 32, 16
    slab, _ = make_slab(2, H, F, torch.float32)
    x, ids, w = torch.randn(3, H), torch.zeros(3, 1, dtype=torch.long), torch.rand(3, 1)
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[E, 2F \+ H\]"):
        grouped_expert_ffn(x, slab, ids, w, H, F, bias=torch.zeros(3, 1, 2 * F + H))
    with pytest.raises(IndexError, match="slot ids must be in"):
        grouped_expert_ffn(x, slab, ids + 2, w, H, F)
    with pytest.raises(ValueError, match="hidden size"):
        grouped_expert_ffn(x[:, :8], slab, ids, w, H, F)
    assert grouped_expert_ffn(x[:0], slab, ids[:0], w[:0], H, F).shape == (0, H)


def test_stores_stay_inside_the_buffers() -> None:
    """The kernels' stores are masked: buffers followed by sentinels (a partial last tile,
    F and H not multiples of the blocks) keep their sentinels; the pairs' rows are written."""
    from psr_kernels.grouped_ffn import _launch

    H, F, T, k = 40, 24, GROUP_M + 3, 2
    slab, _ = make_slab(3, H, F, torch.float32)
    ids, w = _routes(T, k, 3, seed=6)
    x = torch.randn(T, H)
    order, tiles = expert_groups(ids, 3)
    n, pad = T * k, 2 * GROUP_M
    hbuf = torch.full(((n + pad) * F,), float("nan"))
    ybuf = torch.full(((n + pad) * H,), float("nan"))
    h, y = hbuf[: n * F].view(n, F), ybuf[: n * H].view(n, H)
    lay = pk.RowFormat.of_kernel("test", None).layout(H, F)
    _launch(lay, x, slab, order, tiles, w, y, h, None, pk.SILU, None, False)
    assert hbuf[n * F :].isnan().all() and ybuf[n * H :].isnan().all()
    assert not h.isnan().any() and not y.isnan().any()
    ref = grouped_expert_ffn_ref(x, slab, ids, w, H, F)
    _close(y.view(T, k, H).sum(1), ref)


@pytest.mark.gpu
def test_on_cuda_every_format_matches_the_reference_run_after_run() -> None:
    """On a GPU (compiled, TF32 dots for bf16 activations): every row format against the
    reference, the same bits twice, and a token alone as in the batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng, H, F, C, T = np.random.default_rng(8), 256, 256, 4, 3 * GROUP_M + 7
    slabs = {None: make_slab(C, H, F, torch.bfloat16)[0]}
    mats = make_slab(C, H, F, torch.float32)[1]
    slabs |= {q: torch.stack([pk.quantize_expert(*m, q) for m in mats]) for q in pk.QUANT_FORMATS}
    for types in MIXES:
        rows = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(C)])
        slabs[ggml.ggml_format(*types)] = rows
    ids, w = _routes(T, 2, C - 1, seed=9)
    for fmt, slab in slabs.items():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(T, H).to("cuda", dtype)
            args = (x, slab.cuda(), ids.cuda(), w.cuda(), H, F)
            y = _check(*args, fmt=fmt)
            assert torch.equal(y, grouped_expert_ffn(*args, fmt=fmt, out_dtype=torch.float32))
            one = grouped_expert_ffn(x[-1:], *args[1:2], ids[-1:].cuda(), w[-1:].cuda(), H, F,
                                     fmt=fmt, out_dtype=torch.float32)  # fmt: skip
            assert torch.equal(one[0], y[-1]), fmt
