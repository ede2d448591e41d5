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


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [None, "bf16 rows", "int8"])
def test_expert_row_ffn_ref_computes_as_the_models_mlp_bit_for_bit(fmt, x_dtype) -> None:
    """Float rows of x's dtype compute in that dtype as HF's MLP does (`F.linear`);
    other float rows and quantized rows in fp32, as the kernels: bit for bit."""
    H, F = 48, 40
    lin, silu = torch.nn.functional.linear, torch.nn.functional.silu
    row_dtype = torch.bfloat16 if fmt == "bf16 rows" else x_dtype
    slab, experts = make_slab(2, H, F, row_dtype, seed=4)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1)).to(x_dtype)
    if fmt == "int8":
        row = pk.quantize_expert(*experts[1], "int8")
        y = pk.expert_row_ffn_ref(x, row, H, F, fmt="int8")
        g, u, d = pk.dequantize_expert(row, H, F, "int8")
    else:
        y = pk.expert_row_ffn_ref(x, slab[1], H, F)
        g, u, d = experts[1]
    if fmt != "int8" and row_dtype == x_dtype:
        want = lin(silu(lin(x, g)) * lin(x, u), d)
    else:
        xf, g, u, d = x.float(), g.float(), u.float(), d.float()
        want = lin(silu(lin(xf, g)) * lin(xf, u), d).to(x_dtype)
    assert y.dtype == x_dtype and torch.equal(y, want)
    # The slab reference is the same formula over routed rows, summed with the weights.
    slots, w = torch.tensor([[1]] * 5), torch.ones(5, 1)
    if fmt != "int8":
        ref = pk.expert_ffn_ref(x, slab, slots, w, H, F, out_dtype=torch.float32)
        torch.testing.assert_close(ref, y.float(), rtol=2e-2, atol=2e-2)


def test_swiglu_ref_broadcasts_over_experts() -> None:
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(3, 6, 4, generator=gen), torch.randn(3, 6, 4, generator=gen)
    down, x = torch.randn(3, 4, 6, generator=gen), torch.randn(2, 4, generator=gen)
    y = pk.swiglu_ref(x, gate, up, down)  # three experts over the same two tokens
    assert y.shape == (3, 2, 4) and y.dtype == torch.float32
    for e in range(3):
        h = torch.nn.functional.silu(x @ gate[e].t()) * (x @ up[e].t())
        torch.testing.assert_close(y[e], h @ down[e].t())
    assert pk.swiglu_ref(x, gate, up, down, torch.float64).dtype == torch.float64


def test_launch_config_is_computed_once_per_shape() -> None:
    from psr_kernels.expert_ffn import ffn_launch_config

    H, F = 48, 16
    slab, _ = make_slab(4, H, F, torch.float32)
    slots, w = torch.tensor([[3, 0]]), torch.tensor([[0.7, 0.3]])
    ffn_launch_config.cache_clear()
    for _ in range(3):
        pk.expert_ffn(torch.randn(1, H), slab, slots, w, H, F)
    info = ffn_launch_config.cache_info()
    assert (info.misses, info.hits) == (1, 2)
    gate_up, _ = ffn_launch_config(1, H, F)
    with pytest.raises(TypeError):  # read-only: shared by every launch of the shape
        gate_up["BLOCK_F"] = 1  # type: ignore[index]


@pytest.mark.parametrize("fmt", [None, "int8", "int4"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_slot_table_reads_the_same_experts_as_their_slots(fmt, w_dtype) -> None:
    """With the device slot map (`slot_table`), routed expert ids go straight in: the result
    is bit-identical to passing table[ids] as slots, in kernel and reference, and bf16
    gate weights are widened exactly as `.float()` would."""
    H, F, C, E, k = 64, 32, 4, 12, 3
    slab, experts = make_slab(C, H, F, torch.float32, seed=3)
    if fmt is not None:
        slab = torch.stack([pk.quantize_expert(*e, fmt, group_size=32) for e in experts])
    gen = torch.Generator().manual_seed(1)
    table = torch.full((E,), -1, dtype=torch.int32)
    members = torch.randperm(E, generator=gen)[:C]
    table[members] = torch.randperm(C, generator=gen).to(torch.int32)
    ids = members[torch.randperm(C, generator=gen)[:k]][None]
    x = torch.randn(1, H, generator=gen)
    w = torch.rand(1, k, generator=gen).to(w_dtype)
    kw = dict(fmt=fmt, group_size=32)
    for f in (pk.expert_ffn, pk.expert_ffn_ref):
        got = f(x, slab, ids, w, H, F, slot_table=table, **kw)
        want = f(x, slab, table[ids].long(), w.float(), H, F, **kw)
        assert torch.equal(got, want), f.__name__
    with pytest.raises(IndexError, match=r"expert ids must be in \[0, 12\)"):
        pk.expert_ffn(x, slab, ids + E, w, H, F, slot_table=table, **kw)
    with pytest.raises(ValueError, match="slot_table must be a contiguous 1-D tensor"):
        pk.expert_ffn(x, slab, ids, w, H, F, slot_table=table[None], **kw)


# --------------------------------------------------------------------------- expert kinds

GPT_OSS = pk.Activation("clamped", alpha=1.702, limit=7.0)


def _gpt_oss_experts(E: int, H: int, F: int, seed: int):
    """transformers' GptOssExperts with random weights and biases, and the same experts as
    psr rows (gate/up de-interleaved and transposed) plus their [E, 2F + H] biases."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from psr.models.families import gpt_oss_expert

    cfg = transformers.GptOssConfig(num_local_experts=E, hidden_size=H, intermediate_size=F)
    ex = GptOssExperts(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.8)  # clamps at +-7 do bite
    rows, biases = [], []
    for e in range(E):
        gate, up, down, bias = gpt_oss_expert(
            ex.gate_up_proj[e], ex.gate_up_proj_bias[e], ex.down_proj[e], ex.down_proj_bias[e]
        )
        rows.append(pk.pack_expert(gate, up, down))
        biases.append(bias)
    return ex, torch.stack(rows).detach(), torch.stack(biases).detach()


@pytest.mark.parametrize("fmt", [None, "int8", "fp8", "int4"])
def test_gpt_oss_experts_match_transformers(fmt) -> None:
    """The clamped SwiGLU with biases (gpt-oss's expert kind): reference and kernels against
    transformers' own GptOssExperts, float rows and every quantized format."""
    E, H, F, T, k = 6, 64, 48, 3, 2
    ex, rows, bias_table = _gpt_oss_experts(E, H, F, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=gen), -1)
    with torch.no_grad():
        hf = ex(x, ids, w)
    assert (ex.gate_up_proj.abs() * 3 > 7).any()  # the inputs reach the clamp
    slab = (
        rows
        if fmt is None
        else torch.stack(
            [pk.quantize_expert(*pk.unpack_expert(r, H, F), fmt, group_size=16) for r in rows]
        )
    )
    bias = bias_table[ids].contiguous()  # [T, k, 2F + H], gathered by the routed ids
    kw = dict(fmt=fmt, group_size=16, act=GPT_OSS, bias=bias)
    ref = pk.expert_ffn_ref(x, slab, ids, w, H, F, **kw)
    got = pk.expert_ffn(x, slab, ids, w, H, F, **kw)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)  # fp32 sums of ~1e2
    if fmt is not None:  # transformers on the dequantized weights (and the same biases)
        from psr.models.families import gpt_oss_module_tensors

        deq = pk.dequantize_expert(slab, H, F, fmt, group_size=16)
        with torch.no_grad():
            for name, t in gpt_oss_module_tensors(*deq, bias_table).items():
                getattr(ex, name).copy_(t)
            hf = ex(x, ids, w)
    torch.testing.assert_close(ref, hf, rtol=1e-5, atol=1e-4)  # sums of ~1e2: fp32 order
    # Without the activation or the biases the result is not transformers'.
    plain = pk.expert_ffn_ref(x, rows, ids, w, H, F, bias=bias)
    assert not torch.allclose(plain, hf, atol=1e-3)


def test_expert_ffn_bias_and_activation_errors() -> None:
    slab, _ = make_slab(4, 32, 16, torch.float32)
    x, slots, w = torch.randn(1, 32), torch.tensor([[0, 1]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[T, k, 2F \+ H\]"):
        pk.expert_ffn_ref(x, slab, slots, w, 32, 16, bias=torch.zeros(1, 2, 63))
    with pytest.raises(TypeError, match="bias must be a float32 tensor"):
        pk.expert_ffn_ref(x, slab, slots, w, 32, 16, bias=torch.zeros(1, 2, 64).half())
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        pk.Activation("gelu")
