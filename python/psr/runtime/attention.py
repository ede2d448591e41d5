"""Row-invariant attention on the CPU: each query row computed on its own against exactly
the keys it sees, so its output does not depend on how a prompt is chunked (a decode
step's one query is the same computation as that row inside any prefill chunk).

`rows_attention` is the one function (the CPU attention kernel, `cpu_attention`);
`ATTENTION` ("psr_rows") is the name it is registered under in transformers' attention
interface (`register`), which models set as their `_attn_implementation` while their
CPU forward is row-invariant (runtime/model.py). It reads the keys the cache update
returned: the whole dynamic cache of the layer (the queries are its last rows), never a
static cache (graphs keep sdpa).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psr.store import cpu_kernels

ATTENTION = "psr_rows"


# The one function: the CPU attention kernel (psr.store.cpu_attention documents its causal,
# sliding-window, sinks and grouped-query semantics and why each row is invariant).
rows_attention = cpu_kernels.cpu_attention


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over `rows_attention`: query `[B, Hq, T, D]`, the
    updated cache's keys and values `[B, Hkv, L, D]` (the queries are its last T rows);
    returns `[B, T, Hq, Dv]` as the interface does. No mask: none is built for this
    implementation, the causal structure is rows_attention's."""
    B, _, T, D = query.shape
    L = key.shape[2]
    scale = D**-0.5 if scaling is None else scaling
    outs = [
        rows_attention(
            query[b].transpose(0, 1),
            key[b].transpose(0, 1),
            value[b].transpose(0, 1),
            q_start=L - T,
            scale=scale,
            window=sliding_window,
            sinks=s_aux,
        )
        for b in range(B)
    ]
    return torch.stack(outs), None


def register() -> None:
    """Register `ATTENTION` in transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


# Layer kinds rows_attention computes (transformers' config.layer_types); any other kind
# (linear attention, Llama 4's chunked attention) leaves a model's forward not row-invariant.
ROW_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def why_not_rows(config: Any) -> str | None:
    """Why a model's attention cannot run as `rows_attention` (None: it can)."""
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    other = sorted(types - ROW_LAYER_TYPES)
    if other:
        return f"attention layers of kind {', '.join(other)}"
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention"
    return None
