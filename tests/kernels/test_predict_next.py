"""psr_kernels.predict_next against its reference and the spec's prefetch rule."""

from __future__ import annotations

import pytest
import torch

import psr_kernels as pk

SOFTMAX = pk.RouteSpec(top_k=1)  # the next layer's router; predict_next ignores its top_k


def setup(T: int, H: int, E: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    residual = (torch.randn(T, H, generator=gen) * 3).to(dtype)
    norm_w = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    gate = (torch.randn(E, H, generator=gen) / H**0.5).to(dtype)
    mask = torch.rand(E, generator=gen) < 0.5
    return residual, norm_w, gate, mask


# Predictions are ids and cache flags, compared exactly: no tolerance. The RMS norm and
# GEMV run in fp32 on the rounded inputs in both the kernel and the reference.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("T", "H", "E", "n"),
    [(1, 100, 64, 1), (3, 72, 60, 2), (5, 130, 8, 8), (1, 2048, 128, 6), (3, 96, 256, 8)],
)
def test_predict_next_matches_reference(T, H, E, n, dtype) -> None:
    residual, norm_w, gate, mask = setup(T, H, E, dtype, seed=n)
    ids, inc = pk.predict_next(residual, norm_w, gate, n, SOFTMAX, mask=mask, eps=1e-5)
    ids2, inc2 = pk.predict_next_ref(residual, norm_w, gate, n, SOFTMAX, mask=mask, eps=1e-5)
    assert ids.shape == inc.shape == ids2.shape == inc2.shape == (T, n)
    assert inc.dtype == inc2.dtype == torch.bool and ids.dtype == ids2.dtype == torch.int64
    assert all(t.is_contiguous() for t in (ids, inc, ids2, inc2))
    assert torch.equal(ids, ids2)
    assert torch.equal(inc, inc2)
    assert torch.equal(inc, mask[ids])


def test_prediction_is_the_next_routers_exact_order_on_the_normed_state() -> None:
    residual, norm_w, gate, mask = setup(3, 100, 32)
    ids, _ = pk.predict_next(residual, norm_w, gate, 4, SOFTMAX, mask=mask)
    # The spec: first n ids of the next layer's own (unbiased) routing of the normed state.
    normed = pk.rms_norm_ref(residual, norm_w, 1e-6)
    _, want = pk.route_ref(normed @ gate.t(), pk.RouteSpec(4))
    assert torch.equal(ids, want)
    # The mask only reports membership; it never biases the prediction, nor does the
    # spec's lam (or its top_k, renormalize, scaling).
    all_cached = torch.ones(32, dtype=bool)
    ids_all, inc_all = pk.predict_next(residual, norm_w, gate, 4, SOFTMAX, mask=all_cached)
    assert torch.equal(ids_all, ids) and bool(inc_all.all())
    other = pk.RouteSpec(7, lam=0.9, renormalize=True, scaling=3.0)
    for fn in (pk.predict_next, pk.predict_next_ref):
        assert torch.equal(fn(residual, norm_w, gate, 4, other, mask=mask)[0], ids)
    _, inc_none = pk.predict_next(residual, norm_w, gate, 4, SOFTMAX)
    assert not bool(inc_none.any())


def test_group_limited_prediction() -> None:
    residual, norm_w, gate, mask = setup(3, 64, 64, seed=3)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 0.05
    spec = pk.RouteSpec(8, scoring="sigmoid", n_group=8, topk_group=2)
    ids, inc = pk.predict_next(residual, norm_w, gate, 3, spec, mask=mask, bias=bias)
    ids2, inc2 = pk.predict_next_ref(residual, norm_w, gate, 3, spec, mask=mask, bias=bias)
    assert torch.equal(ids, ids2) and torch.equal(inc, inc2)
    assert all(len(set((r // 8).tolist())) <= 2 for r in ids)


def test_n_zero_predicts_nothing() -> None:
    residual, norm_w, gate, mask = setup(3, 40, 8)
    for fn in (pk.predict_next, pk.predict_next_ref):
        ids, inc = fn(residual, norm_w, gate, 0, SOFTMAX, mask=mask)
        assert ids.shape == (3, 0) and inc.shape == (3, 0)


def test_predict_next_bad_input() -> None:
    residual, norm_w, gate, mask = setup(2, 40, 8)
    for fn in (pk.predict_next, pk.predict_next_ref):
        with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
            fn(residual, norm_w, gate, -1, SOFTMAX)
        with pytest.raises(ValueError, match=r"n=9 must be in \[1, num_experts=8\]"):
            fn(residual, norm_w, gate, 9, SOFTMAX)
        with pytest.raises(ValueError, match="norm_weight has 39 elements, hidden size is 40"):
            fn(residual, norm_w[:39], gate, 2, SOFTMAX)
        with pytest.raises(ValueError, match="gate_weight is"):
            fn(residual, norm_w, gate[:, :39], 2, SOFTMAX)
        with pytest.raises(ValueError, match="mask must have shape"):
            fn(residual, norm_w, gate, 2, SOFTMAX, mask=mask[:7])
        with pytest.raises(ValueError, match="unknown scoring 'softplus'"):
            fn(residual, norm_w, gate, 2, pk.RouteSpec(2, scoring="softplus"))
        with pytest.raises(TypeError, match=r"spec must be a psr_kernels\.RouteSpec .*, got str"):
            fn(residual, norm_w, gate, 2, "softmax")
        bad = residual.clone()
        bad[0, 0] = float("nan")
        with pytest.raises(ValueError, match="residual contains NaN"):
            fn(bad, norm_w, gate, 2, SOFTMAX)


def test_per_token_mask_and_int32_ids() -> None:
    residual, norm_w, gate, _ = setup(3, 40, 16, seed=4)
    mask = torch.rand(3, 16, generator=torch.Generator().manual_seed(2)) < 0.5
    kw = dict(mask=mask, ids_dtype=torch.int32)
    ids, inc = pk.predict_next(residual, norm_w, gate, 3, SOFTMAX, **kw)
    ids2, inc2 = pk.predict_next_ref(residual, norm_w, gate, 3, SOFTMAX, **kw)
    assert ids.dtype == ids2.dtype == torch.int32
    assert torch.equal(ids, ids2) and torch.equal(inc, inc2)
    assert torch.equal(inc, mask.gather(1, ids.long()))
