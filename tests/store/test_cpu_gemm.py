"""The tiled GEMM of GGML rows (csrc/cpu/expert_gemv_avx512.cpp `ggml_gemm`: each row's blocks
decoded once per tile of tokens, 4 rows x 4 tokens a step), through `cpu_linear` and the
prefill form of `cpu_expert_ffn` (an expert's tokens as one GEMM, the down projection by
expert): every output row bit-identical to the same token computed alone (T = 1, the row
dots), on every ISA path and thread count, over odd shapes (T = 1, 3, 17, 64, 70; rows not a
multiple of 4 or of a work item; Q8_0 rows of an odd block count), and close to the
dequantized twin."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_blocks import expert_rows, gguf_dequant, random_blocks

import psr_kernels as pk
from psr import store

# The fp32-activation path's references (the q8 path's: test_cpu_qdot.py).
pytestmark = pytest.mark.usefixtures("f32_dots")

ISAS = store.cpu_isas()
THREADS = sorted({1, min(2, store.cpu_max_threads())})
TILED = ["Q4_K", "Q5_K", "Q6_K", "Q8_0"]  # the block types the GEMM tiles (g_several_inputs)


@pytest.mark.parametrize("t", TILED)
def test_linear_rows_equal_their_single_token_rows(t) -> None:
    rng = np.random.default_rng(11)
    N, K = 67, 544 if t == "Q8_0" else 768  # 17 Q8_0 blocks (odd: the parity classes uneven)
    raw = random_blocks(t, N, K, rng)
    weight = torch.from_numpy(np.ascontiguousarray(raw)).reshape(N, -1)
    twin = gguf_dequant(raw, t, (N, K))
    g = torch.Generator().manual_seed(12)
    x, bias = torch.randn(70, K, generator=g), torch.randn(N, generator=g)
    kw = dict(ggml_type=pk.ggml_type_id(t), in_features=K, bias=bias)
    for isa in ISAS:
        alone = torch.cat(
            [store.cpu_linear(x[i : i + 1], weight, isa=isa, threads=1, **kw) for i in range(70)]
        )
        for T in (1, 3, 17, 64, 70):
            for threads in THREADS:
                y = store.cpu_linear(x[:T], weight, isa=isa, threads=threads, **kw)
                assert torch.equal(y, alone[:T]), (isa, T, threads)
    ref = x.double() @ twin.double().T + bias.double()
    bound = (x.abs() @ twin.abs().T).double() * 1e-5 + 1e-30
    assert bool(((alone.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize(
    "types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q5_K", "Q6_K", "Q4_K")]
)
def test_expert_ffn_rows_equal_their_single_token_rows(types) -> None:
    """40 tokens over 3 experts, top-2: each expert has >= 8 tokens (the tiled gate/up GEMM
    and the down projection by expert), one expert absent from a token's pair (a slot
    table's -1): every token's row as when computed alone, and close to the reference."""
    rng = np.random.default_rng(13)
    H, F = 256, 512  # K-quant rows: whole super-blocks
    if types[2] == "Q8_0":
        H, F = 288, 352  # Q8_0 rows of 9 / 11 blocks; rows not a multiple of 64
    slab = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(3)])
    fmt = pk.ggml_format(*types)
    g = torch.Generator().manual_seed(14)
    T = 40
    x, w = torch.randn(T, H, generator=g), torch.rand(T, 2, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])  # expert 3: absent
    table = torch.tensor([2, 0, 1, -1], dtype=torch.int32)
    kw = dict(fmt=fmt, slot_table=table, skip_absent=True)
    slots = table[ids].clamp(min=0)
    keep = (table[ids] >= 0).float()
    ref = pk.expert_ffn_ref(x, slab, slots, w * keep, H, F, fmt=fmt)
    for isa in ISAS:
        alone = torch.cat(
            [
                store.cpu_expert_ffn(
                    x[t : t + 1], slab, ids[t : t + 1], w[t : t + 1], H, F, isa=isa, threads=1, **kw
                )
                for t in range(T)
            ]
        )
        for n in (3, 17, T):
            for threads in THREADS:
                y = store.cpu_expert_ffn(
                    x[:n], slab, ids[:n], w[:n], H, F, isa=isa, threads=threads, **kw
                )
                assert torch.equal(y, alone[:n]), (isa, n, threads)
        torch.testing.assert_close(alone, ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()))


def test_expert_ffn_of_a_long_prompt_equals_its_pieces() -> None:
    """600 tokens (the down projection by expert in passes of 512 tokens) against the same
    tokens in calls of 40: the same bits, on one and two threads."""
    rng = np.random.default_rng(15)
    H, F, T = 256, 256, 600
    types = ("Q4_K", "Q4_K", "Q6_K")
    slab = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(4)])
    fmt = pk.ggml_format(*types)
    g = torch.Generator().manual_seed(16)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, 2, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])
    pieces = torch.cat(
        [
            store.cpu_expert_ffn(x[i : i + 40], slab, ids[i : i + 40], w[i : i + 40], H, F, fmt=fmt)
            for i in range(0, T, 40)
        ]
    )
    for threads in THREADS:
        y = store.cpu_expert_ffn(x, slab, ids, w, H, F, fmt=fmt, threads=threads)
        assert torch.equal(y, pieces), threads
    ref = pk.expert_ffn_ref(x[:20], slab, ids[:20], w[:20], H, F, fmt=fmt)
    torch.testing.assert_close(y[:20], ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()))
