"""bench/variants.py's CacheRouting: Cache-Prior's running-average range and the top-J
guard, against a plain reference of each rule, and scored as it decodes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import bench_module, tiny_model, write_checkpoint

import psr
import psr_kernels as pk

variants = bench_module("variants")
E, K = 16, 4


class FakeRuntime:  # what CacheRouting reads of a runtime (weak-referenceable)
    def __init__(self, lam: float) -> None:
        self.spec = SimpleNamespace(top_k=K, n_group=1)
        self.policy = SimpleNamespace(lam=lam)
        self.ops = pk.kernel_ops("torch", torch.device("cpu"))
        self.steering = None

    def set_steering(self, s) -> None:
        self.steering = s


def reference(logits, mask, lam: float, delta: float, guard: int) -> tuple[set[int], list[float]]:
    """Top-k of z + lam * delta * m with the exact top `guard` always kept; weights are
    the model's softmax probabilities of the chosen ids (OLMoE: no renormalisation)."""
    z = logits.double()
    order0 = sorted(range(E), key=lambda e: (-float(z[e]), e))
    kept = order0[:guard]
    zb = z + lam * delta * mask.double()
    rest = sorted((e for e in range(E) if e not in kept), key=lambda e: (-float(zb[e]), e))
    chosen = set(kept + rest[: K - guard])
    p = torch.softmax(z, -1)
    return chosen, [float(p[e]) for e in sorted(chosen)]


@pytest.mark.parametrize(("paper", "guard"), [(True, 0), (False, 2), (True, 2), (False, 0)])
def test_routing_matches_the_reference(paper: bool, guard: int) -> None:
    lam = 0.3
    rt = FakeRuntime(lam)
    cr = variants.CacheRouting(rt, paper_range=paper, guard=guard)
    cr.install()
    assert rt.steering is cr
    spec = pk.RouteSpec(top_k=K, lam=lam)
    g = torch.Generator().manual_seed(0)
    layers = [SimpleNamespace(index=i, history=[]) for i in range(2)]
    spreads: dict[int, list[float]] = {0: [], 1: []}
    substituted = 0
    for t in range(40):
        if t == 20:  # a new sequence: new history lists, the average restarts
            for L in layers:
                L.history = []
            spreads = {0: [], 1: []}
        for L in layers:
            logits = torch.randn(1, E, generator=g) * (1 + 2 * (t % 3))  # spreads vary
            mask = torch.rand(E, generator=g) < 0.5
            assert cr.lam(L) == lam
            w, ids, sub = rt.ops.route_counted(logits, spec, mask=mask)
            spread = float(logits.max() - logits.min())
            spreads[L.index].append(spread)
            delta = sum(spreads[L.index]) / len(spreads[L.index]) if paper else spread
            want, want_w = reference(logits[0], mask, lam, delta, guard)
            got = sorted(ids[0].tolist())
            assert set(got) == want, (t, L.index)
            by_id = dict(zip(ids[0].tolist(), w[0].tolist(), strict=True))
            torch.testing.assert_close([by_id[e] for e in got], want_w, rtol=1e-5, atol=1e-7)
            order0 = set(sorted(range(E), key=lambda e: (-float(logits[0, e]), e))[:K])
            assert int(sub[0]) == len(want - order0)  # the op's count is unchanged
            substituted += int(sub[0])
    assert substituted > 0  # the bias did move the routing


def test_rejects_bad_guards() -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="guard must be an int >= 0"):
            variants.CacheRouting(FakeRuntime(0.1), paper_range=False, guard=bad)
    with pytest.raises(ValueError, match="exceeds the router's top_k=4"):
        variants.CacheRouting(FakeRuntime(0.1), paper_range=False, guard=5)


IDS = torch.tensor([[(7 * i + 3) % 64 for i in range(48)]])


def _run(path: Path, policy: str, kw: dict, how: str):
    model = psr.load(path, policy, 0.5, progress=False, **kw)
    variants.CacheRouting(model.runtime, paper_range=True, guard=1).install()
    rec = model.record_trace()
    first = model.score(IDS, 16) if how == "score" else model.decode_logits(IDS, 16)
    trace, substituted = rec.trace.to_json(), model.stats["substituted"]
    # A second sequence: the average restarts, so it routes as the first did (scored: no
    # copies, so the slots, and the logits, are as after the first call).
    model.reset_stats()
    if how == "score":
        torch.testing.assert_close(model.score(IDS, 16), first, rtol=1e-4, atol=2e-5)
        assert model.stats["substituted"] == substituted
    return first, trace, substituted


@pytest.mark.parametrize(
    ("policy", "kw"), [("cache-prior", {"lam": 0.5}), ("psr", {"lam": 0.5, "n": 2})]
)
def test_scores_as_it_decodes(tmp_path, policy, kw) -> None:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    la, ta, sa = _run(path, policy, kw, "decode")
    lb, tb, sb = _run(path, policy, kw, "score")
    assert tb == ta  # every routed id, hit and copy, in order
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=2e-5)
    assert sa == sb and sa > 0
