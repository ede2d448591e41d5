"""experts_on="gpu" | "cpu" | "hybrid" (issue 27): misses computed on the CPU from the
host rows instead of copied. Each mode reproducible under copy delays; cpu issues no miss
copy and hybrid at most m per layer step (the recorded copies say so); the device step
equals the host step per mode; gpu is the default's behaviour; the CPU experts compute
the same function as the slab (exact routing: the logits agree to rounding); bad input
refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.cache import prefill_state

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
NEW = 6
RESIDENCY = 0.25  # 2 of 8 slots, top-2: steps with two misses are common (hybrid:1 splits)
COUNTS = ("tokens", "routed", "hits", "misses", "prefetches", "cpu_experts", "copies")
MODES = ["cpu", "hybrid:1"]
POLICIES = [("exact", {}), ("psr", {"lam": 0.3, "n": 1})]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("experts_on")
    return {f: write_checkpoint(tiny_model(f), root / f) for f in ("olmoe", "gpt_oss")}


def _run(path: Path, policy: str, experts_on: str, decode: str = "device", **kw):
    model = psr.load(
        path, policy, RESIDENCY, decode=decode, experts_on=experts_on, progress=False, **kw
    )
    tokens = model.generate(PROMPT, max_new_tokens=NEW)
    logits = model.decode_logits(tokens, PROMPT.shape[1])
    s = model.stats
    return tokens[0].tolist(), logits, {k: s[k] for k in COUNTS}, model


@pytest.mark.parametrize(("policy", "kw"), POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_is_reproducible_under_copy_delays(ckpts, monkeypatch, mode, policy, kw):
    base = _run(ckpts["olmoe"], policy, mode, **kw)
    assert base[2]["cpu_experts"] > 0  # the mode computed some misses on the CPU
    monkeypatch.setenv("PSR_COPY_DELAY_US", "3000")
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", "5")
    for decode in ("device", "host"):
        got = _run(ckpts["olmoe"], policy, mode, decode, **kw)
        assert got[0] == base[0] and got[2] == base[2]
        assert torch.equal(got[1], base[1])  # bit-identical: routing never sees copy timing


@pytest.mark.parametrize(("policy", "kw"), POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("mode", MODES)
def test_device_step_equals_host_step(ckpts, mode, policy, kw) -> None:
    dev = _run(ckpts["olmoe"], policy, mode, "device", **kw)
    host = _run(ckpts["olmoe"], policy, mode, "host", **kw)
    assert dev[0] == host[0] and dev[2] == host[2]
    assert torch.equal(dev[1], host[1])
    assert _rows(dev[3]) == _rows(host[3])  # per-token records, row by row


def _rows(model: psr.OffloadedModel) -> list[tuple[float, ...]]:
    return [tuple(r[k] for k in COUNTS[1:]) for r in model.stats.per_token]


@pytest.mark.parametrize(("mode", "cap"), [("cpu", 0), ("hybrid:1", 1)])
def test_miss_copies_per_layer_step_stay_within_the_cap(ckpts, mode, cap) -> None:
    model = psr.load(
        ckpts["olmoe"], "psr", RESIDENCY, lam=0.3, n=1, experts_on=mode, progress=False
    )
    rec = model.record_trace()
    model.generate(PROMPT, max_new_tokens=NEW)
    steps = [s for tok in rec.trace.tokens for s in tok]
    assert steps and all(sum(c.kind == "miss" for c in s.copies) <= cap for s in steps)
    assert sum(s.cpu_experts for s in steps) == model.stats["cpu_experts"] > 0
    s = model.stats
    assert s["copies"] == s["misses"] - s["cpu_experts"] + s["prefetches"]
    assert rec.trace.counts()["misses"] == s["misses"]
    if cap == 0:
        assert s["copies"] == s["prefetches"]


def test_cpu_mode_with_exact_keeps_prefill_cache(ckpts) -> None:
    """exact in cpu mode (n = 0): no miss is inserted, so each layer keeps the cache its
    prefill seeded (llama.cpp-like), and no decode copy is issued at all."""
    model = psr.load(ckpts["olmoe"], "exact", 0.5, experts_on="cpu", progress=False)
    model.generate(PROMPT, max_new_tokens=NEW)
    model.runtime.pull_caches()
    C = model.runtime.capacity
    for L in model.runtime.layers:
        seeded = prefill_state(L.history, C)
        assert sorted(L.cache.order()) == sorted(seeded)
    assert model.stats["copies"] == 0 and model.stats["cpu_experts"] == model.stats["misses"]


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
def test_cpu_experts_compute_what_the_slab_computes(ckpts, family) -> None:
    """Exact routing does not depend on the cache: cpu, hybrid and gpu route alike and
    differ only in where (and in what summation order) experts are computed, so the
    logits agree to rounding (gpt-oss: its kind has no CPU kernel, the reference runs)."""
    gpu = _run(ckpts[family], "exact", "gpu")
    for mode in MODES:
        got = _run(ckpts[family], "exact", mode)
        assert got[2]["routed"] == gpu[2]["routed"] and got[2]["cpu_experts"] > 0
        torch.testing.assert_close(got[1], gpu[1], rtol=1e-4, atol=1e-4)


def test_gpu_mode_is_the_default(ckpts) -> None:
    kw = {"lam": 0.5, "n": 2}
    default = _run(ckpts["olmoe"], "psr", "gpu", **kw)
    model = psr.load(ckpts["olmoe"], "psr", RESIDENCY, progress=False, **kw)
    assert model.experts_on == "gpu" and model.stats["cpu_experts"] == 0
    model.set_experts_on("cpu")
    model.set_experts_on("gpu")  # back: the spec's use again
    tokens = model.generate(PROMPT, max_new_tokens=NEW)
    assert tokens[0].tolist() == default[0]
    assert default[2]["cpu_experts"] == 0
    assert default[2]["copies"] == default[2]["misses"] + default[2]["prefetches"]


@pytest.mark.parametrize(
    ("experts_on", "match"),
    [
        ("tpu", "experts_on must be one of gpu, cpu, hybrid"),
        ("cpu:1", "only 'hybrid' takes"),
        ("hybrid:x", "hybrid:M"),
        ("hybrid:3", r"must be an int in \[0, top_k=2\]"),
        ("hybrid:1,1", "2 entries for 3 MoE layers"),
    ],
)
def test_bad_experts_on_is_refused_in_one_line(ckpts, experts_on, match) -> None:
    with pytest.raises(ValueError, match=match) as e:
        psr.load(ckpts["olmoe"], "exact", 0.5, experts_on=experts_on, progress=False)
    assert "\n" not in str(e.value)


def test_hybrid_m_is_for_hybrid_and_budget_verify_is_refused(ckpts) -> None:
    from psr.runtime.verify import BudgetSet

    model = psr.load(ckpts["olmoe"], "exact", 0.5, progress=False)
    with pytest.raises(ValueError, match="hybrid_m is for experts_on='hybrid'"):
        model.set_experts_on("cpu", 1)
    assert model.set_experts_on("hybrid", [0, 1, 2]) == [0, 1, 2]
    model.set_experts_on("cpu")
    with pytest.raises(ValueError, match="verify='budget' needs experts_on='gpu'"):
        model.runtime.set_block_mode(BudgetSet(2))


def test_hybrid_on_the_cpu_backend_without_a_profile_copies_nothing(
    ckpts, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("PSR_HOME", str(tmp_path))  # no machine profile here
    model = psr.load(ckpts["olmoe"], "exact", 0.5, experts_on="hybrid", progress=False)
    assert model.runtime.inserts == [0, 0, 0]


def test_scoring_counts_cpu_experts_as_decoding_does(ckpts) -> None:
    """A teacher-forced window (`score`) routes and counts as token-by-token decoding,
    the capped use included."""
    tokens, logits, _, model = _run(ckpts["olmoe"], "psr", "hybrid:1", lam=0.3, n=1)
    model.reset_stats()
    model.decode_logits(torch.tensor([tokens]), PROMPT.shape[1])
    want = {k: model.stats[k] for k in COUNTS}
    model.reset_stats()
    scored = model.score(torch.tensor([tokens]), PROMPT.shape[1])
    assert {k: model.stats[k] for k in COUNTS} == want and want["cpu_experts"] > 0
    torch.testing.assert_close(scored, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_triton_device_step_equals_the_host_step(ckpts) -> None:
    """The fused decode kernel (interpreted here) with the miss-copy cap in its state row:
    the CPU list it writes gives the host step's tokens and counts."""
    kw = dict(lam=0.3, n=1, compute="triton")

    def run(decode: str) -> tuple[list[int], dict[str, float]]:
        model = psr.load(
            ckpts["olmoe"], "psr", RESIDENCY, decode=decode, experts_on="hybrid:1",
            progress=False, **kw,
        )  # fmt: skip
        tokens = model.generate(PROMPT, max_new_tokens=3)
        return tokens[0].tolist(), {k: model.stats[k] for k in COUNTS}

    dev, host = run("device"), run("host")
    assert dev == host and dev[1]["cpu_experts"] > 0


def test_the_device_step_hands_cpu_experts_off_without_a_read(ckpts) -> None:
    """The device step with CPU experts reads nothing on the host (no read, no h2d): per
    MoE layer and token one hand-off of the CPU list to the CPU (`cpu`) and one join."""
    from psr.eval.host_probe import HostProbe

    model = psr.load(ckpts["olmoe"], "psr", RESIDENCY, lam=0.3, n=1, experts_on="cpu",
                     progress=False)  # fmt: skip
    with HostProbe(model) as probe:
        model.generate(PROMPT, max_new_tokens=4)
    assert model.runtime.hands_off_cpu_experts()
    assert len(probe.steps) == 3 and probe.per_token()["h2d"] == 0
    assert not probe.read_sites()
    for cells in probe.steps:
        for c in cells:
            kinds = [e.kind for e in c.events]
            assert kinds.count("cpu") == 1 and kinds.count("cpu_join") == 1
            assert kinds.index("cpu") < kinds.index("cpu_join")
    assert model.runtime.store.counters()["cpu_tasks"] == 3 * len(model.runtime.layers)


def test_kinds_without_cpu_kernels_read_the_cpu_list_count(ckpts) -> None:
    """gpt-oss's experts (biases, clamped SwiGLU) have no CPU kernel in the hand-off: the
    CPU backend's device step reads the CPU list's count, one read per MoE layer and token
    (the reference it calls reads the ids too), and graphs are refused with the reason."""
    from psr.eval.host_probe import HostProbe
    from psr.runtime.graphs import graphs_unavailable

    model = psr.load(ckpts["gpt_oss"], "exact", RESIDENCY, experts_on="cpu", progress=False)
    assert not model.runtime.hands_off_cpu_experts()
    with HostProbe(model) as probe:
        model.generate(PROMPT, max_new_tokens=3)
    sites = probe.read_sites()
    counts = sites["__int__ @ experts"]  # the count; the reference reads the ids (tolist)
    assert counts == len(probe.steps) * len(model.runtime.layers), sites
    assert "CPU kernels do not compute" in (graphs_unavailable(model.runtime) or "")


@pytest.mark.parametrize("mode", MODES)
def test_the_decode_forward_with_the_hand_off_traces_whole(ckpts, mode) -> None:
    """torch._dynamo.explain of a decode forward with CPU experts: one graph, no break (the
    hand-off reads nothing on the host), and the traced forward ran the CPU's tasks.
    (Inductor compiles the same custom-op pattern, psr_store::gather /
    join and the CPU kernels' op, in tests/runtime/test_graphs.py.)"""
    from psr.runtime.graphs import DecodeGraph, graphs_unavailable

    model = psr.load(ckpts["olmoe"], "psr", RESIDENCY, lam=0.3, n=1, experts_on=mode,
                     progress=False)  # fmt: skip
    assert graphs_unavailable(model.runtime) is None
    store = model.runtime.store
    graph = DecodeGraph(model.hf, model.runtime, 32)
    with torch.no_grad(), model.runtime.lock:
        logits = graph.prefill(PROMPT)
        nxt = logits.argmax(-1).view(1, 1)
        logits = graph.step(nxt, PROMPT.shape[1])  # eager: hands the caches over
        graph.tok.copy_(logits.argmax(-1).view(1, 1))
        graph.pos.fill_(PROMPT.shape[1] + 1)
        tasks = store.counters()["cpu_tasks"]
        explained = torch._dynamo.explain(lambda: graph._eager(graph.tok, graph.pos))()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
        b.reason for b in explained.break_reasons
    ]
    assert store.counters()["cpu_tasks"] > tasks  # the traced forward handed off


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_on_cuda_the_hand_off_equals_the_host_step_and_graphs_replay_it(tmp_path, mode) -> None:
    """On a GPU: the device step hands the CPU list off in stream order (no host read in
    the MoE path) and gives the host step's tokens and counts (its synchronous hand-off);
    graphs on replay the same, one capture. (tmp_path only: bench/gpu_tests.py's runner.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from psr.eval.host_probe import HostProbe

    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    kw = dict(lam=0.3, n=1, device="cuda")
    # generate only, as the runs below (_run's decode_logits would add NEW tokens' counts)
    ref = psr.load(path, "psr", RESIDENCY, decode="host", experts_on=mode, progress=False, **kw)
    ref_tokens = ref.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
    host = (ref_tokens, None, {k: ref.stats[k] for k in COUNTS})
    model = psr.load(path, "psr", RESIDENCY, decode="device", experts_on=mode, graphs=False,
                     progress=False, **kw)  # fmt: skip
    assert model.runtime.hands_off_cpu_experts()
    with HostProbe(model) as probe:
        tokens = model.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
    assert probe.read_sites() == {}
    assert tokens == host[0] and {k: model.stats[k] for k in COUNTS} == host[2]
    assert host[2]["cpu_experts"] > 0
    graphed = psr.load(path, "psr", RESIDENCY, experts_on=mode, graphs=True, progress=False, **kw)
    got = graphed.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
    assert graphed.graph_status.startswith("on"), graphed.graph_status
    assert got == host[0] and {k: graphed.stats[k] for k in COUNTS} == host[2]
    assert graphed.stats["captures"] == 1
