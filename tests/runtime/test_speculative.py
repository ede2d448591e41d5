"""Speculative decoding with block-level expert selection on a tiny OLMoE: the acceptance
rule, K_b = E equal to exact greedy decoding, determinism under copy delays, counts, and
teacher-forced block scoring equal to verify blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import KV_KWARG, Stubborn, tiny_model, write_checkpoint

import psr
from psr.eval.spec_compare import OracleDrafter
from psr.runtime.kv import output_cache
from psr.runtime.speculative import generate_speculative
from psr.runtime.verify import BudgetSet, make_verify

PROMPT = [5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]
NEW = 20
KV = KV_KWARG  # the KV-cache keyword of the installed transformers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("spec") / "olmoe")


def Oracle(reference: list[int]) -> OracleDrafter:
    """Drafts the exact model's greedy continuation (every draft is accepted)."""
    return OracleDrafter(3, [reference])


def exact_greedy(path, n=NEW) -> list[int]:
    m = psr.load(path, "exact", residency=1.0, progress=False)
    return m.generate(PROMPT, n)[0].tolist()


def spec(path, drafter, block_k, policy="psr", residency=0.5, verify="budget", **kw):
    """Speculative greedy decoding of PROMPT, traced; `block_k` is budget's set size
    (None for verify='cpu')."""
    m = psr.load(path, policy, residency=residency, progress=False, **kw)
    rt = m.runtime
    rule = make_verify(verify, block_k, rt.spec.top_k, rt.capacity, rt.placement)
    rec = m.record_trace()
    out, st = generate_speculative(
        m.hf,
        m.runtime,
        drafter,
        torch.tensor([PROMPT]),
        NEW,
        rule,
        on_block=lambda processed, emitted: rec.trace.emitted.append(emitted),
    )
    return out[0].tolist(), st, m, rec.trace


@pytest.mark.parametrize("drafter", ["oracle", "stubborn"])
def test_a_block_of_all_experts_decodes_exactly_as_greedy(ckpt, drafter) -> None:
    want = exact_greedy(ckpt)
    d = Oracle(want) if drafter == "oracle" else Stubborn()
    got, st, _, _ = spec(ckpt, d, block_k=8, residency=1.0, lam=0.5, n=1)  # K_b = E = 8
    assert got == want
    assert st.emitted == NEW and sum(st.per_block) == NEW - 1
    if drafter == "oracle":  # every draft accepted: B + 1 tokens per block but the last
        assert all(n == d.block + 1 for n in st.per_block[:-1])
        assert st.blocks == -(-(NEW - 1) // (d.block + 1))
    else:  # [last, 1] is rarely the continuation: about one token per block
        assert st.blocks >= (NEW - 1) // (d.block + 1)


def test_acceptance_rule_on_a_stubborn_drafter(ckpt) -> None:
    """Each block emits its accepted drafts plus one target token; the drafts accepted
    are exactly those that equal the target's own choice at their position."""
    got, st, _, _ = spec(ckpt, Stubborn(), block_k=4)
    assert len(got) == len(PROMPT) + NEW
    assert all(1 <= n <= Stubborn.block + 1 for n in st.per_block)
    assert st.accepted == sum(st.per_block) - st.blocks
    pos = len(PROMPT) + 1  # the prefill's token, then the blocks
    for n in st.per_block:
        drafts = [got[pos - 1], 1]
        accepted = got[pos : pos + n - 1]
        assert accepted == drafts[: n - 1]  # a prefix of the drafts ...
        if n - 1 < len(drafts) and pos + n - 1 < len(got):
            assert got[pos + n - 1] != drafts[n - 1] or n - 1 == len(drafts)  # ... cut at a miss
        pos += n


def test_block_counts_add_up(ckpt) -> None:
    _, st, m, trace = spec(ckpt, Stubborn(), block_k=4)
    s = m.stats
    assert s["tokens"] == st.blocks  # one decode step per verify block
    # The experts the block's tokens route to, at most K_b per layer and block.
    assert s["routed"] == sum(len(ls.experts) for step in trace.tokens for ls in step)
    assert all(len(ls.experts) <= 4 for step in trace.tokens for ls in step)
    assert s["hits"] + s["misses"] == s["routed"]
    assert s["copies"] == s["misses"] + s["prefetches"]
    for step in trace.tokens:
        for ls in step:
            misses = [c for c in ls.copies if c.kind == "miss" and c.layer == ls.layer]
            assert len(misses) == len(ls.experts) - ls.hits <= 4
    assert trace.emitted == st.per_block


def test_output_is_bit_identical_under_random_copy_delays(ckpt, monkeypatch) -> None:
    runs = []
    for seed in ("1", "2", "3"):
        monkeypatch.setenv("PSR_COPY_DELAY_US", "2000")
        monkeypatch.setenv("PSR_COPY_DELAY_SEED", seed)
        got, st, m, trace = spec(ckpt, Stubborn(), block_k=3, lam=0.4, n=2)
        runs.append((got, st.as_dict(), m.stats.report(), trace.to_json()))
    assert runs[0] == runs[1] == runs[2]


def test_teacher_forced_blocks_equal_verify_blocks(ckpt) -> None:
    """Scoring a window in blocks of the true text = decoding it with a drafter that
    proposes the true text (every block accepted)."""
    ids = PROMPT + [(7 * i + 3) % 64 for i in range(15)]  # 12 prompt + 3 blocks of 5
    P, b = len(PROMPT), 5
    a = psr.load(ckpt, "psr", residency=0.5, lam=0.4, n=1, progress=False)
    ra = a.record_trace()
    a.runtime.set_block_mode(BudgetSet(3))
    a.runtime.begin_scoring(P, len(ids), block=b)
    try:
        la = a.hf(input_ids=torch.tensor([ids]), use_cache=False).logits
    finally:
        a.runtime.end_scoring()
        a.runtime.set_block_mode(None)
    m = psr.load(ckpt, "psr", residency=0.5, lam=0.4, n=1, progress=False)
    rm = m.record_trace()
    out = m.hf(input_ids=torch.tensor([ids[:P]]), use_cache=True)
    logits, kv = [out.logits], output_cache(out)
    m.runtime.set_block_mode(BudgetSet(3))
    for t in range(P, len(ids), b):
        out = m.hf(input_ids=torch.tensor([ids[t : t + b]]), use_cache=True, **{KV: kv})
        logits.append(out.logits)
    m.runtime.set_block_mode(None)
    assert ra.trace.to_json() == rm.trace.to_json()
    torch.testing.assert_close(la, torch.cat(logits, 1), rtol=1e-4, atol=2e-5)


def test_block_mode_arguments_are_checked(ckpt) -> None:
    m = psr.load(ckpt, "psr", residency=0.5, progress=False)  # 4 slots, top-2
    for bad in (1, 5, 2.5):
        with pytest.raises(ValueError, match="block_k="):
            m.runtime.set_block_mode(BudgetSet(bad))
    with pytest.raises(ValueError, match="needs block mode"):
        m.runtime.begin_scoring(4, 12, block=3)


def _write_drafters(path: Path) -> None:
    """Tiny drafters beside the tiny checkpoint, in the formats train_drafters.py writes."""
    import transformers
    from safetensors.torch import save_file

    from psr.models.drafters import BlockHeads

    torch.manual_seed(1)
    heads = BlockHeads(32, 3)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.05)
    meta = {"block": "3", "hidden_size": "32", "format": "psr-block-heads-v2"}
    save_file(dict(heads.state_dict()), str(path / "drafter_block.safetensors"), metadata=meta)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path / "drafter_ar")


@pytest.mark.parametrize("kind", ["block", "ar"])
def test_load_with_a_drafter_pays_its_memory_in_slots_and_decodes(ckpt, tmp_path, kind) -> None:
    import shutil

    path = tmp_path / "m"
    shutil.copytree(ckpt, path)
    _write_drafters(path)
    plain = psr.load(path, "psr", residency=1.0, progress=False)
    m = psr.load(path, "psr", residency=1.0, progress=False, speculative=kind, block=2)
    row = m.runtime.store.expert_bytes[0] * len(m.runtime.layers)
    lost = -(-m.drafter.memory_bytes // row)
    assert m.runtime.capacity == plain.runtime.capacity - lost and lost >= 1
    assert m.block_k == min(2 * 2, m.runtime.capacity)
    m.graphs = True  # asked for, but verify blocks are host-driven: the status says so
    out = m.generate(PROMPT, 10)
    assert m.graph_status == "off: speculative verify blocks (host-driven step)"
    assert out.shape[1] == len(PROMPT) + 10 and m.spec_stats.emitted == 10
    assert m.spec_stats.blocks == m.stats["tokens"]
    logits = m.score(torch.tensor([[*PROMPT, 1, 2, 3, 4, 5, 6]]), len(PROMPT), block=3)
    assert logits.shape == (1, len(PROMPT) + 6, 64)
    m.set_speculative(None, None)  # back to autoregressive decoding
    m.graphs = False
    assert m.generate(PROMPT, 4).shape[1] == len(PROMPT) + 4 and m.drafter is None
    assert m.graph_status == "off (graphs=False)"


def test_a_drafter_too_big_for_the_slots_is_refused(ckpt, tmp_path) -> None:
    import shutil

    path = tmp_path / "m"
    shutil.copytree(ckpt, path)
    _write_drafters(path)
    with pytest.raises(ValueError, match=r"drafter .* takes .* expert slots"):
        psr.load(path, "psr", residency=0.25, progress=False, speculative="ar")
    with pytest.raises(ValueError, match="speculative must be one of block, ar, mtp"):
        psr.load(path, "psr", residency=0.5, progress=False, speculative="medusa")
    # With the experts outside the slab computed on the CPU, fewer slots than top-k do.
    m = psr.load(
        path, "exact", residency=0.25, progress=False, speculative="ar", block=2,
        experts_on="cpu", verify="cpu",
    )  # fmt: skip
    assert m.runtime.capacity < 2
    assert m.generate(PROMPT, NEW)[0].tolist() == exact_greedy(path)
    assert m.spec_stats.blocks == m.stats["tokens"] and m.stats["cpu_experts"] > 0


def test_speculative_grid_is_drafters_by_block_k_by_lam() -> None:
    from psr.eval.spec_compare import default_specs

    specs = default_specs(8, 4, ("block",), (12, 16), (0.0, 0.1))
    assert [(s.kind, s.block, s.block_k, s.policy.lam) for s in specs] == [
        ("block", 4, 12, 0.0),
        ("block", 4, 12, 0.1),
        ("block", 4, 16, 0.0),
        ("block", 4, 16, 0.1),
    ]
    assert [s.block_k for s in default_specs(8)][:6] == [8, 8, 12, 12, 16, 16]
    with pytest.raises(ValueError, match=r"K_b \[4\] below the model's top-k 8"):
        default_specs(8, 4, ("block",), (4, 8))


# --- verify='cpu': each token's own top-k, the union's misses beyond M on the CPU -------


@pytest.mark.parametrize(
    ("verify", "experts_on", "residency"),
    [("cpu:0", "gpu", 0.5), ("cpu:1", "gpu", 0.5), ("cpu", "gpu", 0.25), ("cpu", "cpu", 0.5)],
)
@pytest.mark.parametrize("drafter", ["oracle", "stubborn"])
def test_exact_cpu_verify_decodes_as_exact_greedy(ckpt, verify, experts_on, residency, drafter):
    """Exact routing, every token its own top-k: the same tokens as autoregressive exact
    greedy decoding, whatever the copy budget (the rest computed on the CPU)."""
    want = exact_greedy(ckpt)
    d = Oracle(want) if drafter == "oracle" else Stubborn()
    got, _, m, trace = spec(ckpt, d, None, "exact", residency, verify=verify, experts_on=experts_on)
    assert got == want
    s = m.stats
    assert s["cpu_experts"] > 0  # the budget binds: some experts ran on the CPU
    assert s["misses"] == s["copies"] - s["prefetches"] + s["cpu_experts"]
    m_cap = m.runtime.capacity if verify == "cpu" and experts_on == "gpu" else None
    for step in trace.tokens:
        for ls in step:
            copied = [c for c in ls.copies if c.kind == "miss" and c.layer == ls.layer]
            assert len(copied) + ls.cpu_experts == len(ls.experts) - ls.hits
            cap = {"cpu:0": 0, "cpu:1": 1}.get(verify, 2 if experts_on == "gpu" else 0)
            assert len(copied) <= cap and (
                m_cap is None or len(ls.experts) - ls.cpu_experts <= m_cap
            )


def test_cpu_verify_is_bit_identical_under_random_copy_delays(ckpt, monkeypatch) -> None:
    """PSR-biased tokens, prefetches and a copy budget of 1: output, counts and trace do not
    depend on when the copies land."""
    runs = []
    for seed in ("1", "2", "3"):
        monkeypatch.setenv("PSR_COPY_DELAY_US", "2000")
        monkeypatch.setenv("PSR_COPY_DELAY_SEED", seed)
        got, st, m, trace = spec(ckpt, Stubborn(), None, lam=0.4, n=2, verify="cpu:1")
        runs.append((got, st.as_dict(), m.stats.report(), trace.to_json()))
        assert m.stats["cpu_experts"] > 0
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("verify", ["budget", "cpu:1"])
def test_teacher_forced_blocks_equal_verify_blocks_per_rule(ckpt, verify) -> None:
    """Scoring a window in blocks = decoding it with a drafter of the true text, under
    either rule (verify='cpu': the CPU experts read no slot in both)."""
    ids = PROMPT + [(5 * i + 1) % 64 for i in range(15)]
    P, b = len(PROMPT), 5
    logits, traces = [], []
    for scored in (True, False):
        m = psr.load(ckpt, "psr", residency=0.5, lam=0.4, n=1, progress=False)
        rt = m.runtime
        rec = m.record_trace()
        rt.set_block_mode(
            make_verify(verify, 3 if verify == "budget" else None, 2, 4, rt.placement)
        )
        if scored:
            rt.begin_scoring(P, len(ids), block=b)
            try:
                logits.append(m.hf(input_ids=torch.tensor([ids]), use_cache=False).logits)
            finally:
                rt.end_scoring()
        else:
            rt.set_block_mode(None)
            out = m.hf(input_ids=torch.tensor([ids[:P]]), use_cache=True)
            parts, kv = [out.logits], output_cache(out)
            rt.set_block_mode(
                make_verify(verify, 3 if verify == "budget" else None, 2, 4, rt.placement)
            )
            for t in range(P, len(ids), b):
                out = m.hf(input_ids=torch.tensor([ids[t : t + b]]), use_cache=True, **{KV: kv})
                parts.append(out.logits)
            logits.append(torch.cat(parts, 1))
        rt.set_block_mode(None)
        traces.append(rec.trace.to_json())
    assert traces[0] == traces[1]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=2e-5)


def test_budget_uses_only_the_experts_its_tokens_route_to(ckpt) -> None:
    """A set of K_b = 4 for one token of top-2: the two experts it routes to are `use`d (and
    copied), the set's two others are not."""
    from psr.runtime.host_decode import VerifyBlock

    m = psr.load(ckpt, "exact", residency=0.5, progress=False)  # 4 slots of 8, top-2
    rt = m.runtime
    L = rt.layers[0]
    L.cache.reset([0, 1])
    rt.set_block_mode(BudgetSet(4))
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 3.0, 2.0, -9.0, -9.0]])  # set {2, 3, 4, 5}
    before = m.stats["misses"]
    _, ids = VerifyBlock(rt).route_block(L, logits, physical=False)
    rt.set_block_mode(None)
    assert sorted(ids[0].tolist()) == [2, 3]
    assert sorted(L.cache.order()) == [0, 1, 2, 3]
    assert m.stats["misses"] - before == 2


def test_verify_words_and_budgets_are_checked(ckpt) -> None:
    from psr.vocab import parse_verify

    assert parse_verify("budget") == ("budget", None)
    assert parse_verify("cpu:3") == ("cpu", 3)
    for bad, msg in [
        ("gpu", "verify must be one of budget, cpu"),
        ("budget:2", "only 'cpu' takes a miss-copy budget"),
        ("cpu:x", "expected cpu:M with an integer M >= 0"),
        ("cpu:-1", "expected cpu:M"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_verify(bad)
    with pytest.raises(ValueError, match="verify must be one of"):
        psr.LoadConfig(verify="exact")
    m = psr.load(ckpt, "psr", residency=0.5, progress=False, experts_on="cpu")
    with pytest.raises(ValueError, match="verify='budget' needs experts_on='gpu', not 'cpu'"):
        m.set_speculative(Stubborn(), 2)
    assert m.drafter is None
    m.set_speculative(Stubborn(), verify="cpu")
    assert m.verify_rule().describe() == "cpu(M=0)"  # experts_on cpu's cap
    with pytest.raises(ValueError, match="verify='cpu' takes none"):
        m.set_speculative(Stubborn(), 2, verify="cpu")


def test_speculative_grid_adds_cpu_verify_rows() -> None:
    from psr.eval.spec_compare import default_specs

    specs = default_specs(8, 4, ("ar",), (16,), (0.0,), cpu_copies=(0, 2))
    assert [(s.block_k, s.verify) for s in specs] == [
        (16, "budget"),
        (None, "cpu:0"),
        (None, "cpu:2"),
    ]
    assert specs[1].label == "spec-ar(B=4, cpu M=0, lam=0, n=1)"
    assert specs[1].options()["verify"] == "cpu:0"


def test_speedups_are_against_the_fastest_autoregressive_row_per_profile() -> None:
    from psr.eval.spec_compare import _compare

    def row(label, verify, ms, nll):
        lat = {p: {"ms_per_token": v} for p, v in ms.items()}
        return {"label": label, "verify": verify, "latency": lat, "nll_items": nll,
                "generated": [[1, 2, 3]]}  # fmt: skip

    rows = [
        row("exact", None, {"a": 10.0, "b": 4.0}, [1.0, 2.0, 3.0]),
        row("psr", None, {"a": 5.0, "b": 3.0}, [1.0, 2.0, 3.0]),
        row("psr cpu", None, {"a": 6.0, "b": 2.0}, [1.0, 2.0, 3.0]),
        row("spec", "cpu:0", {"a": 2.5, "b": 1.0}, [1.5, 2.5, 3.5]),
    ]
    _compare(rows, ["a", "b"])
    spec = rows[3]
    assert spec["best_ar"] == {"a": "psr", "b": "psr cpu"}
    assert spec["speedup_vs_best_ar"] == {"a": 2.0, "b": 2.0}
    assert spec["speedup_vs_exact"] == {"a": 4.0, "b": 4.0}
    assert spec["delta_nll"]["mean"] == pytest.approx(0.5) and not spec["in_budget"]
    assert rows[1]["in_budget"] and rows[1]["delta_nll"]["mean"] == 0.0


def test_host_aware_speedups_take_graphs_where_the_step_is_captured() -> None:
    """Host-aware: an autoregressive row counts at the faster of eager and graphs, a verify
    block (never captured) eager; each row against the fastest autoregressive one."""
    from psr.eval.spec_compare import _compare, host_markdown

    def row(label, verify, free, eager, graph=None):
        r = {"label": label, "verify": verify, "nll_items": [1.0, 2.0], "residency": 0.5,
             "generated": [[1]], "accepted_per_block": None if verify is None else 1.0,
             "copies_per_token": 1.0, "cpu_experts_per_token": 0.0,
             "latency": {"a": {"ms_per_token": free}},
             "latency_host": {"a": {"ms_per_token": eager}}}  # fmt: skip
        if graph is not None:
            r["latency_graph"] = {"a": {"ms_per_token": graph}}
        return r

    rows = [
        row("exact", None, 10.0, 14.0, 12.0),
        row("psr", None, 5.0, 9.0, 6.0),
        row("spec", "cpu:0", 4.0, 8.0),
    ]
    _compare(rows, ["a"])
    spec = rows[2]
    assert spec["speedup_vs_best_ar"] == {"a": 1.25}
    assert spec["host_speedup_vs_best_ar"] == {"a": 0.75} and spec["host_best_ar"] == {"a": "psr"}
    assert rows[1]["host_speedup_vs_best_ar"] == {"a": 1.0}
    table = host_markdown(rows, ["a"])
    assert "| 4.00 (1.25x) | 8.00 (0.75x) |" in table and "| 5.00 (1.00x) | 6.00 (1.00x) |" in table


def test_schedule_keys_tell_apart_what_changes_the_calls() -> None:
    from psr.eval.spec_compare import ARConfig, SpecConfig, schedule_key
    from psr.policy import make_policy

    psr_ = make_policy("psr", 0.1, 1)
    assert schedule_key(SpecConfig("mtp", 2, None, psr_, "cpu:0")) == schedule_key(
        SpecConfig("mtp", 2, None, psr_, "cpu:2")
    )  # M changes how many copies a call issues, not the calls
    keys = {
        schedule_key(c)
        for c in (
            SpecConfig("mtp", 2, None, psr_, "cpu:0"),
            SpecConfig("mtp", 4, None, psr_, "cpu:0"),
            SpecConfig("mtp", 2, 16, psr_),
            SpecConfig("mtp", 2, None, make_policy("psr", 0.0, 1), "cpu:0"),
            ARConfig(psr_),
            ARConfig(psr_, "cpu"),
        )
    }
    assert len(keys) == 6


def test_a_verify_block_schedule_is_measured_and_priced(ckpt) -> None:
    """A speculative decode under the host probe gives a 'verify' schedule (the slab read
    and the loop's read of the target's choices in it) that prices the traced blocks."""
    from psr.eval.latency import simulate
    from psr.eval.spec_compare import SpecConfig, measure_host_schedule
    from psr.policy import make_policy

    want = exact_greedy(ckpt)
    cfg = SpecConfig("oracle", 2, None, make_policy("psr", 0.1, 1), "cpu:0")
    s = measure_host_schedule(str(ckpt), 0.5, cfg, PROMPT, [want])
    assert s.mode == "verify"
    assert [o.kind for o in s.moe_layer].count("release") == 1
    assert any(o.kind == "sync" for o in s.token)
    _, _, _m, trace = spec(ckpt, Oracle(want), None, lam=0.1, verify="cpu:0")
    assert len(trace.emitted) == len(trace.tokens) > 0
    free = simulate(trace, "rtx4090")
    trace.host = s
    aware = simulate(trace, "rtx4090", host=True)
    assert aware.host_model.startswith("host-aware(rtx4090 verify")
    assert aware.ms_per_token > free.ms_per_token and aware.host_ms > 0
