"""Block-level expert selection (speculative verification) against a plain reference."""

from __future__ import annotations

import math

import pytest
import torch

import psr_kernels as pk
from psr_kernels.block_routing import block_scores_ref, route_block_ref


def plain_block(logits, k, kb, mask, lam, renormalize=False):
    """Loops and sorted() only: one set for the block, then each token's top-k in it."""
    T, E = logits.shape
    probs = [[math.exp(v) for v in row] for row in logits.double().tolist()]
    probs = [[p / sum(row) for p in row] for row in probs]
    score = [sum(probs[t][e] for t in range(T)) for e in range(E)]
    if mask is not None:
        spread = max(score) - min(score)
        score = [score[e] + lam * spread * float(mask[e]) for e in range(E)]
    chosen = sorted(range(E), key=lambda e: (-score[e], e))[:kb]
    ids, ws = [], []
    for t in range(T):
        row = sorted(chosen, key=lambda e: (-float(logits[t, e]), e))[:k]
        w = [probs[t][e] for e in row]
        if renormalize:
            w = [x / sum(w) for x in w]
        ids.append(row)
        ws.append(w)
    return sorted(chosen), ids, ws


@pytest.mark.parametrize(
    ("E", "k", "kb", "T", "lam", "renorm"),
    [
        (8, 2, 2, 3, 0.0, False),
        (16, 4, 6, 5, 0.3, False),
        (64, 8, 12, 5, 0.2, True),
        (60, 6, 60, 2, 0.5, False),
    ],
)
def test_block_selection_matches_a_plain_reference(E, k, kb, T, lam, renorm) -> None:
    gen = torch.Generator().manual_seed(E * 7 + kb)
    logits = torch.randn(T, E, generator=gen) * 2
    mask = torch.rand(E, generator=gen) < 0.5
    spec = pk.RouteSpec(k, lam=lam, renormalize=renorm)
    chosen, w, ids = route_block_ref(logits, spec, kb, mask=mask)
    want_set, want_ids, want_w = plain_block(logits, k, kb, mask, lam, renorm)
    assert chosen.tolist() == want_set
    assert ids.tolist() == want_ids
    torch.testing.assert_close(w, torch.tensor(want_w, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert set(ids.flatten().tolist()) <= set(chosen.tolist())


@pytest.mark.parametrize("scoring", ["softmax", "topk_softmax", "sigmoid"])
def test_a_block_of_all_experts_is_exact_routing(scoring) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 32, generator=gen)
    bias = torch.randn(32, generator=gen) * 0.05 if scoring == "sigmoid" else None
    mask = torch.rand(32, generator=gen) < 0.5
    spec = pk.RouteSpec(4, lam=0.7, scoring=scoring, renormalize=True, scaling=2.0)
    chosen, w, ids = route_block_ref(logits, spec, 32, mask=mask, bias=bias)
    exact = pk.RouteSpec(4, scoring=scoring, renormalize=True, scaling=2.0)
    w_ref, ids_ref = pk.route_ref(logits, exact, bias=bias)
    assert chosen.tolist() == list(range(32))
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref)


def test_the_cache_bias_pulls_cached_experts_into_the_set_and_ties_go_low() -> None:
    logits = torch.zeros(3, 8)  # all tied: the lowest ids win
    chosen, _, ids = route_block_ref(logits, pk.RouteSpec(2), 3)
    assert chosen.tolist() == [0, 1, 2] and ids.tolist() == [[0, 1]] * 3
    mask = torch.zeros(8, dtype=torch.bool)
    mask[[5, 7]] = True
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    chosen, _, _ = route_block_ref(logits, pk.RouteSpec(2, lam=5.0), 3, mask=mask)
    assert {5, 7} <= set(chosen.tolist())
    score = block_scores_ref(logits)
    torch.testing.assert_close(score, torch.softmax(logits, -1).sum(0))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(top_k=2, block_k=1), r"block_k=1 must be an int in \[top_k=2, E=8\]"),
        (dict(top_k=2, block_k=9), r"block_k=9 must be an int"),
        (dict(top_k=2, block_k=2.5), r"block_k=2.5 must be an int"),
        (dict(top_k=9, block_k=9), r"top_k=9 must be in \[1, num_experts=8\]"),
    ],
)
def test_bad_block_arguments(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        route_block_ref(torch.zeros(2, 8), pk.RouteSpec(kw["top_k"]), kw["block_k"])


def plain_group_block(logits, bias, k, kb, n_group, topk_group):
    """Loops only, sigmoid router with correction bias (DeepSeek-V3): each token's groups
    by top-2 sums, the block score over each token's groups, S from the reached experts
    first, each token's top-k in S and its groups first, then S's other members."""
    T, E = logits.shape
    per = E // n_group
    s = [[1 / (1 + math.exp(-float(v))) for v in row] for row in logits.tolist()]
    z = [[s[t][e] + float(bias[e]) for e in range(E)] for t in range(T)]
    own = []
    for t in range(T):
        gs = [sum(sorted(z[t][g * per : (g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        keep = sorted(range(n_group), key=lambda g: (-gs[g], g))[:topk_group]
        own.append({e for g in keep for e in range(g * per, (g + 1) * per)})
    reach = set().union(*own)
    score = [sum(z[t][e] for t in range(T) if e in own[t]) for e in range(E)]
    chosen = sorted(range(E), key=lambda e: (e not in reach, -score[e], e))[:kb]
    ids = [sorted(chosen, key=lambda e: (e not in own[t], -z[t][e], e))[:k] for t in range(T)]
    return sorted(chosen), ids


@pytest.mark.parametrize("kb", [4, 6, 16])
def test_group_limited_block_routing_against_plain_loops(kb) -> None:
    """DeepSeek-V3's group limit in block mode: the set and each token's picks as the loops
    say; at K_b = E every token's routing is the router's own (route_ref)."""
    torch.manual_seed(3)
    T, E, k = 5, 16, 2
    logits, bias = torch.randn(T, E) * 2, torch.randn(E) * 0.1
    spec = pk.RouteSpec(k, scoring="sigmoid", n_group=4, topk_group=2, renormalize=True)
    chosen, w, ids = route_block_ref(logits, spec, kb, bias=bias)
    want_set, want_ids = plain_group_block(logits, bias, k, kb, 4, 2)
    assert chosen.tolist() == want_set
    assert ids.tolist() == want_ids
    assert set(ids.reshape(-1).tolist()) <= set(want_set)
    if kb == E:
        rw, rids = pk.route_ref(logits, spec, bias=bias)
        assert ids.tolist() == rids.tolist()
        torch.testing.assert_close(w, rw)


def test_block_routing_refuses_a_bad_spec() -> None:
    with pytest.raises(TypeError, match="route_block: spec must be a psr_kernels"):
        route_block_ref(torch.zeros(2, 8), 2, 4)
