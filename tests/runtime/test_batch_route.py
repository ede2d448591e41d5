"""A batched decode step routes and predicts all its rows in one call on the torch path
(runtime/batch.py): each row's results must equal that row's own call, bit for bit, as
the solo host step makes it (so each sequence's routing stays its solo routing)."""

from __future__ import annotations

import pytest
import torch

import psr_kernels as pk

SPECS = {
    "softmax": pk.RouteSpec(8, lam=0.7),
    "softmax-renorm": pk.RouteSpec(4, lam=1.3, renormalize=True, scaling=2.0),
    "sigmoid-grouped": pk.RouteSpec(
        6, lam=0.5, scoring="sigmoid", renormalize=True, n_group=8, topk_group=4, scaling=2.5
    ),
    "sparsemixer": pk.RouteSpec(2, lam=0.4, scoring="sparsemixer", mixer_eps=0.01),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("b", [2, 3, 8])
def test_route_counted_rows_equal_one_row_calls(name: str, b: int) -> None:
    spec = SPECS[name]
    E = 64
    g = torch.Generator().manual_seed(b)
    logits = torch.randn(b, E, generator=g)
    logits[1, 5] = logits[1, 9]  # a tie: to the lower id in both
    mask = torch.rand(b, E, generator=g) < 0.3
    bias = torch.randn(E, generator=g) * 0.1 if spec.scoring == "sigmoid" else None
    w, ids, sub = pk.route_counted_ref(logits, spec, mask=mask, bias=bias)
    for r in range(b):
        w1, ids1, sub1 = pk.route_counted_ref(
            logits[r : r + 1].clone(), spec, mask=mask[r].clone(), bias=bias
        )
        assert torch.equal(ids[r : r + 1], ids1)
        assert torch.equal(w[r : r + 1], w1)
        assert torch.equal(sub[r : r + 1], sub1)
    assert int(sub.sum()) > 0  # the bias moved some choice: the masks were used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("H", "E", "spec"), [
    (128, 64, pk.RouteSpec(8)),
    (2048, 128, pk.RouteSpec(8)),
    (256, 64, pk.RouteSpec(6, scoring="sigmoid", n_group=8, topk_group=4)),
])  # fmt: skip
def test_predict_next_rows_equal_one_row_calls(dtype, H: int, E: int, spec) -> None:
    g = torch.Generator().manual_seed(H)
    b = 5
    residual = (torch.randn(b, H, generator=g) * 3).to(dtype)
    norm = (torch.rand(H, generator=g) + 0.5).to(dtype)
    gate = (torch.randn(E, H, generator=g) / H**0.5).to(dtype)
    gate_bias = torch.randn(E, generator=g).to(dtype) * 0.1
    bias = torch.randn(E, generator=g) * 0.1 if spec.scoring == "sigmoid" else None
    kw = dict(eps=1e-6, bias=bias, gate_bias=gate_bias)
    ids, incache = pk.predict_next_ref(residual, norm, gate, 4, spec, rows=True, **kw)
    assert ids.shape == (b, 4) and not incache.any()
    for r in range(b):
        one, _ = pk.predict_next_ref(residual[r : r + 1].clone(), norm, gate, 4, spec, **kw)
        assert torch.equal(ids[r : r + 1], one)
    zero, _ = pk.predict_next_ref(residual, norm, gate, 0, spec, rows=True, **kw)
    assert zero.shape == (b, 0)


def test_predict_next_rows_refuses_what_the_single_call_refuses() -> None:
    residual = torch.randn(2, 16)
    residual[1, 3] = float("nan")
    with pytest.raises(pk.NonFiniteError):
        pk.predict_next_ref(
            residual, torch.ones(16), torch.randn(8, 16), 2, pk.RouteSpec(2), rows=True
        )
    with pytest.raises(ValueError, match="norm_weight"):
        pk.predict_next_ref(
            torch.randn(2, 16), torch.ones(15), torch.randn(8, 16), 2, pk.RouteSpec(2), rows=True
        )
