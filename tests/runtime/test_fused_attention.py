"""The fused attention forward of the row-invariant CPU forward (runtime/attention.py
`fuse`, the kernel `cpu_rope_attention`): each audited family's attention computed in one
kernel call gives the logits and KV cache of the module's own forward bit for bit, in
float32 and bfloat16, over prefill chunks and decode steps; the table of audited forwards
covers the families it should and no other; switching the row-invariant forward off takes
it back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.runtime import attention
from psr.runtime.chunked import PromptCache
from psr.store import cpu_kernels

# family -> the audited forward its attention class has (None: none, the module's own)
KINDS = {
    "olmoe": "OlmoeAttention",
    "qwen2_moe": "LlamaAttention",
    "qwen3_moe": "Qwen3Attention",
    "mixtral": "MistralAttention",
    "deepseek_v3": None,
}
# config changes that reach a kind's option: OLMoE's clamp (a sliding window makes the
# cache's layers sliding ones, which the fused forward leaves to the module's own)
CONFIG = {"olmoe": {"clip_qkv": 0.5}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    return {
        f: write_checkpoint(tiny_model(f, **CONFIG.get(f, {})), root / f)
        for f in ("olmoe", "qwen2_moe", "qwen3_moe", "mixtral")
    }


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """How many times the fused kernel runs."""
    n = [0]
    kernel = cpu_kernels.cpu_rope_attention

    def counted(*a, **kw):
        n[0] += 1
        return kernel(*a, **kw)

    monkeypatch.setattr(cpu_kernels, "cpu_rope_attention", counted)
    return n


def _run(model: psr.OffloadedModel, ids: torch.Tensor):
    """Logits of a prompt prefilled in chunks of 5 then decoded a token at a time, and the KV
    cache after the prompt (the prompt cache's entry at its end)."""
    model.set_prefill_chunk(5)
    logits = model.decode_logits(ids, 12)
    cache = PromptCache(1 << 30)
    model.generate(ids, max_new_tokens=1, prompt_cache=cache)
    at, entry = cache.lookup(model._prefill_key(False), torch.cat([ids[0], ids[0, :1]]))
    assert at == ids.shape[1] and entry is not None
    return logits, [(x.keys.clone(), x.values.clone()) for x in entry.kv[1].layers]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "qwen3_moe", "mixtral"])
def test_fused_equals_the_module_forward(ckpts, family, dtype, calls) -> None:
    with psr.load(ckpts[family], "exact", 1.0, device="cpu", dtype=dtype, progress=False) as m:
        m.set_row_invariant(True)
        layers = m.config.num_hidden_layers
        ids = torch.randint(
            0, m.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3)
        )
        fused = _run(m, ids)
        # every layer of every forward: 3 prefill chunks + 8 decode steps, then the
        # generate's 4 chunks (chunk 5 over 20 tokens)
        assert calls[0] == layers * (3 + 8 + 4)
        assert attention.fuse(m.hf, False) == layers
        calls[0] = 0
        own = _run(m, ids)
        assert calls[0] == 0
        assert torch.equal(fused[0], own[0]), "logits differ from the module's forward"
        for (k, v), (k0, v0) in zip(fused[1], own[1], strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0), "KV differs"


def test_the_table_covers_its_families() -> None:
    import importlib

    for family, want in KINDS.items():
        cfg = tiny_model(family).config
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        cls = next(
            c for n, c in vars(mod).items()
            if n.endswith("Attention") and isinstance(c, type) and c.__module__ == mod.__name__
        )  # fmt: skip
        kind = attention.fused_kind(cls)
        assert (kind and kind.cls) == want, (family, cfg.model_type)


def test_off_with_the_row_invariant_forward(ckpts) -> None:
    """The fused classes come and go with the row-invariant forward; off, nothing runs fused
    (its forward is the plain one)."""
    with psr.load(ckpts["qwen3_moe"], "exact", 1.0, device="cpu", progress=False) as m:
        fused = lambda: sum(type(x) in attention._UNFUSED for x in m.hf.modules())  # noqa: E731
        assert fused() == 0
        m.set_row_invariant(True)
        assert fused() == m.config.num_hidden_layers
        m.set_row_invariant(False)
        assert fused() == 0
