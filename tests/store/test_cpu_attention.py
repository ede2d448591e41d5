"""The row-invariant CPU attention (csrc/cpu/attention.cpp, psr.store.cpu_attention) against a
float64 masked softmax written from the definition (causal, sliding window as transformers'
`sliding_window_overlay`, gpt-oss's sinks, GQA, Dk != Dv), on every ISA path; each output row
bit-identical whatever the prompt's chunking, the key count, decode vs prefill and the thread
count; clear errors for bad input."""

from __future__ import annotations

import math

import pytest
import torch

from psr import store

ISAS = store.cpu_isas()
THREADS = sorted({1, min(2, store.cpu_max_threads())})
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(T, L, Hq, Hkv, Dk, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hq, Dk, generator=g).to(dtype)
    k = torch.randn(L, Hkv, Dk, generator=g).to(dtype)
    v = torch.randn(L, Hkv, Dv, generator=g).to(dtype)
    sinks = torch.randn(Hq, generator=g)
    return q, k, v, sinks


def _reference(q, k, v, q_start, scale, window=None, sinks=None) -> torch.Tensor:
    """softmax(scale q k^T masked [+ sink logit]) v in float64, from the definition."""
    T, Hq, _ = q.shape
    L, Hkv, _ = v.shape
    rep = Hq // Hkv
    kd = k.double().repeat_interleave(rep, 1)
    vd = v.double().repeat_interleave(rep, 1)
    s = torch.einsum("thd,lhd->htl", q.double(), kd) * scale
    p = torch.arange(T)[:, None] + q_start
    j = torch.arange(L)[None, :]
    allowed = j <= p
    if window is not None:
        allowed &= j > p - window
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(Hq, T, 1)
        probs = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = s.softmax(-1)
    return torch.einsum("htl,lhd->thd", probs, vd)


CASES = [  # T, L, Hq, Hkv, Dk, Dv, window, sinks
    (1, 300, 4, 4, 24, 20, None, False),
    (3, 301, 8, 2, 40, 36, 64, True),
    (17, 200, 6, 1, 33, 17, None, True),
    (17, 64, 4, 2, 192, 128, 5, False),  # MLA's Dk / Dv
    (3, 40, 2, 2, 16, 16, 1, True),  # window 1: the key at p alone (and the sink)
]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-L{}-H{}x{}-D{}x{}-w{}-s{}".format(*c))
def test_matches_float64_reference(case, dtype) -> None:
    T, L, Hq, Hkv, Dk, Dv, window, with_sinks = case
    q, k, v, sinks = _inputs(T, L, Hq, Hkv, Dk, Dv, dtype)
    sinks = sinks if with_sinks else None
    scale = 1 / math.sqrt(Dk)
    q_start = L - T - 2 if L - T >= 2 else 0  # two keys past the last query: never read
    ref = _reference(q, k, v, q_start, scale, window, sinks)
    for isa in ISAS:
        y = store.cpu_attention(
            q, k, v, q_start=q_start, scale=scale, window=window, sinks=sinks, isa=isa,
            out_dtype=torch.float32,
        )  # fmt: skip
        assert y.shape == (T, Hq, Dv) and y.dtype == torch.float32
        # fp32 scores and sums in another order than float64: errors of a few fp32 ulps of
        # the scores carry into the weights; the output is a mix of |v| <~ 5 values.
        err = float((y.double() - ref).abs().max())
        assert err < 1e-5, (isa, err)  # measured: ~1e-6
    assert store.cpu_attention(q, k, v, q_start=q_start, scale=scale).dtype == dtype


def _cache_view(t: torch.Tensor) -> torch.Tensor:
    """t [L, H, D] as transformers' KV cache holds it: a [H, Lmax, D] buffer, transposed."""
    L, H, D = t.shape
    buf = torch.zeros(H, L + 7, D, dtype=t.dtype)
    buf[:, :L] = t.transpose(0, 1)
    view = buf[:, :L].transpose(0, 1)
    assert view.stride(0) == D and view.stride(2) == 1  # read in place (one head: contiguous)
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "Hq, Hkv, Dk, Dv, window, with_sinks",
    [(8, 2, 40, 24, None, False), (4, 1, 24, 40, 6, True), (12, 3, 128, 128, None, True)],
)
def test_rows_are_invariant(Hq, Hkv, Dk, Dv, window, with_sinks, dtype) -> None:
    """Every chunking of a 23-token prompt (keys up to the chunk's end, or all of them, or a
    cache's strided view), T = 1 decode steps, and thread counts give the whole prompt's
    rows bit for bit, on each ISA path."""
    P, extra = 23, 4
    q, k, v, sinks = _inputs(P, P + extra, Hq, Hkv, Dk, Dv, dtype, seed=3)
    kw = dict(scale=0.125, window=window, sinks=sinks if with_sinks else None)
    for isa in ISAS:
        full = store.cpu_attention(q, k[:P], v[:P], q_start=0, isa=isa, threads=1, **kw)
        for threads in THREADS:
            again = store.cpu_attention(q, k, v, q_start=0, isa=isa, threads=threads, **kw)
            assert torch.equal(again, full), (isa, threads)
        for size in (1, 2, 5, 8, 16):
            for a in range(0, P, size):
                b = min(P, a + size)
                for kk, vv in ((k[:b], v[:b]), (k, v), (_cache_view(k[:b]), _cache_view(v[:b]))):
                    part = store.cpu_attention(q[a:b], kk, vv, q_start=a, isa=isa, **kw)
                    assert torch.equal(part, full[a:b]), (isa, size, a, kk.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "Hq, Hkv, window, with_sinks",
    [(2, 2, None, False), (6, 2, 70, True), (40, 1, 9, False), (3, 1, 64, True)],
    ids=["mha", "gqa3-window70-sinks", "g40-window9", "g3-window64-sinks"],
)
def test_tiles_and_key_blocks_change_no_row(Hq, Hkv, window, with_sinks, dtype) -> None:
    """A prefill's rows share tiles of 32 query rows (32 tokens of one head; 10 tokens of
    three heads and two heads of the next; 32 of a token's 40 heads, then its last 8 with
    the next token's first 24) and blocks of 64 keys, within which rows start (window) and
    end (causal) at different keys: a 150-token prompt's rows equal the same rows as T = 1
    decode steps and in chunks cut across tiles and blocks, bit for bit."""
    P = 150
    q, k, v, sinks = _inputs(P, P, Hq, Hkv, 20, 12, dtype, seed=7)
    kw = dict(scale=0.25, window=window, sinks=sinks if with_sinks else None, threads=1)
    for isa in ISAS:
        full = store.cpu_attention(q, k, v, q_start=0, isa=isa, **kw)
        for t in (0, 1, 31, 32, 63, 64, 65, 100, 127, 128, 149):
            one = store.cpu_attention(q[t : t + 1], k, v, q_start=t, isa=isa, **kw)
            assert torch.equal(one, full[t : t + 1]), (isa, t)
        for a, b in ((0, 33), (33, 97), (97, 150), (5, 6), (64, 128)):
            part = store.cpu_attention(q[a:b], k[:b], v[:b], q_start=a, isa=isa, **kw)
            assert torch.equal(part, full[a:b]), (isa, a, b)
    ref = _reference(q, k, v, 0, 0.25, window, kw["sinks"])
    err = float(
        (store.cpu_attention(q, k, v, q_start=0, out_dtype=torch.float32, **kw).double() - ref)
        .abs()
        .max()
    )
    assert err < 1e-5, err


def test_different_isas_agree_closely() -> None:
    q, k, v, sinks = _inputs(5, 50, 4, 2, 40, 40, torch.float32, seed=5)
    ys = [store.cpu_attention(q, k, v, q_start=45, scale=0.2, sinks=sinks, isa=isa) for isa in ISAS]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=0, atol=1e-5)


def test_zero_tokens() -> None:
    q, k, v, _ = _inputs(0, 3, 2, 1, 8, 8, torch.float32)
    assert store.cpu_attention(q, k, v, q_start=3, scale=1.0).shape == (0, 2, 8)


def _bad(match: str, **over) -> None:
    q, k, v, _ = _inputs(2, 6, 4, 2, 8, 8, torch.float32)
    kw = dict(q=q, k=k, v=v, q_start=4, scale=1.0)
    kw.update(over)
    with pytest.raises(ValueError, match=match):
        store.cpu_attention(
            kw.pop("q"), kw.pop("k"), kw.pop("v"), q_start=kw.pop("q_start"),
            scale=kw.pop("scale"), **kw,
        )  # fmt: skip


def test_bad_input() -> None:
    q, k, v, _ = _inputs(2, 6, 4, 2, 8, 8, torch.float32)
    _bad("q must be a 3-D CPU tensor", q=q[0])
    _bad("k must be float32", k=k.to(torch.float64))
    _bad("v must be a 3-D", v=[1.0])
    _bad("do not match q", k=k[:, :, :4])
    _bad("do not match q", v=v[:5])
    _bad("4 query heads are not a multiple of 3 kv heads", k=k[:, :1].expand(6, 3, 8),
         v=v[:, :1].expand(6, 3, 8))  # fmt: skip
    _bad("6 keys do not reach the last query at position 6", q_start=5)
    _bad("q_start must be an int >= 0", q_start=-1)
    _bad("q_start must be an int >= 0", q_start=1.0)
    _bad("window must be None or an int >= 1", window=0)
    _bad("scale must be a float", scale=None)
    _bad(r"sinks must be a CPU tensor \[Hq=4\]", sinks=torch.zeros(2))
    _bad("sinks must be float", sinks=torch.zeros(4, dtype=torch.int64))
    _bad("threads must be an int", threads=0)
    with pytest.raises(ValueError, match="isa 'nope' is not available"):
        store.cpu_attention(q, k, v, q_start=4, scale=1.0, isa="nope")
