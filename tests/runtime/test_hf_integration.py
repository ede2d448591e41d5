"""psr inside the transformers ecosystem: checkpoints of offloaded models, restore, and a
`generate` that takes transformers-style calls (tokenizer output, streamers, configs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint, write_tokenizer
from torch import nn

import psr

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
ROUND_TRIP = ("olmoe", "qwen3_moe", "mixtral", "deepseek_v3")


def logits(model: nn.Module, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def from_pretrained(path: Path) -> nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def assert_plain(hf: nn.Module, experts_type: type) -> None:
    """No trace of psr left in a restored model."""
    assert not hasattr(hf, "psr_runtime") and not hasattr(hf, "psr_installation")
    assert "forward" not in hf.__dict__
    for layer in hf.model.layers:
        assert not layer.post_attention_layernorm._forward_pre_hooks
        if hasattr(layer.mlp, "experts"):
            assert type(layer.mlp.experts) is experts_type
    assert not any(p.is_meta for p in hf.parameters())


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_offloaded_models_save_restore_and_offload_again(tmp_path, family) -> None:
    hf = tiny_model(family)
    ref, names = logits(hf), set(hf.state_dict())
    experts_type = type(hf.model.layers[-1].mlp.experts)

    # psr.offload: the state dict names what the model had; a direct save_pretrained of the
    # transformers model writes a checkpoint transformers reloads exactly.
    om = psr.offload(hf, policy="exact", residency=0.5, progress=False)
    assert set(hf.state_dict()) == names
    hf.save_pretrained(tmp_path / "offloaded")
    torch.testing.assert_close(
        logits(from_pretrained(tmp_path / "offloaded")), ref, rtol=0, atol=1e-5
    )

    # restore: the original modules, bit-identical logits, offloadable again (once).
    assert psr.restore(hf) is hf and om.closed
    assert_plain(hf, experts_type)
    with pytest.raises(psr.StoreError, match="closed"):  # the wrapper does not run it unoffloaded
        om.generate(PROMPT, 2)
    assert torch.equal(logits(hf), ref)
    again = psr.offload(hf, policy="exact", residency=0.5, progress=False)
    torch.testing.assert_close(again(PROMPT), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="already offloaded"):
        psr.offload(hf, progress=False)

    # psr.load: experts never materialised in the module; saving and restoring still work.
    write_tokenizer(tmp_path / "offloaded")
    loaded = psr.load(tmp_path / "offloaded", policy="psr", residency=0.5, progress=False)
    loaded.save_pretrained(tmp_path / "loaded")
    assert (tmp_path / "loaded" / "tokenizer.json").exists()
    torch.testing.assert_close(logits(from_pretrained(tmp_path / "loaded")), ref, rtol=0, atol=1e-5)
    plain = loaded.restore()
    assert_plain(plain, experts_type)
    torch.testing.assert_close(logits(plain), ref, rtol=0, atol=1e-5)
    psr.offload(plain, policy="exact", residency=0.5, progress=False)


def test_saving_reads_the_host_store_without_copying_it(tmp_path) -> None:
    """The state dict's experts are views of the host store, each with a storage of its
    own, so save_pretrained's alias handling does not clone them all at once."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    hf = tiny_model("olmoe")
    om = psr.offload(hf, progress=False)
    sd = hf.state_dict()
    host = om.runtime.store.host(0)
    gate_up, down = (
        sd["model.layers.0.mlp.experts.gate_up_proj"],
        sd["model.layers.0.mlp.experts.down_proj"],
    )
    assert gate_up.data_ptr() == host.data_ptr()
    assert down.data_ptr() == host[0, 2 * 16 * 32 :].data_ptr()
    ptrs = {k: v.data_ptr() for k, v in sd.items()}
    kept = remove_tied_weights_from_state_dict(dict(sd), hf)
    assert {k: v.data_ptr() for k, v in kept.items()} == ptrs


class PerExpertExperts(nn.ModuleList):
    """Experts as one module per expert (Mixtral's w1 / w3 / w2), as older transformers and
    remote-code models have them."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        E, F2, H = fused.gate_up_proj.shape
        for e in range(E):
            ex = nn.Module()
            ex.w1, ex.w3, ex.w2 = (
                nn.Linear(H, F2 // 2, False),
                nn.Linear(H, F2 // 2, False),
                nn.Linear(F2 // 2, H, False),
            )
            with torch.no_grad():
                ex.w1.weight.copy_(fused.gate_up_proj[e, : F2 // 2])
                ex.w3.weight.copy_(fused.gate_up_proj[e, F2 // 2 :])
                ex.w2.weight.copy_(fused.down_proj[e])
            self.append(ex)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for w, e in zip(weights[t], ids[t].tolist(), strict=True):
                ex = self[e]
                out[t] += w * ex.w2(nn.functional.silu(ex.w1(x[t])) * ex.w3(x[t]))
        return out


def test_per_expert_modules_come_back_in_their_own_layout() -> None:
    hf = tiny_model("olmoe")
    for layer in hf.model.layers:
        layer.mlp.experts = PerExpertExperts(layer.mlp.experts)
    ref, weights = logits(hf), {k: v.clone() for k, v in hf.state_dict().items()}
    psr.offload(hf, policy="exact", residency=0.5, progress=False)
    sd = hf.state_dict()
    assert set(sd) == set(weights) and "model.layers.2.mlp.experts.7.w3.weight" in sd
    assert all(torch.equal(sd[k], v) for k, v in weights.items())
    psr.restore(hf)
    assert_plain(hf, PerExpertExperts)
    assert all(torch.equal(v, weights[k]) for k, v in hf.state_dict().items())
    assert torch.equal(logits(hf), ref)


def test_restore_and_save_refuse_what_they_cannot_do(tmp_path) -> None:
    hf = tiny_model("olmoe")
    with pytest.raises(RuntimeError, match="is not offloaded by psr"):
        psr.restore(hf)
    om = psr.offload(hf, progress=False)
    om.close()
    with pytest.raises(RuntimeError, match="expert store is closed"):
        om.save_pretrained(tmp_path / "x")
    with pytest.raises(RuntimeError, match="expert store is closed"):
        psr.restore(om)
    assert hasattr(hf, "psr_runtime")  # nothing undone
    with pytest.raises(RuntimeError, match="is not offloaded by psr"):
        psr.restore(tiny_model("olmoe"))


# --------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("gen") / "olmoe")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(ckpt) -> nn.Module:
    return from_pretrained(ckpt)


def load(path: Path) -> psr.OffloadedModel:
    return psr.load(path, policy="exact", residency=0.5, progress=False)


class Collect:
    """A transformers streamer (BaseStreamer protocol) that records its calls."""

    def __init__(self) -> None:
        self.puts: list[list] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.tolist())

    def end(self) -> None:
        self.ends += 1


def test_generate_takes_tokenizer_output_and_a_streamer(ckpt, reference) -> None:
    model = load(ckpt)
    enc = model.tokenizer("To be, or not", return_tensors="pt")
    streamer = Collect()
    out = model.generate(**enc, max_new_tokens=8, streamer=streamer)
    assert out.tolist() == model.generate(enc["input_ids"], 8).tolist()
    assert model.stats["tokens"] == 2 * 7  # decode steps of both calls
    want = Collect()
    ref = reference.generate(**enc, max_new_tokens=8, do_sample=False, streamer=want)
    assert out.tolist() == ref.tolist()
    # transformers' protocol: the prompt, then each new token; then end() once.
    assert streamer.puts == want.puts and streamer.ends == want.ends == 1
    T = enc["input_ids"].shape[1]
    assert [p[0] for p in streamer.puts[1:]] == out[0, T:].tolist()


def test_generation_config_sampling_is_transformers_sampling(ckpt, reference) -> None:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=3, temperature=0.7)
    model = load(ckpt)
    runs = [model.generate(PROMPT, generation_config=cfg, seed=s) for s in (1, 2, 3)]
    assert all(r.shape == (1, PROMPT.shape[1] + 5) for r in runs)
    assert model.generate(PROMPT, generation_config=cfg, seed=2).tolist() == runs[1].tolist()
    for s, r in zip((1, 2, 3), runs, strict=True):
        with torch.random.fork_rng():
            torch.manual_seed(s)
            assert reference.generate(PROMPT, generation_config=cfg).tolist() == r.tolist()
        steps = model.decode_logits(r, PROMPT.shape[1])[0, PROMPT.shape[1] - 1 : -1]
        top3 = steps.topk(3).indices
        assert all(int(t) in top3[i].tolist() for i, t in enumerate(r[0, PROMPT.shape[1] :]))
    # Explicit arguments win over the config's fields.
    assert model.generate(PROMPT, 2, generation_config=cfg).shape[1] == PROMPT.shape[1] + 2


def test_eos_list_stops_at_the_first_listed_token(ckpt) -> None:
    model = load(ckpt)
    T = PROMPT.shape[1]
    new = model.generate(PROMPT, 8)[0, T:].tolist()
    j = next(j for j in range(1, 8) if new[j] not in new[:j])
    unused = next(t for t in range(64) if t not in new)
    out = model.generate(PROMPT, 8, eos_token_id=[unused, new[j]])
    assert out[0, T:].tolist() == new[: j + 1]


def test_generate_refuses_what_it_cannot_do(ckpt) -> None:
    from transformers import GenerationConfig

    model = load(ckpt)
    ids = PROMPT
    with pytest.raises(ValueError, match="attention_mask has padding"):
        model.generate(ids, 2, attention_mask=torch.cat([torch.zeros(1, 2), torch.ones(1, 10)], 1))
    with pytest.raises(ValueError, match=r"batch 1\); input_ids has shape \[2, 12\]"):
        model.generate(ids.repeat(2, 1), 2, attention_mask=torch.ones(2, 12))
    with pytest.raises(ValueError, match="num_beams=2: psr decodes one sequence"):
        model.generate(ids, 2, num_beams=2)
    with pytest.raises(ValueError, match="num_beams=2"):
        model.generate(ids, generation_config=GenerationConfig(num_beams=2))
    with pytest.raises(ValueError, match="num_return_sequences=3"):
        model.generate(ids, 2, do_sample=True, num_return_sequences=3)
    with pytest.raises(ValueError, match=r"repetition_penalty=1\.2: psr's generate does not"):
        model.generate(ids, 2, repetition_penalty=1.2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beams'"):
        model.generate(ids, 2, beams=2)
    assert model.stats["tokens"] == 0  # nothing ran
