"""psr.load of GGUF files end to end: experts kept in the file's blocks (each type, and a
Q4_K_M-like mixed file), equal to transformers on the float twin (gguf-py's dequantization
of the same bytes) in logits and greedy tokens, on the CPU kernels and the Triton path;
every policy deterministic under copy delays; the bytes the store holds and copies are the
file's; save / restore refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import gguf_tiny_model, hf_tokenizer, twin_model, write_gguf

import psr
import psr_kernels as pk
from psr.models.gguf import GGUFCheckpoint

PROMPT = torch.tensor([[1, 50, 7, 900, 33, 2000, 12, 5]])
NEW = 4
# One file per expert type (dense in F32: the experts are what is tested), and a mixed one.
TYPES = (
    *("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"),
    *("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"),
    *("IQ1_S", "IQ1_M"),
)
MIXED = {
    "gate": "Q4_K",
    "up": "Q4_K",
    "down": lambda layer: "Q6_K" if layer == 0 else "Q8_0",
    "dense": "Q8_0",
}


@pytest.fixture(scope="module")
def model_and_files(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gguf_load")
    model = gguf_tiny_model("qwen3_moe", head_dim=32)
    tok = hf_tokenizer()
    files = {}
    for name, types in [*((t, {"experts": t, "dense": "F32"}) for t in TYPES), ("mixed", MIXED)]:
        path = root / f"{name}.gguf"
        twin = write_gguf(model, path, types, tokenizer=tok)
        files[name] = (path, twin_model(model, twin))
    return model, files


def _reference(twin, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = twin(input_ids=PROMPT).logits
        tokens = twin.generate(PROMPT, max_new_tokens=new, do_sample=False)
    return logits, tokens


def _check(path: Path, twin, compute: str, new: int = NEW, **kw) -> psr.OffloadedModel:
    want_logits, want_tokens = _reference(twin, new)
    kw.setdefault("cpu_dot", "f32")  # the twin's fp32 activations (q8 rounds them to 8 bits)
    model = psr.load(
        path, "exact", residency=0.5, device="cpu", compute=compute, progress=False, **kw
    )
    torch.testing.assert_close(model(PROMPT), want_logits, rtol=3e-4, atol=3e-4)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=new), want_tokens)
    return model


@pytest.mark.parametrize("name", [*TYPES, "mixed"])
def test_exact_equals_transformers_on_the_twin(model_and_files, name: str) -> None:
    path, twin = model_and_files[1][name]
    model = _check(path, twin, "torch")
    rt = model.runtime
    ck = GGUFCheckpoint(path)
    rows = []
    for i, d in enumerate(ck.moe_layers()):
        et = ck.expert_tensors(d)
        assert rt.expert_formats[i] == pk.ggml_format(
            *(et[p].ggml_type for p in ("gate", "up", "down"))
        )
        lay = pk.GGMLLayout.of(rt.expert_formats[i], rt.spec.hidden_size, rt.spec.ffn_size)
        host = rt.store.host(i)
        for e in (0, rt.spec.num_experts - 1):  # the store holds the file's bytes
            for p, off in (("gate", lay.gate), ("up", lay.up), ("down", lay.down)):
                raw = et[p].expert(e)
                assert torch.equal(host[e, off : off + raw.numel()], raw), (name, d, e, p)
        rows.append(lay.nbytes)
    ck.close()
    mem = model.memory()
    assert mem["host_experts"] == sum(r * rt.spec.num_experts for r in rows)
    # copies are priced at each layer's own row bytes
    s = model.stats
    assert (s["bytes_copied"] > 0 and s["bytes_copied"] % min(rows) == 0) or len(set(rows)) > 1
    if name == "mixed":
        assert len(set(rt.expert_formats)) == 2  # Q6_K down in layer 0, Q8_0 in layer 1
    model.close()


def test_triton_path_equals_transformers(model_and_files) -> None:
    """The mixed file (Q4_K, Q6_K and Q8_0 experts; each type's kernel is tested alone in
    tests/kernels/test_ggml.py): two decode tokens under the interpreter. Dense weights
    float: the dense kernels' Triton path is tests/runtime/test_dense.py's."""
    path, twin = model_and_files[1]["mixed"]
    _check(path, twin, "triton", new=2, dense_format="float").close()


def test_every_policy_is_deterministic_under_copy_delays(model_and_files, monkeypatch) -> None:
    path, _ = model_and_files[1]["mixed"]
    policies = [("exact", {}), ("cache-prior", {"lam": 0.5}), ("psr", {"lam": 0.5, "n": 2})]
    misses = {}
    for policy, kw in policies:
        out = []
        for delay in (0, 2000):
            monkeypatch.setenv("PSR_COPY_DELAY_US", str(delay))
            monkeypatch.setenv("PSR_COPY_DELAY_SEED", "7")
            with psr.load(path, policy, residency=0.5, device="cpu", progress=False, **kw) as m:
                tokens = m.generate(PROMPT, max_new_tokens=NEW)
                logits = m.decode_logits(tokens, PROMPT.shape[1])
                s = m.stats
                out.append((tokens, logits, s["hits"], s["misses"], s["prefetches"]))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]), policy
        assert out[0][2:] == out[1][2:], policy
        misses[policy] = out[0][3]
    assert misses["psr"] <= misses["exact"], misses


def test_gguf_store_refuses_restore_save_and_requantizing(model_and_files, tmp_path) -> None:
    path, _ = model_and_files[1]["Q4_K"]
    with pytest.raises(ValueError, match="experts stay in their own blocks"):
        psr.load(path, "exact", device="cpu", expert_format="int8", progress=False)
    with pytest.raises(ValueError, match=r"speculative decoding .* a GGUF file has none"):
        psr.load(path, "exact", device="cpu", speculative="block", progress=False)
    model = psr.load(path, "exact", device="cpu", progress=False)
    assert model.tokenizer is not None and model.tokenizer.decode([50]) == hf_tokenizer().decode(
        [50]
    )
    with pytest.raises(RuntimeError, match="GGUF file's blocks"):
        model.save_pretrained(tmp_path / "out")
    with pytest.raises(RuntimeError, match="GGUF file's blocks"):
        model.restore()


ARCH_FAMILIES = (
    "qwen2_moe",
    "olmoe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "deepseek_v3",
    "deepseek_v2",
)


@pytest.mark.parametrize("family", ARCH_FAMILIES)
def test_every_gguf_architecture_equals_transformers(tmp_path: Path, family: str) -> None:
    """Each architecture llama.cpp writes that psr's family table has: Q8_0 experts (MXFP4 for
    gpt-oss, as its files ship), Q8_0 dense, against the twin."""
    model = gguf_tiny_model(family)
    experts = "MXFP4" if family == "gpt_oss" else "Q8_0"
    path = tmp_path / f"{family}.gguf"
    twin = twin_model(model, write_gguf(model, path, {"experts": experts, "dense": "Q8_0"}))
    _check(path, twin, "torch", new=2).close()
