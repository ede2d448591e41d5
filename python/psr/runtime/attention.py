"""Row-invariant attention on the CPU: each query row computed on its own against exactly
the keys it sees, so its output does not depend on how a prompt is chunked (a decode
step's one query is the same computation as that row inside any prefill chunk).

`rows_attention` is the one function (its signature and semantics are the CPU attention
kernel's, `cpu_attention`, which replaces it); `ATTENTION` ("psr_rows") is the name it is
registered under in transformers' attention interface (`register`), which models set as
their `_attn_implementation` while their CPU forward is row-invariant (runtime/model.py).
It reads the keys the cache update returned: the whole dynamic cache of the layer (the
queries are its last rows), never a static cache (graphs keep sdpa).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = "psr_rows"


def rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_start: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries `q [T, Hq, Dk]` over keys `k [L, Hkv, Dk]` and values
    `v [L, Hkv, Dv]`: query t sits at key position `q_start + t` and sees the keys up to it,
    the last `window` of them with a sliding window (transformers': key j is seen from
    position p when p - window < j <= p); `sinks [Hq]` (gpt-oss) add one logit per head to
    each softmax's denominator; grouped-query heads (Hq a multiple of Hkv, query head h
    reads kv head h // (Hq / Hkv)). Each row is one call over exactly its keys (the same
    shape whatever T: bit-identical for any chunking). Returns `[T, Hq, Dv]` in q's dtype."""
    T, Hq, Dk = q.shape
    L, Hkv, Dv = k.shape[0], k.shape[1], v.shape[2]
    if Hq % Hkv or k.shape[2] != Dk or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"rows_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit"
        )
    if q_start < 0 or q_start + T > L:
        raise ValueError(f"rows_attention: rows [{q_start}, {q_start + T}) outside {L} keys")
    g = Hq // Hkv
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
    sink = None if sinks is None else sinks.reshape(Hkv, g, 1).float()
    out = q.new_empty(T, Hq, Dv)
    for t in range(T):
        p = q_start + t
        lo = 0 if window is None else max(0, p - window + 1)
        qt = q[t].reshape(Hkv, g, Dk)  # the query heads of one kv head as g queries
        kt, vt = kh[:, lo : p + 1], vh[:, lo : p + 1]
        if sink is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        else:
            s = torch.matmul(qt.float(), kt.float().transpose(1, 2)) * scale
            s = torch.cat([s, sink], dim=-1)
            w = torch.softmax(s - s.amax(-1, keepdim=True), dim=-1)[..., :-1]
            o = torch.matmul(w.to(vt.dtype), vt)
        out[t] = o.reshape(Hq, Dv)
    return out


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
