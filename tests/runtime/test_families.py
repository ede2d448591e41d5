"""The families added with the family table, end to end on tiny random checkpoints written
by transformers itself: exact parity with transformers (both on-disk layouts, residency 1.0
and 0.5), the Triton path per new router kind, every policy deterministic under copy delays,
the device step equal to the host step, offload / restore / save_pretrained round trips,
and the config checks. (The five older families run through every other runtime test.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import NEW_FAMILIES, hf_references, tiny_model, write_layouts
from torch import nn

import psr
from psr.models.families import FAMILIES, check_config, family_of, moe_block

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
NEW = 6
# One family per new router kind (and MiniMax-M2: a correction bias kept on the block;
# gpt-oss: its expert kind and its router's bias).
TRITON_CASES = ("deepseek_v2", "ernie4_5_moe", "minimax_m2", "gpt_oss", "phimoe", "llama4_text")


def hf_logits(model: nn.Module, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[tuple[str, str], Path]:
    return write_layouts(NEW_FAMILIES, tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def references(ckpts) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return hf_references(ckpts, NEW_FAMILIES, PROMPT, NEW)


def load(path: Path, policy: str = "exact", residency: float = 0.5, **kw) -> psr.OffloadedModel:
    return psr.load(path, policy=policy, residency=residency, progress=False, **kw)


def test_checkpoints_use_the_names_the_entries_expect(ckpts) -> None:
    """The tiny checkpoints are what transformers writes: the entries' disk names are
    exercised (per-expert for most, Mixtral-style block names, Granite's fused names)."""
    from safetensors import safe_open

    expect = {
        "minimax_m2": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "granitemoe": "model.layers.0.block_sparse_moe.input_linear.weight",
        "hunyuan_v1_moe": "model.layers.0.mlp.gate.wg.weight",
        "ernie4_5_moe": "model.layers.1.mlp.moe_statics.e_score_correction_bias",
        "qwen3_next": "model.layers.0.mlp.experts.0.gate_proj.weight",
    }
    for fam, name in expect.items():
        with safe_open(str(ckpts[fam, "per_expert"] / "model.safetensors"), "pt") as f:
            assert name in f.keys(), (fam, sorted(f.keys())[:8])


@pytest.mark.parametrize("residency", [1.0, 0.5])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_exact_matches_transformers(ckpts, references, family, layout, residency) -> None:
    ref_logits, ref_tokens = references[family]
    with load(ckpts[family, layout], "exact", residency) as model:
        assert model.runtime.spec.family == family
        torch.testing.assert_close(model(PROMPT), ref_logits, rtol=1e-5, atol=1e-5)
        assert model.generate(PROMPT, max_new_tokens=NEW).tolist() == ref_tokens.tolist()
        s = model.stats
        assert s["routed"] == (NEW - 1) * len(model.runtime.layers) * model.runtime.spec.top_k
        if residency == 1.0:  # a slot per expert: nothing is evicted, each copied once at most
            spec = model.runtime.spec
            assert s["misses"] <= spec.num_experts * len(model.runtime.layers)


def test_dense_layers_are_left_to_transformers(ckpts) -> None:
    """Layers the config makes dense (first_k_dense_replace, mlp_only_layers,
    moe_layer_start_index) get no psr module; the rest do."""
    want = {"glm4_moe": [1, 2, 3], "qwen3_next": [0, 2], "ernie4_5_moe": [1, 2]}
    want |= {"llama4_text": [1, 3]}  # interleave_moe_layer_step=2
    for fam, idx in want.items():
        with load(ckpts[fam, "per_expert"]) as model:
            assert [L.decoder_index for L in model.runtime.layers] == idx


@pytest.mark.parametrize("family", TRITON_CASES)
def test_triton_path_matches_transformers(ckpts, references, family) -> None:
    """The new router kinds through the Triton kernels (interpreter): prefill routing, the
    fused device decode step and predictions, equal to transformers at exact routing."""
    ref_logits, ref_tokens = references[family]
    with load(ckpts[family, "per_expert"], "exact", 0.5, compute="triton") as model:
        assert model.runtime.ops.path == "triton"
        torch.testing.assert_close(model(PROMPT), ref_logits, rtol=1e-5, atol=1e-5)
        assert model.generate(PROMPT, max_new_tokens=4).tolist() == ref_tokens[:, :-2].tolist()
    # Biased with prefetching: Triton and torch take the same decisions.
    runs = []
    for compute in ("triton", "torch"):
        with load(ckpts[family, "per_expert"], "psr", 0.5, lam=0.3, n=1, compute=compute) as m:
            runs.append((m.generate(PROMPT, max_new_tokens=4).tolist(), m.stats["misses"]))
    assert runs[0] == runs[1]


def _run(path: Path, policy: str, monkeypatch, delay_us: int, seed: int, **kw):
    monkeypatch.setenv("PSR_COPY_DELAY_US", str(delay_us))
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", str(seed))
    with load(path, policy, **kw) as model:
        tokens = model.generate(PROMPT, max_new_tokens=NEW)
        logits = model.decode_logits(tokens, PROMPT.shape[1])
        counts = {
            k: v
            for k, v in model.stats.summary().items()
            if k not in ("stall_s", "decode_s", "tokens_per_s", "prefill_stall_s")
        }
    return tokens, logits, counts


POLICIES = [
    ("exact", {}),
    ("exact-prefetch", {"n": 1}),
    ("cache-prior", {"lam": 0.5}),
    ("psr", {"lam": 0.5, "n": 2}),
]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_every_policy_is_deterministic_under_copy_delays(ckpts, monkeypatch, family) -> None:
    path = ckpts[family, "per_expert"]
    misses = {}
    for policy, kw in POLICIES:
        base = _run(path, policy, monkeypatch, 0, 0, **kw)
        tokens, logits, counts = _run(path, policy, monkeypatch, 2000, 7, **kw)
        assert torch.equal(tokens, base[0]), policy
        assert torch.equal(logits, base[1]), policy  # bit-identical
        assert counts == base[2], policy
        misses[policy] = counts["misses"]
    # The bias and the prefetches act on these models (else the checks above prove little).
    assert misses["psr"] < misses["exact"], misses


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_device_step_equals_host_step(ckpts, family) -> None:
    out = []
    for decode in ("device", "host"):
        with load(ckpts[family, "fused"], "psr", lam=0.5, n=2, decode=decode) as model:
            tokens = model.generate(PROMPT, max_new_tokens=NEW)
            s = model.stats
            out.append((tokens.tolist(), s["hits"], s["misses"], s["prefetches"]))
    assert out[0] == out[1]


def _assert_plain(hf: nn.Module, experts_type: type) -> None:
    fam = family_of(hf.config.model_type)
    assert not hasattr(hf, "psr_runtime")
    for layer in hf.model.layers:
        block = moe_block(layer, fam)
        if block is not None:
            assert type(block.experts) is experts_type
    assert not any(p.is_meta for p in hf.parameters())


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_offload_restore_and_save_pretrained_round_trip(tmp_path, family) -> None:
    import transformers

    hf = tiny_model(family)
    ref, names = hf_logits(hf), set(hf.state_dict())
    fam = FAMILIES[family]
    last = next(b for b in (moe_block(x, fam) for x in reversed(hf.model.layers)) if b)
    experts_type = type(last.experts)
    om = psr.offload(hf, policy="psr", residency=0.5, progress=False)
    assert set(hf.state_dict()) == names
    torch.testing.assert_close(om(PROMPT), ref, rtol=1e-5, atol=1e-5)  # prefill is exact
    hf.save_pretrained(tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(hf_logits(back), ref, rtol=0, atol=1e-5)
    assert psr.restore(hf) is hf
    _assert_plain(hf, experts_type)
    assert torch.equal(hf_logits(hf), ref)
    # psr.load of what was saved, then its own save_pretrained: the same model again.
    with load(tmp_path / "saved") as loaded:
        loaded.save_pretrained(tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    torch.testing.assert_close(hf_logits(again), ref, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- config checks


def _raw(family: str) -> dict:
    from tiny_models import tiny_config

    return tiny_config(family).to_dict()


@pytest.mark.parametrize(
    ("family", "change", "match"),
    [
        ("glm4_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 experts per token exceeds"),
        ("glm4_moe", {"n_group": 3}, "n_group=3 does not divide the 8 experts"),
        ("dots1", {"topk_group": 3}, "topk_group=3 exceeds n_group=2"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
        ("minimax_m2", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ("ernie4_5_moe", {"moe_k": 0}, "moe_k must be a positive int"),
        ("hunyuan_v1_moe", {"moe_topk": [2, 3, 2]}, "moe_topk must be a positive int"),
    ],
)
def test_config_errors_name_the_key(family, change, match) -> None:
    raw = _raw(family) | change
    with pytest.raises(ValueError, match=match):
        check_config(raw)


def test_config_without_a_needed_key(tmp_path) -> None:
    raw = _raw("granitemoe")
    del raw["num_local_experts"]
    with pytest.raises(ValueError, match="lacks 'num_local_experts'"):
        check_config(raw)


@pytest.mark.parametrize(
    ("model_type", "match"),
    [
        ("llama4", "not supported yet: psr lacks the multimodal Llama 4 checkpoint"),
        ("qwen3_5_moe", "not supported yet: psr lacks the multimodal Qwen3.5-MoE"),
        ("mamba", "unsupported architecture 'mamba'; psr supports: olmoe"),
    ],
)
def test_unsupported_families_are_refused_by_name(tmp_path, model_type, match) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(psr.CheckpointError, match=match):
        psr.load(tmp_path, progress=False)


def test_every_entry_has_a_tiny_checkpoint() -> None:
    """Adding a family means an entry plus its test checkpoint: none is left untested."""
    from tiny_models import FAMILIES as OLD

    assert set(FAMILIES) == set(OLD) | set(NEW_FAMILIES)
