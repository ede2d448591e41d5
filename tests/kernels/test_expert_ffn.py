"""psr_kernels.expert_ffn against its reference and a per-expert SwiGLU."""

from __future__ import annotations

import pytest
import torch

import psr_kernels as pk

# (dtype, atol, rtol) against the experts computed one by one in fp32 from the stored
# (rounded) weights. Kernel vs reference is checked tighter, at fp32 level, for all dtypes.
DTYPE_TOLS = [
    (torch.float32, 1e-4, 1e-5),
    (torch.bfloat16, 2e-2, 2e-2),
    (torch.float16, 2e-3, 2e-3),
]


def make_slab(C: int, H: int, F: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    experts = [
        (
            torch.randn(F, H, generator=gen) / H**0.5,
            torch.randn(F, H, generator=gen) / H**0.5,
            torch.randn(H, F, generator=gen) / F**0.5,
        )
        for _ in range(C)
    ]
    slab = torch.stack([pk.pack_expert(*e) for e in experts]).to(dtype)
    return slab, [tuple(m.to(dtype) for m in e) for e in experts]


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
@pytest.mark.parametrize(
    ("T", "k", "H", "F"),
    [(1, 1, 64, 32), (3, 2, 72, 48), (1, 8, 100, 40), (1, 3, 130, 96)],
)
def test_expert_ffn_matches_reference(T, k, H, F, dtype, atol, rtol) -> None:
    C = max(k, 5)
    slab, experts = make_slab(C, H, F, dtype, seed=H)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(T, H, generator=gen).to(dtype)
    slots = torch.stack([torch.randperm(C, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    y = pk.expert_ffn(x, slab, slots, weights, H, F, out_dtype=torch.float32)
    y_ref = pk.expert_ffn_ref(x, slab, slots, weights, H, F, out_dtype=torch.float32)
    assert y.shape == y_ref.shape == (T, H) and y.is_contiguous() and y_ref.is_contiguous()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-4 * y_ref.abs().max().item())
    # ... and against the experts computed one by one, as HF's MLP does (fp32 math).
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            g, u, d = (m.float() for m in experts[int(slots[t, j])])
            h = torch.nn.functional.silu(g @ x[t].float()) * (u @ x[t].float())
            want[t] += weights[t, j] * (d @ h)
    torch.testing.assert_close(y, want, rtol=rtol, atol=atol)
    # Output dtype follows x by default.
    assert pk.expert_ffn(x, slab, slots, weights, H, F).dtype == dtype
    assert pk.expert_ffn_ref(x, slab, slots, weights, H, F).dtype == dtype


def test_expert_ffn_reads_slots_through_a_view_and_is_deterministic() -> None:
    H, F = 48, 16
    big, _ = make_slab(6, H, F, torch.float32)
    slab = big[1:5]  # a view with an offset, as a store's slab slice would be
    x = torch.randn(1, H)
    slots = torch.tensor([[3, 0]], dtype=torch.int32)
    w = torch.tensor([[0.7, 0.3]])
    y1 = pk.expert_ffn(x, slab, slots, w, H, F)
    y2 = pk.expert_ffn(x, slab, slots, w, H, F)
    assert torch.equal(y1, y2)
    torch.testing.assert_close(y1, pk.expert_ffn_ref(x, big, slots + 1, w, H, F))


def test_expert_ffn_bad_input() -> None:
    H, F = 32, 16
    slab, _ = make_slab(4, H, F, torch.float32)
    x = torch.randn(1, H)
    slots = torch.tensor([[0, 1]])
    w = torch.rand(1, 2)
    for fn in (pk.expert_ffn, pk.expert_ffn_ref):
        with pytest.raises(IndexError, match=r"slot ids must be in \[0, 4\)"):
            fn(x, slab, torch.tensor([[0, 4]]), w, H, F)
        with pytest.raises(ValueError, match="x has hidden size 32, expected 31"):
            fn(x, slab, slots, w, 31, F)
        with pytest.raises(ValueError, match="slab rows hold 1536 elements, expected"):
            fn(x, slab, slots, w, H, F + 1)
        with pytest.raises(ValueError, match="weights \\[1, 3\\] and slots \\[1, 2\\] differ"):
            fn(x, slab, slots, torch.rand(1, 3), H, F)
        with pytest.raises(TypeError, match="slots must be an int32/int64 tensor"):
            fn(x, slab, slots.float(), w, H, F)
        with pytest.raises(ValueError, match="slots must be \\[T=1, k\\]"):
            fn(x, slab, slots[0], w, H, F)
        with pytest.raises(ValueError, match="slab rows must be contiguous"):
            fn(x, slab.t().contiguous().t(), slots, w, H, F)
    with pytest.raises(ValueError, match="pack_expert: expected"):
        pk.pack_expert(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_expert_views_what_pack_expert_packed(dtype) -> None:
    H, F = 6, 5  # odd, unequal: a swapped H/F or gate/up would show
    slab, experts = make_slab(4, H, F, dtype)
    # One row: three views into it, no copies.
    row = slab[2]
    gate, up, down = pk.unpack_expert(row, H, F)
    assert (gate.shape, up.shape, down.shape) == ((F, H), (F, H), (H, F))
    base = slab.untyped_storage().data_ptr()
    assert all(m.untyped_storage().data_ptr() == base for m in (gate, up, down))
    for got, want in zip((gate, up, down), experts[2], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(pk.pack_expert(gate, up, down), row)
    # A batch of rows, e.g. slab[slots] for prefill: batch dims stay in front.
    slots = torch.tensor([[3, 0], [1, 1], [2, 3]])
    g, u, d = pk.unpack_expert(slab[slots], H, F)
    assert (g.shape, u.shape, d.shape) == ((3, 2, F, H), (3, 2, F, H), (3, 2, H, F))
    for t in range(3):
        for j in range(2):
            e = experts[int(slots[t, j])]
            assert torch.equal(g[t, j], e[0]) and torch.equal(u[t, j], e[1])
            assert torch.equal(d[t, j], e[2])
    # The whole slab at once.
    g, _, d = pk.unpack_expert(slab, H, F)
    assert g.shape == (4, F, H) and torch.equal(d[1], experts[1][2])
    with pytest.raises(ValueError, match=r"rows hold 90 elements, expected 3 \* H \* F = 108"):
        pk.unpack_expert(row, H, F + 1)
