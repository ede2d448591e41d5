"""psr's KV accounting (psr.runtime.kv.CACHE_KINDS) against the caches transformers really
fills: a tiny model of every family runs a forward, and the bytes of its cache tensors
are what `kv_bytes` states, per attention kind (MHA/GQA, DeepSeek's MLA latent, sliding
and chunked windows, Gated DeltaNet's fixed state)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from tiny_models import tiny_config

from psr.models.families import FAMILIES
from psr.runtime.kv import CACHE_KINDS, kv_by_kind, kv_bytes, layer_kinds


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.dim() > 0 else []  # 0-dim: the layer's bookkeeping (its window)
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors(v)]
    return []


def _cache_bytes(cache: Any) -> int:
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in _tensors(vars(layer))
    )


def _run(family: str, tokens: int, static: bool) -> tuple[Any, int]:
    import transformers

    cfg = tiny_config(family)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    text = getattr(cfg, "text_config", None) or cfg
    ids = torch.randint(0, min(int(text.vocab_size), 30), (1, tokens))
    if static:
        cache: Any = transformers.StaticCache(config=cfg, max_cache_len=tokens)
    else:
        cache = transformers.DynamicCache(config=cfg)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(ids, cache=cache, use_cache=True)
    return cfg, _cache_bytes(cache)


def _tokens(cfg: Any) -> int:
    """More tokens than any window of the model holds."""
    text = getattr(cfg, "text_config", None) or cfg
    windows = [getattr(text, k, None) or 0 for k in ("sliding_window", "attention_chunk_size")]
    return max(12, *(2 * int(w) + 3 for w in windows if w < 64))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kv_bytes_are_what_the_static_cache_holds(family: str) -> None:
    """transformers' static cache (psr's decode graphs) of `tokens` tokens holds exactly
    what kv_bytes states; the dynamic cache the same where no layer has a window (a
    sliding layer keeps window - 1 tokens there)."""
    cfg = tiny_config(family)
    n = _tokens(cfg)
    cfg, got = _run(family, n, static=True)
    assert got == kv_bytes(cfg, 4, n), (family, layer_kinds(cfg), got)
    kinds = set(layer_kinds(cfg))
    if not kinds & {"sliding_attention", "chunked_attention"}:
        _, dyn = _run(family, n, static=False)
        assert dyn == got, (family, dyn, got)


def test_mla_caches_the_latent_not_the_heads() -> None:
    """DeepSeek-V3's cache: kv_lora_rank + qk_rope_head_dim values per token and layer
    (transformers >= 5.24), far less than the per-head keys and values; at DeepSeek-V3's
    shapes 576 values: 137 MiB per 1024 tokens in float32 over 61 layers."""
    cfg, got = _run("deepseek_v3", 10, static=False)
    per = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert got == cfg.num_hidden_layers * per * 10 * 4
    assert set(layer_kinds(cfg)) == {"mla"}
    import transformers

    ds = transformers.DeepseekV3Config(
        num_hidden_layers=61,
        num_attention_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )
    assert kv_bytes(ds, 4, 1024) == 61 * 576 * 4 * 1024  # 137.25 MiB
    expanded = CACHE_KINDS["mla_expanded"].per_token(ds)
    assert expanded == 128 * (192 + 128) and expanded > 70 * 576


def test_windows_and_states_do_not_grow() -> None:
    """Sliding layers stop at their window, linear-attention layers hold a fixed state."""
    oss = tiny_config("gpt_oss")
    w = int(oss.sliding_window)
    a, b = kv_by_kind(oss, 2, 10 * w), kv_by_kind(oss, 2, 20 * w)
    assert a["sliding_attention"] == b["sliding_attention"]
    assert b["full_attention"] == 2 * a["full_attention"]
    nxt = tiny_config("qwen3_next")
    a, b = kv_by_kind(nxt, 4, 100), kv_by_kind(nxt, 4, 1000)
    assert a["linear_attention"] == b["linear_attention"] > 0
