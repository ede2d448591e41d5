"""The offloaded runtime on tiny checkpoints of every family: exactness, determinism, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import (
    FAMILIES,
    bench_module,
    hf_references,
    tiny_model,
    write_checkpoint,
    write_layouts,
)

import psr

AheadTwo = bench_module("variants").AheadTwo  # a steering variant beyond the spec

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
NEW = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, layout) -> checkpoint folder."""
    return write_layouts(FAMILIES, tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def references(ckpts) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """transformers' own logits and greedy tokens for each family."""
    return hf_references(ckpts, FAMILIES, PROMPT, NEW)


def load(path, policy="exact", residency=0.5, **kw) -> psr.OffloadedModel:
    return psr.load(path, policy=policy, residency=residency, progress=False, **kw)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_matches_transformers(ckpts, references, family, layout) -> None:
    ref_logits, ref_tokens = references[family]
    model = load(ckpts[family, layout], "exact", residency=0.25)  # C = 2 = top_k
    torch.testing.assert_close(model(PROMPT), ref_logits, rtol=1e-5, atol=1e-5)
    tokens = model.generate(PROMPT, max_new_tokens=NEW)
    assert tokens.tolist() == ref_tokens.tolist()
    s = model.stats
    moe_layers = len(model.runtime.layers)
    assert s["tokens"] == NEW - 1
    assert s["routed"] == (NEW - 1) * moe_layers * 2
    assert s["hits"] + s["misses"] == s["routed"] and s["prefetches"] == 0
    assert s["bytes_copied"] == s["misses"] * model.runtime.expert_bytes
    # Two prefills: the forward above, and generate's.
    assert s["prefill_copies"] > 0 and s["prefill_tokens"] == 2 * PROMPT.shape[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_transformers_logits(ckpts, family) -> None:
    """Teacher-forced decode steps under `exact` equal transformers' full forward."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(ckpts[family, "fused"]).eval()
    with torch.no_grad():
        ref = m(PROMPT).logits
    model = load(ckpts[family, "fused"], "exact", residency=0.5)
    torch.testing.assert_close(model.decode_logits(PROMPT, 4), ref, rtol=1e-5, atol=1e-5)


def test_exact_prefetch_gives_exact_tokens(ckpts, references) -> None:
    for fam in ("olmoe", "deepseek_v3"):
        model = load(ckpts[fam, "per_expert"], "exact-prefetch", n=1)
        assert model.generate(PROMPT, max_new_tokens=NEW).tolist() == references[fam][1].tolist()
        assert model.stats["prefetches"] > 0


def run(path, policy, monkeypatch=None, delay_us=0, seed=0, ahead2=0, **kw):
    if monkeypatch is not None:
        monkeypatch.setenv("PSR_COPY_DELAY_US", str(delay_us))
        monkeypatch.setenv("PSR_COPY_DELAY_SEED", str(seed))
    model = load(path, policy, **kw)
    if ahead2:  # the experimental two-layers-ahead prefetch variant (host-driven step)
        model.runtime.set_steering(AheadTwo(model.runtime, ahead2))
    tokens = model.generate(PROMPT, max_new_tokens=NEW)
    logits = model.decode_logits(tokens, PROMPT.shape[1])
    counts = {
        k: v
        for k, v in model.stats.summary().items()
        if k not in ("stall_s", "decode_s", "tokens_per_s", "prefill_stall_s")
    }
    return tokens, logits, counts


@pytest.mark.parametrize(
    ("family", "policy", "kw"),
    [
        ("olmoe", "psr", {"lam": 0.5, "n": 2}),
        ("olmoe", "psr", {"lam": 0.5, "n": 2, "decode": "host"}),
        ("deepseek_v3", "psr", {"lam": 0.3, "n": 1}),
        ("deepseek_v3", "psr", {"lam": 0.3, "n": 1, "decode": "host"}),
        ("qwen2_moe", "cache-prior", {"lam": 0.5}),
        ("olmoe", "psr", {"lam": 0.5, "n": 1, "ahead2": 2}),
    ],
)
def test_outputs_are_bit_identical_under_random_copy_delays(
    ckpts, monkeypatch, family, policy, kw
) -> None:
    path = ckpts[family, "per_expert"]
    base = run(path, policy, monkeypatch, 0, **kw)
    assert base[2]["misses"] + base[2]["hits"] == base[2]["routed"]
    for seed in (1, 2, 3):
        tokens, logits, counts = run(path, policy, monkeypatch, 3000, seed, **kw)
        assert torch.equal(tokens, base[0])
        assert torch.equal(logits, base[1])  # bit-identical
        assert counts == base[2]


def test_cache_prior_async_depends_on_copy_timing(ckpts, monkeypatch) -> None:
    """Biasing toward *physical* residency: the timing-free answer is PSR's; delays change it."""
    path = ckpts["olmoe", "per_expert"]
    kw = {"lam": 1.5, "n": 2, "residency": 0.5}
    want = run(path, "psr", monkeypatch, 0, **kw)
    diverged = []
    for seed in (1, 2):
        _, logits, _ = run(path, "cache-prior-async", monkeypatch, 40000, seed, **kw)
        diverged.append(not torch.equal(logits, want[1]))
    assert any(diverged), "physical-residency routing ignored copy timing"


def test_psr_with_n0_is_cache_prior_and_lam0_is_exact(ckpts, references) -> None:
    path = ckpts["qwen3_moe", "per_expert"]
    a = run(path, "psr", lam=0.4, n=0)
    b = run(path, "cache-prior", lam=0.4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    c = run(path, "psr", lam=0.0, n=1)
    assert c[0].tolist() == references["qwen3_moe"][1].tolist()


def test_biased_routing_cuts_misses(ckpts) -> None:
    path = ckpts["olmoe", "per_expert"]
    exact = run(path, "exact")[2]
    prior = run(path, "cache-prior", lam=1.5)[2]
    assert prior["misses"] < exact["misses"]


def test_prefetch_removes_every_predictable_miss(tmp_path) -> None:
    """With attention and experts writing nothing to the residual stream, every MoE layer's
    input is the token's embedding, so the next layer's routing is exactly what PSR predicts
    (its router on this layer's MoE input, normed with its own norm weight). PSR with
    n = top_k must then prefetch every expert the next layer routes: no miss after the
    first MoE layer, every prefetch used, and the first layer (which nothing prefetches
    into) missing exactly as Cache-Prior's does. Without prefetching PSR is Cache-Prior."""
    hf = tiny_model("olmoe")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "mlp.experts.down_proj")):
                p.zero_()
            elif name.endswith("post_attention_layernorm.weight"):  # each layer its own
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    path = write_checkpoint(hf, tmp_path / "predictable")
    tokens = torch.randint(0, hf.config.vocab_size, (1, 48), generator=gen)
    prompt = 8

    def misses_by_layer(policy: str, **kw) -> tuple[list[int], dict[str, float]]:
        model = load(path, policy, residency=0.5, lam=0.2, **kw)  # 4 slots, top_k = 2
        rec = model.record_trace()
        model.decode_logits(tokens, prompt)
        by_layer = [0] * len(model.runtime.layers)
        for step in (s for tok in rec.trace.tokens for s in tok):
            for c in step.copies:
                by_layer[c.layer] += c.kind == "miss"
        return by_layer, model.stats.summary()

    prior_by_layer, prior = misses_by_layer("cache-prior")
    steer_by_layer, steer = misses_by_layer("psr", n=2)
    later = sum(prior_by_layer[1:])  # what prefetching must remove
    assert later > 0, "Cache-Prior never misses after the first layer: nothing to show"
    assert steer_by_layer == [prior_by_layer[0]] + [0] * (len(prior_by_layer) - 1)
    assert steer["misses"] == prior["misses"] - later
    assert prior["prefetches"] == 0
    assert steer["prefetches"] > 0 and steer["prefetch_used"] == steer["prefetches"]


def test_counts_agree_with_an_lru_replay_of_the_routing(ckpts) -> None:
    """Exact + LRU: replay the routed ids through an independent LRU; same hits and misses.
    (The host-driven step, whose LogicalCache.use is spied on; the device step is held
    equal to it in test_device_decode.py.)"""
    model = load(ckpts["mixtral", "per_expert"], "exact", residency=0.5, decode="host")
    seen: list[tuple[int, list[int]]] = []
    for L in model.runtime.layers:
        orig = L.cache.use

        def spy(routed, L=L, orig=orig):
            seen.append((L.index, list(routed)))
            return orig(routed)

        L.cache.use = spy
    model.generate(PROMPT, max_new_tokens=NEW)
    caches = {L.index: L.cache.order() for L in model.runtime.layers}  # final state
    hits = misses = 0
    # Rebuild each layer's LRU from its prefill state by replaying forwards.
    model2 = load(ckpts["mixtral", "per_expert"], "exact", residency=0.5)
    model2(PROMPT)  # prefill only: seeds the caches
    lru = {L.index: L.cache.order() for L in model2.runtime.layers}
    for layer, routed in seen:
        q = lru[layer]
        for e in routed:
            if e in q:
                hits += 1
        for e in sorted(set(routed) - set(q)):
            misses += 1
            victim = next(x for x in q if x not in routed)
            q.remove(victim)
            q.append(e)
        for e in sorted(routed, reverse=True):
            q.remove(e)
            q.append(e)
    assert (hits, misses) == (model.stats["hits"], model.stats["misses"])
    assert lru == caches


def test_triton_path_under_the_interpreter_matches_torch(ckpts) -> None:
    path = ckpts["olmoe", "per_expert"]
    torch_model = load(path, "psr", lam=0.5, n=1, compute="torch")
    triton_model = load(path, "psr", lam=0.5, n=1, compute="triton")
    assert torch_model.runtime.ops.path == "torch"
    assert triton_model.runtime.ops.path == "triton"  # the kernels ran, not the references
    a = torch_model.generate(PROMPT, max_new_tokens=3)
    b = triton_model.generate(PROMPT, max_new_tokens=3)
    assert a.tolist() == b.tolist()


def test_offload_swaps_blocks_in_place_and_hf_generate_still_works(references) -> None:
    hf = tiny_model("olmoe")
    ref = hf.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    model = psr.offload(hf, policy="exact", residency=0.25, progress=False)
    assert model.hf is hf
    assert not any("experts.gate_up_proj" in n for n, _ in hf.named_parameters())
    with torch.no_grad():
        out = hf.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    assert out.tolist() == ref.tolist()
    assert model.stats["tokens"] == NEW - 1
    # A second generation is a new sequence: the runtime reseeds from its prefill.
    with torch.no_grad():
        assert hf.generate(PROMPT, max_new_tokens=NEW, do_sample=False).tolist() == ref.tolist()
    assert model.stats["tokens"] == 2 * (NEW - 1)


def test_sampling_is_seeded(ckpts) -> None:
    model = load(ckpts["olmoe", "per_expert"], "psr")
    kw = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    a = model.generate(PROMPT, 6, seed=3, **kw)
    b = model.generate(PROMPT, 6, seed=3, **kw)
    assert a.tolist() == b.tolist()
    # It samples, from the seed: greedy decoding or an ignored seed would give one sequence.
    runs = {tuple(model.generate(PROMPT, 6, seed=s, **kw)[0].tolist()) for s in range(4)}
    runs.add(tuple(model.generate(PROMPT, 6)[0].tolist()))
    assert len(runs) == 5


# --- bad input ---------------------------------------------------------------------------


def test_residency_too_small_for_top_k(ckpts) -> None:
    with pytest.raises(ValueError, match=r"gives 1 expert slots per layer, fewer than top_k=2"):
        load(ckpts["olmoe", "per_expert"], residency=0.1)
    with pytest.raises(ValueError, match="n=5 prefetches exceed the 4 slots"):
        load(ckpts["olmoe", "per_expert"], "psr", residency=0.5, n=5)
    with pytest.raises(ValueError, match=r"residency must be a number in \(0, 1\]"):
        load(ckpts["olmoe", "per_expert"], residency=1.5)
    with pytest.raises(ValueError, match="policy 'exact' has lam=0"):
        load(ckpts["olmoe", "per_expert"], "exact", lam=0.3)
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        load(ckpts["olmoe", "per_expert"], "lru")


def test_unknown_architecture_lists_supported(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"unsupported architecture 'llama'.*olmoe.*deepseek_v3"):
        load(tmp_path)


def test_missing_shard_truncated_file_and_missing_tensor(ckpts, tmp_path) -> None:
    model = tiny_model("olmoe")
    sharded = write_checkpoint(model, tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 1
    assert load(sharded).generate(PROMPT, 2).shape[1] == PROMPT.shape[1] + 2
    shards[-1].unlink()
    with pytest.raises(psr.CheckpointError, match=f"shard .*{shards[-1].name}.* is missing"):
        load(sharded)

    trunc = tmp_path / "trunc"
    shutil.copytree(ckpts["olmoe", "fused"], trunc)
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(
        psr.CheckpointError, match=r"truncated safetensors file .*model\.safetensors"
    ):
        load(trunc)

    from safetensors.torch import load_file, save_file

    gone = tmp_path / "gone"
    shutil.copytree(ckpts["olmoe", "per_expert"], gone)
    sd = load_file(gone / "model.safetensors")
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(sd, gone / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(psr.CheckpointError, match=r"'model.layers.1.mlp.experts.3.up_proj.weight'"):
        load(gone)
    del sd["model.norm.weight"]
    save_file(sd, gone / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(psr.CheckpointError, match=r"'model\.norm\.weight' not found"):
        load(gone)


def test_wrong_dtype_context_and_batch(ckpts) -> None:
    path = ckpts["olmoe", "per_expert"]
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load(path, dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is available"):
            load(path, device="cuda")
    with pytest.raises(ValueError, match="unsupported device 'mps'"):
        load(path, device="mps")
    model = load(path)
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        model.generate(torch.zeros(1, 120, dtype=torch.long), max_new_tokens=10)
    with pytest.raises(ValueError, match="batch 1"):
        model.generate(torch.zeros(2, 5, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        model.generate(torch.tensor([[1, 99]]), max_new_tokens=2)


def test_bf16_load_runs(ckpts) -> None:
    model = load(ckpts["deepseek_v3", "fused"], "psr", dtype="bfloat16")
    assert model.runtime.store.dtype == torch.bfloat16
    assert model.generate(PROMPT, 4).shape[1] == PROMPT.shape[1] + 4


@pytest.mark.parametrize("decode", ["device", "host"])
def test_sequences_are_independent_of_what_ran_before(ckpts, decode) -> None:
    """Physical leftovers of earlier sequences (duplicates, stale slots) change nothing."""
    path = ckpts["olmoe", "per_expert"]
    prompts = [PROMPT[0].tolist(), [3, 1, 4, 1, 5, 9, 2, 6], [7], [60, 61, 62, 63, 0, 1, 2], [9, 8]]
    shared = load(path, "psr", lam=0.5, n=2, residency=0.5, decode=decode)
    for p in prompts * 2:
        fresh = load(path, "psr", lam=0.5, n=2, residency=0.5, decode=decode)
        assert shared.generate(p, 10).tolist() == fresh.generate(p, 10).tolist()
        shared.runtime.pull_caches()  # the device step's caches, where it holds them
        for L in shared.runtime.layers:  # the slab still mirrors the logical cache
            for e, s in L.slots.slot_of.items():
                assert shared.runtime.store.verify(L.index, s)
                assert shared.runtime.store.slot_experts(L.index)[s] == e


def test_configure_switches_policy_and_residency_without_reloading(ckpts) -> None:
    path = ckpts["olmoe", "per_expert"]
    model = load(path, "exact", residency=0.5)
    for policy, rho, kw in [
        ("psr", 0.25, {"lam": 0.5, "n": 1}),
        ("cache-prior", 0.5, {"lam": 0.3}),
    ]:
        model.configure(policy, rho, **kw)
        model.reset_stats()
        fresh = load(path, policy, residency=rho, **kw)
        assert model.generate(PROMPT, NEW).tolist() == fresh.generate(PROMPT, NEW).tolist()
        assert model.stats["misses"] == fresh.stats["misses"]
        assert model.runtime.capacity == fresh.runtime.capacity
    with pytest.raises(ValueError, match=r"gives 6 slots per layer, more than the store's 4"):
        model.configure("exact", 0.75)


def test_stall_time_is_counted_per_token_and_in_total(ckpts, monkeypatch) -> None:
    """The host-driven step keeps a record per token."""
    monkeypatch.setenv("PSR_COPY_DELAY_US", "3000")
    model = load(ckpts["olmoe", "per_expert"], "exact", residency=0.25, decode="host")
    model.generate(PROMPT, NEW)
    per_token = [t["stall_s"] for t in model.stats.per_token]
    assert len(per_token) == NEW - 1
    assert model.stats["stall_s"] == pytest.approx(sum(per_token))
    assert model.stats["stall_s"] > 0 and model.stats["tokens_per_s"] > 0
    assert model.stats["decode_s"] == pytest.approx(sum(t["time_s"] for t in model.stats.per_token))
    assert all(t["time_s"] >= t["stall_s"] for t in model.stats.per_token)
    assert [t["misses"] for t in model.stats.per_token] and sum(
        t["misses"] for t in model.stats.per_token
    ) == model.stats["misses"]


def test_device_step_counts_stall_in_total_only(ckpts, monkeypatch) -> None:
    """The device step's joins wait for delayed side-stream gathers (its prefetches): stall
    time in the totals only (per-token records carry counts and time, stall 0); the counts
    equal the host step's."""
    monkeypatch.setenv("PSR_COPY_DELAY_US", "3000")
    kw = dict(residency=0.25, lam=0.5, n=2)
    model = load(ckpts["olmoe", "per_expert"], "psr", **kw)
    model.generate(PROMPT, NEW)
    assert len(model.stats.per_token) == NEW - 1 and model.stats["tokens"] == NEW - 1
    assert all(r["stall_s"] == 0 for r in model.stats.per_token)
    assert model.stats["stall_s"] > 0 and model.stats["tokens_per_s"] > 0
    host = load(ckpts["olmoe", "per_expert"], "psr", decode="host", **kw)
    host.generate(PROMPT, NEW)
    keys = ("routed", "hits", "misses", "prefetches", "prefetch_used", "copies", "bytes_copied")
    assert {k: model.stats[k] for k in keys} == {k: host.stats[k] for k in keys}


def test_experts_without_their_route_is_an_error(ckpts) -> None:
    model = load(ckpts["olmoe", "per_expert"], "psr")
    model.generate(PROMPT, 2)  # seeded: decode mode
    L = model.runtime.layers[0]
    x = torch.zeros(1, 32)
    with pytest.raises(RuntimeError, match="experts called without a matching route"):
        model.runtime.experts(L, x, torch.tensor([[0, 1]]), torch.ones(1, 2))
