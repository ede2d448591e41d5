"""A compact KV cache (issue 39 item 2; psr.runtime.kv_quant): keys and values kept as
int8 / fp8 with an fp32 scale per (token, head), or bf16, for every attention kind that
caches through `update` (GQA, DeepSeek's MLA latent, sliding windows).

Long context against the full-precision cache: a 200-token prompt and 256 greedy tokens
(456 cached tokens, the cache far larger than a decode step's activations) on tiny models
of four families. Measured (this file's greedy loop, float32 compute), max |delta logit|
along the common path / greedy tokens identical:
  qwen3_moe    bf16 4.5e-4 / 256   int8 6.8e-4 / 256   fp8 4.8e-3 / 256
  olmoe        bf16 5.1e-4 / 256   int8 1.4e-3 / 256   fp8 6.5e-3 / 250 (first differs at 60)
  deepseek_v3  bf16 1.4e-4 / 256   int8 6.2e-4 / 256   fp8 4.5e-3 / 256
  gpt_oss      bf16 1.1e-3 / 256   int8 2.6e-3 / 256   fp8 7.7e-3 / 256
so int8 must give every token and stay within 1e-2; fp8 (3 mantissa bits) the first 48
tokens and 90% of them, within 2e-2 up to the first token that differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.load_config import LoadConfig
from psr.runtime.chunked import PromptCache
from psr.runtime.kv import kv_by_kind, kv_format, layer_kinds, output_cache
from psr.runtime.kv_quant import PACKED_LAYERS, new_cache

PROMPT, NEW = 200, 256
FAMILIES = ("qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")  # GQA, GQA, MLA, sliding + full
LONG = {"max_position_embeddings": 1024}
STRICT = {"int8": 1e-2}  # format -> max |delta logit|; every token identical
FP8_TOL, FP8_FIRST, FP8_SHARE = 2e-2, 48, 0.9


@torch.no_grad()
def _greedy(model: Any, ids: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """NEW greedy tokens after prompt `ids` with a cache in `fmt`, and the logits each was
    chosen from `[NEW, V]`."""
    cache = new_cache(model.config, fmt)
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
    tokens, seen = [], []
    for _ in range(NEW):
        seen.append(logits)
        tokens.append(logits.argmax())
        step = tokens[-1].view(1, 1)
        logits = model(input_ids=step, cache=cache, use_cache=True).logits[0, -1]
    return torch.stack(tokens), torch.stack(seen)


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_long_context_matches_the_full_precision_cache(family: str) -> None:
    model = tiny_model(family, **LONG)
    ids = _prompt(PROMPT)
    ref_tokens, ref_logits = _greedy(model, ids, "auto")
    assert ref_tokens.unique().numel() > 3  # not one token repeated
    for fmt in ("int8", "fp8"):  # bf16 measured once (docstring), its bytes tested below
        tokens, logits = _greedy(model, ids, fmt)
        same = tokens == ref_tokens
        first = int((~same).nonzero()[0]) if not same.all() else NEW
        # the same context up to the first token that differs, that one included
        delta = (logits[: first + 1] - ref_logits[: first + 1]).abs().max().item()
        if fmt in STRICT:
            assert same.all() and delta < STRICT[fmt], (fmt, first, delta)
        else:
            assert first >= FP8_FIRST and same.float().mean() >= FP8_SHARE, (fmt, first)
            assert delta < FP8_TOL, (fmt, delta)


def _cache_bytes(cache: Any) -> int:
    tensors = [t for x in cache.layers for t in vars(x).values() if isinstance(t, torch.Tensor)]
    return sum(t.nbytes for t in tensors if t.dim() > 0)  # 0-dim: a window's bookkeeping


@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_plan_counts_what_the_cache_holds(family: str, fmt: str) -> None:
    """After a prefill through psr's forward (which gives it the packed cache), the cache's
    tensors are the bytes psr.runtime.kv counts for the format (a sliding layer's dynamic
    cache keeps window - 1 tokens, as transformers' own)."""
    om = psr.offload(tiny_model(family, **LONG), kv_format=fmt)
    T = 300
    cache = output_cache(om.hf(input_ids=_prompt(T), use_cache=True))
    assert {type(x) for x in cache.layers} <= set(PACKED_LAYERS)
    cfg = om.hf.config
    want = kv_by_kind(cfg, 4, T, fmt)
    if "sliding_attention" in want:
        want["sliding_attention"] = kv_by_kind(cfg, 4, cfg.sliding_window - 1, fmt)[
            "sliding_attention"
        ]
    assert _cache_bytes(cache) == sum(want.values()), (layer_kinds(cfg), want)


def test_deepseek_mla_bytes_per_token() -> None:
    """DeepSeek-V3's MLA (transformers >= 5.24): the 512-value latent and the 64-value rope
    key, one head each, per layer and token: 2304 bytes in float32, 1152 in bf16, 584 in
    int8 / fp8 (576 values + two fp32 scales)."""
    import transformers

    ds = transformers.DeepseekV3Config(
        num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64
    )
    per_layer = {f: sum(kv_by_kind(ds, 4, 1, f).values()) // 61 for f in ("auto", "bf16")}
    per_layer |= {f: sum(kv_by_kind(ds, 2, 1, f).values()) // 61 for f in ("int8", "fp8")}
    assert per_layer == {"auto": 2304, "bf16": 1152, "int8": 584, "fp8": 584}


@pytest.fixture(scope="module")
def olmoe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("kvq") / "olmoe")


def test_a_prompt_cache_hit_with_a_quantized_kv_changes_nothing(olmoe_ckpt: Path) -> None:
    """The packed layers snapshot and restore (chunked.py registers them): a hit gives the
    miss's tokens and logits bit for bit, and the entries hold packed tensors."""
    model = psr.load(olmoe_ckpt, "exact", 0.5, progress=False, kv_format="int8")
    model.set_prefill_chunk(8)
    first = torch.arange(40)[None] * 7 % 64
    second = torch.cat([first, torch.arange(21)[None] * 5 % 64], dim=1)

    def gen(ids: torch.Tensor, cache: PromptCache | None = None) -> tuple[list[int], torch.Tensor]:
        seen: list[torch.Tensor] = []

        def keep(_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            seen.append(scores.clone())
            return scores

        out = model.generate(ids, max_new_tokens=6, logits_processor=keep, prompt_cache=cache)
        return out[0].tolist(), torch.stack(seen)

    miss = gen(second)
    cache = PromptCache(1 << 26)
    gen(first, cache)
    entry = next(iter(cache._entries.values()))
    kind, snap = entry.kv
    layer = snap.layers[0]
    assert kind == "dynamic" and type(layer) in PACKED_LAYERS and layer.keys.dtype == torch.int8
    hit = gen(second, cache)
    assert cache.last_cached == 32
    assert hit[0] == miss[0] and torch.equal(hit[1], miss[1])
    auto = psr.load(olmoe_ckpt, "exact", 0.5, progress=False)
    auto.set_prefill_chunk(8)
    assert auto.generate(second, max_new_tokens=6)[0].tolist() == miss[0]


def test_bad_input_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = r"^kv_format must be one of auto, bf16, int8, fp8, fit; got 'q4'$"
    with pytest.raises(ValueError, match=bad):
        LoadConfig(kv_format="q4")
    with pytest.raises(ValueError, match=r"^kv_format='fp8' cannot run with graphs=True: "):
        LoadConfig(kv_format="fp8", graphs=True)
    # a linear-attention model: refused before any weight is copied
    ckpt = write_checkpoint(tiny_model("qwen3_next"), tmp_path / "next")
    import psr.models.loader as loader

    def no_build(*a: Any, **k: Any) -> None:
        raise AssertionError("weights copied before the kv_format check")

    monkeypatch.setattr(loader, "_build_model", no_build)
    msg = r"^kv_format='int8': the linear_attention layers keep a fixed conv \+ recurrent state"
    with pytest.raises(ValueError, match=msg):
        psr.load(ckpt, progress=False, kv_format="int8")
    assert kv_format("int8").quantized and not kv_format("bf16").quantized


def test_decode_graphs_run_eagerly_and_say_why() -> None:
    """graphs='auto' (or set on later) with a kv_format: no static packed layer, so the
    decode runs eagerly and graph_status says why; the tokens are the eager ones."""
    om = psr.offload(tiny_model("qwen3_moe"), kv_format="int8")
    ids = _prompt(20)
    eager = om.generate(ids, max_new_tokens=4)
    om.graphs = True
    assert torch.equal(om.generate(ids, max_new_tokens=4), eager)
    assert om.graph_status.startswith("off: no static KV cache for this model (kv_format='int8'")


def test_transformers_generate_on_an_offloaded_model_packs_its_cache() -> None:
    """transformers' own `generate` makes an empty DynamicCache: psr's forward packs its
    layers in place, so the tooling decodes with the kv_format too (psr's tokens)."""
    hf = tiny_model("qwen3_moe")
    om = psr.offload(hf, kv_format="int8")
    ids = _prompt(12)
    out = hf.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert {type(x) for x in output_cache(out).layers} == {PACKED_LAYERS[0]}
    assert torch.equal(out.sequences, om.generate(ids, max_new_tokens=4))
