"""Batch-1 decoding with transformers' KV cache: teacher-forced logits and generation.

The model's own forward does the work (psr's modules sit inside it); this module only
drives it one token at a time, so every decode step runs under the routing policy.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm


def cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.2x calls the KV cache argument `cache`, earlier `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _out_cache(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


@torch.no_grad()
def decode_logits(hf: nn.Module, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits `[1, T, V]`: prefill `ids[:, :prompt_len]`, then one decode step per token."""
    kv_name = cache_kwarg(hf)
    out = hf(input_ids=ids[:, :prompt_len], use_cache=True)
    logits = [out.logits]
    for t in range(prompt_len, ids.shape[1]):
        out = hf(input_ids=ids[:, t : t + 1], use_cache=True, **{kv_name: _out_cache(out)})
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


@torch.no_grad()
def generate(
    hf: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Greedy (default) or sampled decoding of `ids [1, T]`; returns `[1, T + new]`."""
    if max_new_tokens == 0:
        return ids
    kv_name = cache_kwarg(hf)
    gen = torch.Generator().manual_seed(seed)
    out = hf(input_ids=ids, use_cache=True)
    for i in tqdm(range(max_new_tokens), disable=not progress, desc="decode", leave=False):
        logits = out.logits[0, -1].float()
        nxt = sample(logits, gen, temperature, top_k, top_p) if do_sample else logits.argmax()
        ids = torch.cat([ids, nxt.view(1, 1).to(ids.device)], dim=1)
        if (eos_token_id is not None and int(nxt) == eos_token_id) or i == max_new_tokens - 1:
            break
        out = hf(input_ids=ids[:, -1:], use_cache=True, **{kv_name: _out_cache(out)})
    return ids


def sample(
    logits: torch.Tensor, gen: torch.Generator, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """One token id from `logits [V]`: temperature, then top-k, then nucleus (top-p)."""
    logits = (logits / temperature).cpu()
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1:
        sp, si = probs.sort(descending=True)
        drop = sp.cumsum(0) - sp > top_p
        probs[si[drop]] = 0
        probs /= probs.sum()
    return torch.multinomial(probs, 1, generator=gen)[0]
