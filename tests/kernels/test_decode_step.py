"""psr_kernels.decode: one layer's fused decode step (route + use, predict + prefetch)
against its torch reference, and the reference against the host-driven composition it
replaces (route with a host mask, LogicalCache.use, predict_next, LogicalCache.prefetch),
over scorings, group limits, dtypes and n; non-finite inputs set the flag."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import psr_kernels as pk
from psr.cache import LogicalCache
from psr.runtime.slots import SlotMap
from psr_kernels import cache_state as cs
from psr_kernels.decode import decode_step, decode_step_ref

E, H = 16, 24

CASES = [
    # (scoring, renormalize, n_group, topk_group, k, n, bias, dtype)
    ("softmax", False, 1, 1, 4, 2, False, torch.float32),
    ("softmax", True, 1, 1, 2, 0, False, torch.bfloat16),
    ("topk_softmax", False, 1, 1, 3, 1, False, torch.float32),
    ("sigmoid", True, 4, 2, 4, 3, True, torch.float32),
]


def _problem(case, seed: int):
    scoring, renorm, n_group, topk_group, k, n, has_bias, dtype = case
    g = torch.Generator().manual_seed(seed)
    spec = pk.RouteSpec(k, 0.3, scoring, renorm, n_group, topk_group, 2.5)
    args = dict(
        bias=torch.randn(E, generator=g) * 0.1 if has_bias else None,
        residual=torch.randn(1, H, generator=g).to(dtype),
        norm_weight=(1 + 0.1 * torch.randn(H, generator=g)).to(dtype),
        gate_weight=torch.randn(E, H, generator=g).to(dtype),
        next_bias=torch.randn(E, generator=g) * 0.1 if has_bias else None,
        eps=1e-5,
    )
    logits = torch.randn(1, E, generator=g).to(dtype)
    return spec, n, logits, args


def _state(k: int, n: int, C: int, seed: int, inserts: int | None = None):
    layout = cs.CacheLayout(E, C + 2, k, n)
    state = cs.new_state(3, layout, "cpu")
    rng = random.Random(seed)
    caches = []
    for layer in range(3):
        order = rng.sample(range(E), C - 1)
        slot_expert = list(range(C + 2))
        rng.shuffle(slot_expert)
        slot_expert = [e if e < E else -1 for e in slot_expert]  # leftovers and empties
        slot_of = dict(zip(order, rng.sample(range(C), C - 1), strict=True))
        for e, s in slot_of.items():
            slot_expert[s] = e
        cs.reset_layer(state, layout, layer, C, order, slot_of, slot_expert, inserts=inserts)
        cache = LogicalCache(C, E)
        cache.reset(order)
        sm = SlotMap(slot_expert[:C])
        sm.slot_of = dict(slot_of)
        caches.append((cache, sm))
    return layout, state, caches


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-g{c[2]}-k{c[4]}-n{c[5]}-{c[7]}")
@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "capped"])
def test_kernel_equals_reference(case, capped: bool) -> None:
    """capped: a miss-copy cap of 0 (experts_on cpu), so every miss reaches the CPU list;
    uncapped: capped=False, and a reference with capped=True on the same rows (cap top_k)
    stays bit-identical."""
    spec, n, logits, args = _problem(case, seed=1)
    layout, state, _ = _state(spec.top_k, n, 8, seed=2, inserts=0 if capped else None)
    twin = state.clone()
    other = None if capped else state.clone()
    out_dtype = logits.dtype
    cpu_experts = layout.header + cs.COUNTS + cs.CPU_EXPERTS
    for step in range(3):  # the state carries over between steps
        kw = dict(args, n=n, out_dtype=out_dtype) if n else dict(bias=args["bias"])
        w, ids = decode_step(logits, spec, state, layout, 1, capped=capped, **kw)
        w_ref, ids_ref = decode_step_ref(logits, spec, twin, layout, 1, capped=capped, **kw)
        assert torch.equal(ids, ids_ref) and ids.dtype == torch.int64
        assert w.dtype == w_ref.dtype
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(state, twin), f"state differs after step {step}"
        if other is not None:
            decode_step_ref(logits, spec, other, layout, 1, capped=True, **kw)
            assert torch.equal(state, other), f"capped=True differs after step {step}"
        logits = logits.roll(step + 1, dims=1)
    # Capped at 0, every miss went to the CPU; uncapped, none.
    misses = int(state[1, layout.header + cs.COUNTS + cs.MISSES])
    assert misses > 0
    assert int(state[1, cpu_experts]) == (misses if capped else 0)


@pytest.mark.parametrize("C", [0, 1, 3])
def test_kernel_equals_reference_with_a_slab_below_top_k(C: int) -> None:
    """C < k = 4 (experts_on cpu / hybrid, cap k: capacity - hits bounds the insertions):
    the fused step and its reference agree on ids, weights and every state bit, and the
    misses the slab cannot take reach the CPU list."""
    spec, n, logits, args = _problem(CASES[0], seed=6)
    n = min(n, C)
    layout = cs.CacheLayout(E, C, spec.top_k, n)
    state = cs.new_state(3, layout, "cpu")
    for layer in range(3):
        order = list(range(layer, layer + C))
        cs.reset_layer(state, layout, layer, C, order, {e: s for s, e in enumerate(order)},
                       order, inserts=spec.top_k)  # fmt: skip
    twin = state.clone()
    for step in range(3):
        kw = dict(args, n=n, out_dtype=logits.dtype) if n else dict(bias=args["bias"])
        w, ids = decode_step(logits, spec, state, layout, 1, capped=True, **kw)
        w_ref, ids_ref = decode_step_ref(logits, spec, twin, layout, 1, capped=True, **kw)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(state, twin), f"state differs after step {step}"
        assert len(cs.cache_order(state, layout, 1)) <= C
        logits = logits.roll(step + 1, dims=1)
    hdr = layout.header + cs.COUNTS
    misses, cpu = int(state[1, hdr + cs.MISSES]), int(state[1, hdr + cs.CPU_EXPERTS])
    assert cpu >= 3 * (spec.top_k - C) and (C > 0 or cpu == misses == 3 * spec.top_k)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-g{c[2]}-k{c[4]}-n{c[5]}-{c[7]}")
def test_reference_equals_the_host_driven_step(case) -> None:
    """What the host path does per layer: route with the cache as a host mask, `use`,
    place the misses; predict_next, `prefetch` into the next layer, place the copies."""
    spec, n, logits, args = _problem(case, seed=3)
    layout, state, caches = _state(spec.top_k, n, 8, seed=4)
    (cache, sm), (nxt, nsm) = caches[1], caches[2]
    mask = torch.tensor(cache.mask())
    w_host, ids_host = pk.route_ref(logits, spec, mask=mask, bias=args["bias"])
    use = cache.use(ids_host[0].tolist())
    misses = sm.place(use.misses)
    kw = dict(args, n=n) if n else dict(bias=args["bias"])
    w, ids = decode_step_ref(logits, spec, state, layout, 1, out_dtype=torch.float32, **kw)
    assert torch.equal(ids, ids_host) and torch.equal(w, w_host)
    assert cs.cache_order(state, layout, 1) == cache.order()
    # substituted: the routed ids outside the same router's unbiased top-k
    _, exact = pk.route_ref(logits, dataclasses.replace(spec, lam=0.0), bias=args["bias"])
    want = len(set(ids_host[0].tolist()) - set(exact[0].tolist()))
    assert int(state[1, layout.header + cs.COUNTS + cs.SUBSTITUTED]) == want
    row = state[1]
    lst = row[layout.miss_list : layout.miss_list + 3 * spec.top_k].view(-1, 3)
    m = int(row[layout.header + cs.MISS_N])
    assert list(zip(*misses, strict=True)) == [tuple(r[:2]) for r in lst[:m].tolist()]
    if n:
        pred, _ = pk.predict_next_ref(
            args["residual"], args["norm_weight"], args["gate_weight"], n, spec,
            eps=args["eps"], bias=args["next_bias"],
        )  # fmt: skip
        copies = nsm.place(nxt.prefetch(pred[0].tolist(), n))
        assert cs.cache_order(state, layout, 2) == nxt.order()
        r2 = state[2]
        pf = r2[layout.pf_list : layout.width].view(-1, 3)
        c = int(r2[layout.header + cs.PF_N])
        assert list(zip(*copies, strict=True)) == [tuple(r[:2]) for r in pf[:c].tolist()]
    else:
        assert cs.cache_order(state, layout, 2) == caches[2][0].order()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in Triton's interpreter
@pytest.mark.parametrize("step", [decode_step, decode_step_ref])
def test_non_finite_inputs_set_the_flags(step) -> None:
    spec, n, logits, args = _problem(CASES[0], seed=5)
    layout, state, _ = _state(spec.top_k, n, 8, seed=6)
    flag = layout.header + cs.FLAG
    step(logits, spec, state, layout, 0, n=n, **args)
    assert state[:, flag].tolist() == [0, 0, 0]
    bad = logits.clone()
    bad[0, 3] = float("nan")
    step(bad, spec, state, layout, 0, n=n, **args)
    assert state[:, flag].tolist() == [1, 0, 0]
    args["residual"] = args["residual"].clone().fill_(float("inf"))
    step(logits, spec, state, layout, 1, n=n, **args)
    assert state[:, flag].tolist() == [1, 0, 1]


def test_bad_arguments_are_named() -> None:
    spec, n, logits, args = _problem(CASES[0], seed=7)
    layout, state, _ = _state(spec.top_k, n, 8, seed=8)
    with pytest.raises(ValueError, match=r"logits must be \[1, 16\]"):
        decode_step(logits.expand(2, E), spec, state, layout, 0)
    with pytest.raises(ValueError, match="layer 2 is the last"):
        decode_step(logits, spec, state, layout, 2, n=n, **args)
    with pytest.raises(ValueError, match="n > 0 needs residual"):
        decode_step(logits, spec, state, layout, 0, n=1)
    with pytest.raises(ValueError, match=r"spec\.top_k=3 but the cache layout.s is 4"):
        decode_step(logits, pk.RouteSpec(3), state, layout, 0)
