"""psr_kernels.route / route_hidden against their torch references and the models' routers."""

from __future__ import annotations

import pytest
import torch

import psr_kernels as pk

# (dtype, atol, rtol) for the gate weights. The kernel and the reference both compute
# in fp32 from the same rounded 16-bit inputs, so the tolerance does not grow with them.
DTYPE_TOLS = [
    (torch.float32, 1e-6, 1e-5),
    (torch.bfloat16, 1e-6, 1e-5),
    (torch.float16, 1e-6, 1e-5),
]

# (T, E, k, scoring, lam, per-token mask, renormalize): odd sizes, E below and above the
# 16-wide minimum tile, k == E, and T past one 16-row program.
ROUTE_CASES = [
    (1, 8, 1, "softmax", 0.0, True, False),
    (3, 60, 6, "topk_softmax", 0.2, False, True),
    (16, 64, 8, "softmax", 0.5, True, True),
    (5, 128, 2, "softmax", 0.2, False, False),
    (3, 256, 8, "topk_softmax", 0.5, True, False),
    (1, 72, 6, "softmax", 0.3, False, True),
    (7, 8, 8, "softmax", 0.5, True, True),
    (17, 60, 1, "topk_softmax", 0.7, False, False),
]


def rand_mask(T: int, E: int, gen: torch.Generator, per_token: bool) -> torch.Tensor:
    shape = (T, E) if per_token else (E,)
    return torch.rand(shape, generator=gen) < 0.5


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
@pytest.mark.parametrize(("T", "E", "k", "scoring", "lam", "per_token", "renorm"), ROUTE_CASES)
def test_route_matches_reference(T, E, k, scoring, lam, per_token, renorm, dtype, atol, rtol):
    gen = torch.Generator().manual_seed(T * 1000 + E * 10 + k)
    logits = (torch.randn(T, E, generator=gen) * 2).to(dtype)
    mask = rand_mask(T, E, gen, per_token=per_token)
    spec = pk.RouteSpec(k, lam, scoring, renorm)
    w, ids = pk.route(logits, spec, mask=mask)
    w_ref, ids_ref = pk.route_ref(logits, spec, mask=mask)
    for t in (w, ids, w_ref, ids_ref):
        assert t.shape == (T, k) and t.is_contiguous()
    assert ids.dtype == ids_ref.dtype == torch.int64
    assert w.dtype == w_ref.dtype == torch.float32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=rtol, atol=atol)


def test_route_int32_ids() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 60, generator=gen)
    mask = rand_mask(3, 60, gen, per_token=True)
    spec = pk.RouteSpec(6, lam=0.3)
    w, ids = pk.route(logits, spec, mask=mask, ids_dtype=torch.int32)
    w_ref, ids_ref = pk.route_ref(logits, spec, mask=mask, ids_dtype=torch.int32)
    assert ids.dtype == ids_ref.dtype == torch.int32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
@pytest.mark.parametrize(
    ("E", "k", "n_group", "topk_group", "T"),
    [(64, 6, 8, 3, 3), (256, 8, 8, 4, 1), (60, 2, 6, 2, 17), (8, 2, 4, 2, 3)],
)
def test_route_sigmoid_group_limited_matches_reference(
    E, k, n_group, topk_group, T, dtype, atol, rtol
) -> None:
    gen = torch.Generator().manual_seed(E + k)
    logits = torch.randn(T, E, generator=gen).to(dtype)
    bias = (torch.randn(E, generator=gen) * 0.05).to(dtype)
    mask = rand_mask(T, E, gen, per_token=False)
    for lam in (0.0, 0.3):
        spec = pk.RouteSpec(k, lam, "sigmoid", True, n_group, topk_group, scaling=2.5)
        w, ids = pk.route(logits, spec, mask=mask, bias=bias)
        w_ref, ids_ref = pk.route_ref(logits, spec, mask=mask, bias=bias)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=rtol, atol=atol)
        # Every chosen expert lies in one of topk_group groups.
        groups = ids // (E // n_group)
        assert all(len(set(r.tolist())) <= topk_group for r in groups)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
@pytest.mark.parametrize(
    ("E", "k", "n_group", "topk_group", "T"), [(64, 6, 8, 3, 3), (60, 2, 6, 2, 5), (8, 2, 4, 2, 3)]
)
def test_route_softmax_group_max_matches_reference(
    E, k, n_group, topk_group, T, dtype, atol, rtol
) -> None:
    """DeepSeek-V2's group_limited_greedy: softmax scores, groups ranked by their maximum."""
    gen = torch.Generator().manual_seed(E + 3 * k)
    logits = torch.randn(T, E, generator=gen).to(dtype)
    mask = rand_mask(T, E, gen, per_token=True)
    for lam in (0.0, 0.3):
        spec = pk.RouteSpec(
            k, lam, "softmax", False, n_group, topk_group, scaling=1.5, group_score="max"
        )
        w, ids = pk.route(logits, spec, mask=mask)
        w_ref, ids_ref = pk.route_ref(logits, spec, mask=mask)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=rtol, atol=atol)
        groups = ids // (E // n_group)
        assert all(len(set(r.tolist())) <= topk_group for r in groups)
    # The maximum and the top-2 sum rank groups differently on some rows.
    top2 = pk.RouteSpec(k, 0.0, "softmax", False, n_group, topk_group, group_score="top2")
    one = pk.RouteSpec(k, 0.0, "softmax", False, n_group, topk_group, group_score="max")
    x = torch.randn(64, E, generator=gen)
    assert not torch.equal(pk.route_ref(x, top2)[1], pk.route_ref(x, one)[1])


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
@pytest.mark.parametrize(("E", "k", "T", "norm_min"), [(8, 2, 3, 1e-12), (60, 6, 4, 0.5)])
def test_route_softmax_with_correction_bias_matches_reference(
    E, k, T, norm_min, dtype, atol, rtol
) -> None:
    """ERNIE: selection on softmax probabilities + the correction bias, weights from the
    probabilities renormalised by max(sum, moe_norm_min)."""
    gen = torch.Generator().manual_seed(E * k)
    logits = torch.randn(T, E, generator=gen).to(dtype)
    bias = (torch.randn(E, generator=gen) * 0.1).to(dtype)
    mask = rand_mask(T, E, gen, per_token=False)
    for lam in (0.0, 0.4):
        spec = pk.RouteSpec(k, lam, "softmax", True, norm_min=norm_min)
        w, ids = pk.route(logits, spec, mask=mask, bias=bias)
        w_ref, ids_ref = pk.route_ref(logits, spec, mask=mask, bias=bias)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=rtol, atol=atol)
    # The bias moves the selection; a floor above the sum scales the weights down.
    p = torch.softmax(logits.float(), -1)
    exact = pk.route_ref(
        logits, pk.RouteSpec(k, 0.0, "softmax", True, norm_min=norm_min), bias=bias
    )
    sel = torch.sort(p + bias.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(exact[1], sel)
    chosen = p.gather(1, sel)
    want = chosen / chosen.sum(-1, keepdim=True).clamp(min=norm_min)
    torch.testing.assert_close(exact[0], want, rtol=1e-6, atol=1e-7)


def _hf_router(kind: str, E: int, k: int, H: int, **extra):
    transformers = pytest.importorskip("transformers")
    if kind == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter as R

        cfg = transformers.OlmoeConfig(num_experts=E, num_experts_per_tok=k, hidden_size=H, **extra)
    elif kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as R

        cfg = transformers.Qwen3MoeConfig(
            num_experts=E, num_experts_per_tok=k, hidden_size=H, **extra
        )
    elif kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as R

        cfg = transformers.MixtralConfig(num_local_experts=E, num_experts_per_tok=k, hidden_size=H)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as R,
        )

        cfg = transformers.DeepseekV3Config(
            n_routed_experts=E, num_experts_per_tok=k, hidden_size=H, **extra
        )
    router = R(cfg)
    with torch.no_grad():
        torch.nn.init.normal_(router.weight, std=0.3, generator=torch.Generator().manual_seed(1))
        if kind == "deepseek_v3":
            router.e_score_correction_bias.normal_(0, 0.05)
    return router, cfg


@pytest.mark.parametrize(
    ("kind", "extra", "scoring", "renorm"),
    [
        ("olmoe", {"norm_topk_prob": False}, "softmax", False),
        ("qwen3_moe", {"norm_topk_prob": True}, "softmax", True),
        ("mixtral", {}, "softmax", True),
        (
            "deepseek_v3",
            {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
            "sigmoid",
            True,
        ),
    ],
)
def test_lam0_reproduces_the_models_own_routing(kind, extra, scoring, renorm) -> None:
    E, k, H, T = 32, 4, 72, 16
    router, cfg = _hf_router(kind, E, k, H, **extra)
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hf_w, hf_ids = router(hidden)
    spec, bias = pk.RouteSpec(k, scoring=scoring, renormalize=renorm), None
    if kind == "deepseek_v3":
        bias = router.e_score_correction_bias
        spec = pk.RouteSpec(
            k,
            scoring=scoring,
            renormalize=renorm,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            scaling=cfg.routed_scaling_factor,
        )
    mask = torch.zeros(E, dtype=torch.bool)
    mask[::3] = True
    w, ids = pk.route(logits, spec, mask=mask, bias=bias)  # lam = 0: the mask has no effect
    # The fused GEMV variant computes the same logits and routing.
    w2, ids2, logits2 = pk.route_hidden(hidden, router.weight, spec, bias=bias)
    torch.testing.assert_close(logits2, logits.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(w2, w, rtol=1e-5, atol=1e-6)
    if kind == "deepseek_v3":  # HF's top-k there is unsorted: compare as sets
        order, hf_order = ids.sort(dim=1).indices, hf_ids.sort(dim=1).indices
        ids, w = ids.gather(1, order), w.gather(1, order)
        hf_ids, hf_w = hf_ids.gather(1, hf_order), hf_w.gather(1, hf_order)
    assert torch.equal(ids, hf_ids.long())
    torch.testing.assert_close(w, hf_w.float(), rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_id() -> None:
    logits = torch.zeros(3, 8)
    logits[1, [2, 5, 6]] = 1.0
    logits[2] = torch.tensor([0.0, 1, 1, 0, 1, 0, 0, 1])
    _, ids = pk.route(logits, pk.RouteSpec(3))
    assert ids.tolist() == [[0, 1, 2], [2, 5, 6], [1, 2, 4]]
    # Bias ties: after biasing two experts tie exactly; the lower id wins.
    logits = torch.tensor([[0.0, 1.0, 0.5, 2.0]])
    mask = torch.tensor([False, False, True, False])
    # D = 2, lam = 0.25: expert 2 -> 0.5 + 0.5 = 1.0 == expert 1
    _, ids = pk.route(logits, pk.RouteSpec(2, lam=0.25), mask=mask)
    _, ids_ref = pk.route_ref(logits, pk.RouteSpec(2, lam=0.25), mask=mask)
    assert ids.tolist() == ids_ref.tolist() == [[3, 1]]


def test_all_cached_and_none_cached_masks_leave_routing_exact() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 64, generator=gen)
    _, exact = pk.route(logits, pk.RouteSpec(8))
    for m in (torch.ones(64, dtype=torch.bool), torch.zeros(64, dtype=torch.bool)):
        _, ids = pk.route(logits, pk.RouteSpec(8, lam=0.7), mask=m)
        assert torch.equal(ids, exact)


def test_large_lam_picks_only_cached_experts() -> None:
    gen = torch.Generator().manual_seed(6)
    T, E, k = 16, 60, 6
    logits = torch.randn(T, E, generator=gen)
    mask = rand_mask(T, E, gen, per_token=True)
    mask[:, :k] = True  # at least k cached per row
    w, ids = pk.route(logits, pk.RouteSpec(k, lam=1.01), mask=mask)
    assert bool(mask.gather(1, ids).all())
    # ... and among them, the model's own order: top-k of the logits restricted to the cache.
    restricted = logits.masked_fill(~mask, float("-inf"))
    _, want = pk.route_ref(restricted, pk.RouteSpec(k), check_finite=False)
    assert torch.equal(ids, want)
    # Gate weights still come from the unbiased softmax over all experts.
    torch.testing.assert_close(w, torch.softmax(logits, -1).gather(1, ids))
    # Some lam < 1 does let a strong uncached expert through.
    _, ids_small = pk.route(logits, pk.RouteSpec(k, lam=0.05), mask=mask)
    assert not bool(mask.gather(1, ids_small).all())


def test_non_contiguous_logits_and_broadcast_mask() -> None:
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(60, 5, generator=gen)
    logits = base.t()  # [5, 60], strides (1, 5)
    mask = rand_mask(1, 60, gen, per_token=True)  # [1, E] broadcasts over tokens
    spec = pk.RouteSpec(6, lam=0.3)
    w, ids = pk.route(logits, spec, mask=mask)
    w2, ids2 = pk.route(logits.contiguous(), spec, mask=mask[0])
    assert torch.equal(ids, ids2) and torch.equal(w, w2)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
@pytest.mark.parametrize(("T", "H", "scoring"), [(5, 100, "softmax"), (1, 2048, "topk_softmax")])
def test_route_hidden_matches_reference(T, H, scoring, dtype, atol, rtol) -> None:
    gen = torch.Generator().manual_seed(H)
    E, k = 60, 6
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    gate = (torch.randn(E, H, generator=gen) / H**0.5).to(dtype)
    mask = rand_mask(T, E, gen, per_token=False)
    spec = pk.RouteSpec(k, lam=0.2, scoring=scoring, renormalize=True)
    w, ids, logits = pk.route_hidden(hidden, gate, spec, mask=mask)
    w2, ids2, logits2 = pk.route_hidden_ref(hidden, gate, spec, mask=mask)
    assert logits.shape == logits2.shape == (T, E) and logits.dtype == torch.float32
    assert logits.is_contiguous() and logits2.is_contiguous()
    # The fp32 GEMV sums in a different order from the reference's matmul.
    torch.testing.assert_close(logits, logits2, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2, rtol=rtol, atol=atol)


def test_empty_batch() -> None:
    for fn in (pk.route, pk.route_ref):
        w, ids = fn(torch.empty(0, 8), pk.RouteSpec(2))
        assert w.shape == ids.shape == (0, 2)
    w, ids, logits = pk.route_hidden(torch.empty(0, 6), torch.randn(8, 6), pk.RouteSpec(2))
    assert w.shape == ids.shape == (0, 2) and logits.shape == (0, 8)


# --- bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"top_k": 9}, ValueError, r"top_k=9 must be in \[1, num_experts=8\]"),
        ({"top_k": 0}, ValueError, "top_k=0"),
        ({"top_k": 2.0}, TypeError, "top_k must be an int"),
        ({"mask": torch.zeros(7, dtype=torch.bool)}, ValueError, r"mask must have shape \[8\]"),
        ({"mask": torch.zeros(2, 8, dtype=torch.bool)}, ValueError, "mask must have shape"),
        ({"mask": torch.zeros(8)}, TypeError, "mask must be a bool tensor, got torch.float32"),
        ({"lam": -0.1}, ValueError, "lam must be a finite number >= 0"),
        ({"lam": float("nan")}, ValueError, "lam must be a finite"),
        ({"scoring": "softplus"}, ValueError, "unknown scoring 'softplus'"),
        (
            {"scoring": "topk_softmax", "bias": torch.zeros(8)},
            ValueError,
            "needs scoring 'sigmoid' or 'softmax'",
        ),
        ({"group_score": "min", "n_group": 2}, ValueError, "unknown group_score 'min'"),
        ({"norm_min": -1.0}, ValueError, "norm_min must be a finite number >= 0"),
        ({"scoring": "sigmoid", "bias": torch.zeros(7)}, ValueError, r"bias must have shape \[8\]"),
        ({"n_group": 3}, ValueError, "n_group=3 must divide num_experts=8"),
        ({"n_group": 4, "topk_group": 5}, ValueError, "topk_group=5"),
        ({"n_group": 8}, ValueError, "at least 2 experts"),
        ({"n_group": 4, "topk_group": 1, "top_k": 3}, ValueError, "exceeds the 2 experts"),
    ],
)
def test_route_bad_arguments(kwargs, exc, match) -> None:
    kwargs = {"top_k": 2} | kwargs
    tensors = {name: kwargs.pop(name) for name in ("mask", "bias") if name in kwargs}
    spec = pk.RouteSpec(**kwargs)
    logits = torch.randn(4, 8)
    hidden, gate = torch.randn(4, 6), torch.randn(8, 6)
    for fn in (pk.route, pk.route_ref):
        with pytest.raises(exc, match=match):
            fn(logits, spec, **tensors)
    for fn in (pk.route_hidden, pk.route_hidden_ref):
        with pytest.raises(exc, match=match):
            fn(hidden, gate, spec, **tensors)


def test_route_needs_a_route_spec() -> None:
    """The old call form, a bare top_k, is a TypeError naming RouteSpec."""
    logits, hidden, gate = torch.randn(2, 8), torch.randn(2, 6), torch.randn(8, 6)
    for fn in (pk.route, pk.route_ref):
        with pytest.raises(TypeError, match=r"route(_ref)?: spec must be a psr_kernels\.RouteSpec"):
            fn(logits, 2)
    for fn in (pk.route_hidden, pk.route_hidden_ref):
        with pytest.raises(TypeError, match=r"spec must be a psr_kernels\.RouteSpec .*, got int"):
            fn(hidden, gate, 2)


def test_route_bad_tensors() -> None:
    spec = pk.RouteSpec(2)
    with pytest.raises(ValueError, match="logits must have 2 dims"):
        pk.route(torch.randn(8), spec)
    with pytest.raises(TypeError, match="logits dtype must be float32"):
        pk.route(torch.ones(2, 8, dtype=torch.int32), spec)
    nan = torch.randn(2, 8)
    nan[1, 3] = float("nan")
    for fn in (pk.route, pk.route_ref):
        with pytest.raises(ValueError, match="logits contains NaN"):
            fn(nan, spec)
    inf = torch.randn(2, 8)
    inf[0, 0] = float("inf")
    with pytest.raises(ValueError, match="logits contains inf"):
        pk.route(inf, spec)
    with pytest.raises(ValueError, match="gate_weight is \\[8, 5\\] but hidden size is 6"):
        pk.route_hidden(torch.randn(2, 6), torch.randn(8, 5), spec)


def test_cpu_tensors_without_interpreter_get_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("PSR_COMPUTE", raising=False)
    with pytest.raises(RuntimeError, match=r"Triton kernels need CUDA tensors.*TRITON_INTERPRET=1"):
        pk.route(torch.randn(2, 8), pk.RouteSpec(2))
    # The torch op takes the reference on CPU.
    x = torch.randn(2, 8)
    w, ids = torch.ops.psr.route(x, 2)
    assert torch.equal(ids, pk.route_ref(x, pk.RouteSpec(2))[1]) and w.shape == (2, 2)


def test_launch_config_is_computed_once_per_shape() -> None:
    from psr_kernels.routing import route_kernel_config, route_launch_config

    route_kernel_config.cache_clear()
    route_launch_config.cache_clear()
    gen = torch.Generator().manual_seed(9)
    spec = pk.RouteSpec(4, lam=0.3)
    mask = torch.rand(40, generator=gen) < 0.5
    for _ in range(3):
        pk.route(torch.randn(3, 40, generator=gen), spec, mask=mask)
    info = route_kernel_config.cache_info()
    assert (info.misses, info.hits) == (1, 2)
    assert route_launch_config.cache_info().misses == 1
    # Another shape, or other flags, is computed once more.
    pk.route(torch.randn(5, 40, generator=gen), spec, mask=mask)
    pk.route(torch.randn(3, 40, generator=gen), spec)
    pk.route(torch.randn(3, 40, generator=gen), spec)
    info = route_kernel_config.cache_info()
    assert (info.misses, info.hits) == (3, 3)
    # The cached configurations are read-only: no caller can change another's launch.
    cfg = route_kernel_config(spec, num_tokens=3, num_experts=40, has_mask=True)
    with pytest.raises(TypeError):
        cfg["BLOCK_T"] = 1  # type: ignore[index]


@pytest.mark.parametrize(("E", "T", "eps"), [(8, 5, 0.3), (16, 3, 0.01), (60, 2, 0.1)])
def test_sparsemixer_matches_phimoe_and_its_reference(E, T, eps) -> None:
    """PhiMoE's router: at lam 0, transformers' own `sparsemixer` (eval); biased, the
    kernel equals the reference, and the weights of a substituted pick follow the same
    threshold rule around the picked logit."""
    pytest.importorskip("transformers")
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    gen = torch.Generator().manual_seed(E + T)
    logits = torch.randn(T, E, generator=gen) * 2
    hf_w, hf_ids = sparsemixer(logits, jitter_eps=eps, training=False, top_k=2)
    spec = pk.RouteSpec(2, scoring="sparsemixer", mixer_eps=eps)
    for fn in (pk.route, pk.route_ref):
        w, ids = fn(logits, spec)
        assert torch.equal(ids, hf_ids.long())
        torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-7)
    mask = rand_mask(T, E, gen, per_token=True)
    biased = pk.RouteSpec(2, lam=0.5, scoring="sparsemixer", mixer_eps=eps)
    w, ids = pk.route(logits, biased, mask=mask)
    w_ref, ids_ref = pk.route_ref(logits, biased, mask=mask)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ids_ref, hf_ids.long())  # the bias moved some picks
    with pytest.raises(ValueError, match="sparsemixer routes top-2"):
        pk.route_ref(logits, pk.RouteSpec(3, scoring="sparsemixer"))


@pytest.mark.parametrize("E", [5, 8, 60, 64, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_row_sigmoid_rows_do_not_depend_on_the_other_rows(E, threads) -> None:
    """A sigmoid router's scores for one token equal its scores among others, bit for bit
    (batched decode, prefill chunks): torch.sigmoid's CPU loop rounds a row differently by
    where it falls (vector chunks and a scalar tail); row_sigmoid never does, past one
    thread's block too, and is torch.sigmoid to rounding."""
    from psr_kernels.routing_ref import row_sigmoid

    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(700, E, generator=torch.Generator().manual_seed(E))
        whole = row_sigmoid(x)
        assert whole.is_contiguous() and whole.shape == x.shape
        torch.testing.assert_close(whole, torch.sigmoid(x), atol=1e-7, rtol=1e-6)
        for lo, hi in [(0, 1), (3, 4), (1, 3), (5, 12), (600, 700)]:
            assert torch.equal(row_sigmoid(x[lo:hi].clone()), whole[lo:hi]), (lo, hi)
    finally:
        torch.set_num_threads(was)
