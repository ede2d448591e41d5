"""The fused attention step (csrc/cpu/attention.cpp `rope_attention`, psr.store.
cpu_rope_attention) against its parts done apart: transformers' own rotary embedding
(`apply_rotary_pos_emb`), the keys and values written into the cache by indexing, then
cpu_attention. Bit-identical outputs and cache in float32 and bfloat16, over GQA / MHA, odd
head dims, prefill and decode positions, a window, sinks and thread counts; untouched
cache positions stay as they were; clear errors for bad input."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from psr import store

THREADS = sorted({1, min(2, store.cpu_max_threads())})

# (T new rows, Hq, Hkv, D, start, cache capacity)
CASES = [
    (1, 8, 2, 64, 10, 16),  # a decode step, GQA
    (5, 4, 4, 6, 0, 9),  # a first prefill chunk, MHA, a tiny head dim
    (3, 6, 3, 128, 7, 10),  # a later chunk filling the cache to its capacity
    (7, 2, 1, 10, 4, 40),  # MQA
]


def _case(T, Hq, Hkv, D, start, C, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    ang = (3 * torch.randn(T, D // 2, generator=g)).repeat(1, 2)  # rotate_half's layout
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    kc = torch.randn(1, Hkv, C, D, generator=g).to(dtype)
    vc = torch.randn(1, Hkv, C, D, generator=g).to(dtype)
    return q, k, v, cos, sin, kc, vc


def _apart(q, k, v, cos, sin, kc, vc, start, scale, window=None, sinks=None):
    """The module's way: the rotary embedding, the cache update, then cpu_attention."""
    T = q.shape[0]
    qr, kr = apply_rotary_pos_emb(
        q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None]
    )
    kc[:, :, start : start + T] = kr
    vc[:, :, start : start + T] = v[None].transpose(1, 2)
    n = start + T
    y = store.cpu_attention(
        qr[0].transpose(0, 1), kc[0, :, :n].transpose(0, 1), vc[0, :, :n].transpose(0, 1),
        q_start=start, scale=scale, window=window, sinks=sinks, out_dtype=torch.float32,
    )  # fmt: skip
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("extra", ["plain", "window", "sinks"])
def test_equals_the_parts_done_apart(case, dtype, extra) -> None:
    T, Hq, _, D, start, _ = case
    q, k, v, cos, sin, kc, vc = _case(*case, dtype)
    window = 3 if extra == "window" else None
    sinks = torch.randn(Hq) if extra == "sinks" else None
    kc0, vc0 = kc.clone(), vc.clone()
    want = _apart(q, k, v, cos, sin, kc0, vc0, start, D**-0.5, window, sinks)
    for threads in THREADS:
        kt, vt = kc.clone(), vc.clone()
        got = store.cpu_rope_attention(
            q, k, v, cos, sin, kt[0], vt[0],
            start=start, scale=D**-0.5, window=window, sinks=sinks, threads=threads,
        )  # fmt: skip
        assert got.dtype == torch.float32 and got.shape == (T, Hq, D)
        assert torch.equal(got, want), f"output differs at {threads} threads"
        # the new rows written, every other position as it was
        assert torch.equal(kt, kc0) and torch.equal(vt, vc0)


def test_strided_inputs_and_zero_tokens() -> None:
    """Non-contiguous q / k / v (a projection's views) give the contiguous inputs' result;
    no new rows writes nothing and returns an empty result."""
    q, k, v, cos, sin, kc, vc = _case(2, 4, 2, 8, 3, 8, torch.float32)
    wide = torch.randn(2, 4, 16)
    wide[..., ::2] = q
    a = store.cpu_rope_attention(
        q, k, v, cos, sin, kc[0].clone(), vc[0].clone(), start=3, scale=0.3
    )
    b = store.cpu_rope_attention(
        wide[..., ::2], k, v, cos, sin, kc[0].clone(), vc[0].clone(), start=3, scale=0.3
    )
    assert torch.equal(a, b)
    kt = kc[0].clone()
    y = store.cpu_rope_attention(
        q[:0], k[:0], v[:0], cos[:0], sin[:0], kt, vc[0].clone(), start=8, scale=0.3
    )
    assert y.shape == (0, 4, 8) and torch.equal(kt, kc[0])


def test_bad_input() -> None:
    q, k, v, cos, sin, kc, vc = _case(2, 4, 2, 8, 3, 8, torch.float32)
    K, V = kc[0], vc[0]

    def call(**kw):
        args = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin, "k_cache": K, "v_cache": V}
        args.update(kw)
        start = args.pop("start", 3)
        return store.cpu_rope_attention(**args, start=start, scale=0.3)

    with pytest.raises(ValueError, match=r"start must be an int in \[0, 6\]"):
        call(start=7)
    with pytest.raises(ValueError, match=r"k must be torch\.float32, got torch\.bfloat16"):
        call(k=k.bfloat16())
    with pytest.raises(ValueError, match="q must be float32 or bfloat16"):
        call(q=q.half())
    with pytest.raises(ValueError, match=r"cos \[2, 6\] is not \[2, 8\]"):
        call(cos=cos[:, :6])
    with pytest.raises(ValueError, match=r"k_cache \[2, 8, 6\] is not \[2, 8, 8\]"):
        call(k_cache=torch.zeros(2, 8, 6))
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        call(v_cache=torch.zeros(2, 8, 16)[..., ::2])
    q7, k7, v7, _, _, kc7, vc7 = _case(1, 2, 1, 7, 0, 2, torch.float32)
    one = torch.ones(1, 7)
    with pytest.raises(ValueError, match="head dim must be even"):
        store.cpu_rope_attention(q7, k7, v7, one, one, kc7[0], vc7[0], start=0, scale=1.0)
