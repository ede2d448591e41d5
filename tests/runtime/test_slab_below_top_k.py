"""A slab smaller than top-k (issue 39 item 3): with experts_on cpu / hybrid the routed
experts the slab cannot hold are computed on the CPU from the host rows, so any slab size
down to none is allowed (C = 0: llama.cpp's --cpu-moe). On the tiny OLMoE (8 experts,
top-2): C in {0, 1 = k - 1} with cpu and hybrid, both decode steps equal in tokens, logits
and counts and reproducible under copy delays; C = 0 is exact routing computed on the CPU
(equal to exact routing at any C up to rounding, and to transformers' own model); the
Triton path's steps equal too; bad input refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
NEW = 6
COUNTS = ("tokens", "routed", "hits", "misses", "prefetches", "cpu_experts", "copies")


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return tiny_model("olmoe")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny) -> Path:
    return write_checkpoint(tiny, tmp_path_factory.mktemp("slab0") / "olmoe")


def _run(
    path: Path, policy: str, slots: int, experts_on: str, decode: str = "device", new: int = NEW,
    **kw,
):  # fmt: skip
    model = psr.load(
        path, policy, slots=slots, decode=decode, experts_on=experts_on, progress=False, **kw
    )
    tokens = model.generate(PROMPT, max_new_tokens=new)
    logits = model.decode_logits(tokens, PROMPT.shape[1])
    s = model.stats
    return tokens[0].tolist(), logits, {k: s[k] for k in COUNTS}, model


CASES = [  # (slots, experts_on, policy, options): C = 0 and C = k - 1 = 1
    (0, "cpu", "cache-prior", {"lam": 0.3}),
    (0, "hybrid:1", "exact", {}),
    (1, "cpu", "psr", {"lam": 0.3, "n": 1}),
    (1, "hybrid:1", "cache-prior", {"lam": 0.3}),
    (1, "hybrid:2", "psr", {"lam": 0.3, "n": 1}),
]


@pytest.mark.parametrize(("slots", "mode", "policy", "kw"), CASES, ids=lambda v: str(v))
def test_steps_agree_and_reproduce_under_copy_delays(ckpt, monkeypatch, slots, mode, policy, kw):
    base = _run(ckpt, policy, slots, mode, **kw)
    s = base[2]
    # At most C of a layer step's k routed experts come from the slab (hits and inserts).
    assert s["cpu_experts"] >= s["routed"] - slots * (s["routed"] // 2)
    assert s["copies"] == s["misses"] - s["cpu_experts"] + s["prefetches"]
    if slots == 0:
        assert s["hits"] == s["copies"] == 0 and s["cpu_experts"] == s["routed"]
    monkeypatch.setenv("PSR_COPY_DELAY_US", "3000")
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", "7")
    for decode in ("device", "host"):
        got = _run(ckpt, policy, slots, mode, decode, **kw)
        assert got[0] == base[0] and got[2] == base[2], decode
        assert torch.equal(got[1], base[1]), decode  # bit-identical


@pytest.mark.parametrize(("slots", "mode", "policy", "kw"), [CASES[0], CASES[4]], ids=str)
def test_triton_path_steps_agree(ckpt, slots, mode, policy, kw) -> None:
    """The Triton kernels (the interpreter here): the fused decode kernel's capped `use` on
    a slab of 0 / 1 rows, and the slab FFN through the device slot map, against the host
    step."""
    dev = _run(ckpt, policy, slots, mode, "device", 3, compute="triton", **kw)
    host = _run(ckpt, policy, slots, mode, "host", 3, compute="triton", **kw)
    assert dev[0] == host[0] and dev[2] == host[2] and torch.equal(dev[1], host[1])
    assert dev[2]["cpu_experts"] > 0


def test_the_logical_cache_holds_at_most_c_ids_and_no_routed_id_is_evicted(ckpt) -> None:
    """C = 1, hybrid:2: each layer's cache holds one id after every step, and a step's
    inserted misses never exceed C - hits (the recorded copies per layer step)."""
    model = psr.load(ckpt, "cache-prior", slots=1, lam=0.3, experts_on="hybrid:2",
                     progress=False)  # fmt: skip
    rec = model.record_trace()
    model.generate(PROMPT, max_new_tokens=NEW)
    steps = [s for tok in rec.trace.tokens for s in tok]
    assert steps and all(sum(c.kind == "miss" for c in s.copies) <= 1 for s in steps)
    model.runtime.pull_caches()
    assert all(len(L.cache) == 1 for L in model.runtime.layers)


def test_no_slab_is_exact_routing_on_the_cpu(ckpt, tiny) -> None:
    """C = 0: an empty cache biases nothing, so every policy routes exactly and computes
    every routed expert on the CPU: bit-identical to exact at C = 0, the same tokens as
    exact routing with a slab (rounding apart), and transformers' own logits."""
    exact0 = _run(ckpt, "exact", 0, "cpu")
    biased0 = _run(ckpt, "cache-prior", 0, "cpu", lam=0.5)
    assert biased0[0] == exact0[0] and torch.equal(biased0[1], exact0[1])
    assert biased0[2] == exact0[2]
    slab = _run(ckpt, "exact", 4, "cpu")
    assert slab[0] == exact0[0] and slab[2]["routed"] == exact0[2]["routed"]
    torch.testing.assert_close(slab[1], exact0[1], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        want = tiny(torch.tensor([exact0[0]])).logits
    torch.testing.assert_close(exact0[1], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("slots", [0, 1])
def test_the_slab_prefill_path_with_too_few_slots(ckpt, monkeypatch, slots) -> None:
    """Prefill staged through the slab (CUDA's path, forced on the CPU): one slot stages
    every expert through it; no slot reads the host rows. Reproducible under delays and
    the tokens of exact routing."""

    def run(delay: int):
        monkeypatch.setenv("PSR_COPY_DELAY_US", str(delay))
        model = psr.load(ckpt, "exact", slots=slots, experts_on="cpu", progress=False)
        model.runtime.prefill_reads = "slab"
        out = model.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
        return out, model.stats["prefill_copies"]

    base = run(0)
    assert (base[1] > 0) == (slots > 0)
    assert run(3000) == base
    assert base[0] == _run(ckpt, "exact", 0, "cpu")[0]


def test_switching_slots_and_placement(ckpt) -> None:
    model = psr.load(ckpt, "exact", slots=4, experts_on="cpu", progress=False)
    want = model.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
    model.configure("exact", slots=0)  # down to none: still exact routing
    assert model.generate(PROMPT, max_new_tokens=NEW)[0].tolist() == want
    with pytest.raises(ValueError, match=r"experts_on='gpu' needs at least top_k=2 slots .*'cpu'"):
        model.set_experts_on("gpu")
    assert model.experts_on == "cpu"
    model.configure("exact", slots=2)
    model.set_experts_on("gpu")
    with pytest.raises(ValueError, match=r"fewer than top_k=2.*experts_on='cpu'"):
        model.configure("exact", slots=1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"slots": 1}, r"gives 1 expert slots per layer, fewer than top_k=2: .*experts_on='cpu'"),
        ({"slots": 0, "experts_on": "hybrid:1", "policy": "psr"}, "n=1 prefetches exceed the 0"),
        ({"slots": -1, "experts_on": "cpu"}, "slots must be an int >= 0, got -1"),
        ({"residency": 0, "experts_on": "cpu"}, r"in \(0, 1\], got 0 \(no slots at all: slots=0"),
    ],
)
def test_bad_input_is_refused_in_one_line(ckpt, kw, match) -> None:
    kw = {"policy": "exact", **kw}
    with pytest.raises(ValueError, match=match) as e:
        psr.load(ckpt, progress=False, **kw)
    assert "\n" not in str(e.value)
