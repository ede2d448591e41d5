"""The q8 path of the CPU kernels on GGUF blocks (csrc/cpu/ggml_qdot.h, qdot_avx512.inc):
activations quantized once per call to their weights' vec_dot type (Q8_K / Q8_0) and
integer block dots, as llama.cpp does.

- the quantizers: byte-exact against a torch reference of llama.cpp's rounding
  (quantize_row_q8_K: the first value of largest magnitude, iscale = -127 / max, round
  half to even, min 127, 16-value sums; Q8_0: d = amax / 127 as fp16, x * 127 / amax
  rounded half to even) on every ISA path, ties and all-zero blocks included;
- the integer dots: within a tight bound of a float64 sum over the exact integer block
  sums (numpy), on every ISA path, with and without VNNI (the same bits);
- every output row bit-identical to the token computed alone for T = 1..600, tilings and
  1 / 2 threads (cpu_linear and the expert FFN);
- the activation rounding's cost against the fp32 path stays small.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_blocks import expert_rows, random_blocks

import psr_kernels as pk
from psr import store
from psr.store.cpu_kernels import cpu_has_vnni, cpu_quantize_act

ISAS = store.cpu_isas()
THREADS = sorted({1, min(2, store.cpu_max_threads())})
Q8_K, Q8_0 = 15, 8
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0"]  # the types with a vec_dot type
DOTS = ["q8", "q8_madd"]  # q8_madd: AVX-512 without vpdpbusd (scalar / AVX2: as q8)


def ref_quant(x: torch.Tensor, act: int) -> np.ndarray:
    """llama.cpp's rounding in torch float32 ops: the bytes of the quantized row."""
    x = x.to(torch.float32)
    if act == Q8_K:
        b = x.view(-1, 256)
        idx = b.abs().argmax(dim=1)  # the first index of the largest magnitude
        mx = b.gather(1, idx[:, None])[:, 0]
        zero = b.abs().amax(dim=1) == 0
        iscale = torch.tensor(-127.0) / torch.where(zero, torch.ones_like(mx), mx)
        q = torch.round(iscale[:, None] * b).clamp(max=127)
        q[zero] = 0
        q8 = q.to(torch.int8)
        bsums = q8.to(torch.int32).view(-1, 16, 16).sum(-1).to(torch.int16)
        d = torch.tensor(1.0) / iscale
        d[zero] = 0.0
        parts = [
            d.numpy().view(np.uint8).reshape(-1, 4),
            q8.numpy().view(np.uint8),
            bsums.numpy().view(np.uint8).reshape(-1, 32),
        ]
        return np.concatenate(parts, axis=1).reshape(-1)
    b = x.view(-1, 32)
    amax = b.abs().amax(dim=1)
    d = amax / torch.tensor(127.0)
    inv = torch.where(amax != 0, torch.tensor(127.0) / torch.where(amax != 0, amax, 1), 0.0)
    q8 = torch.round(b * inv[:, None]).to(torch.int8)
    parts = [d.half().numpy().view(np.uint8).reshape(-1, 2), q8.numpy().view(np.uint8)]
    return np.concatenate(parts, axis=1).reshape(-1)


def _f16(b: np.ndarray) -> float:
    return float(b[:2].copy().view(np.float16)[0])


def _k_scale_min(sc: np.ndarray, j: int) -> tuple[int, int]:
    if j < 4:
        return int(sc[j] & 63), int(sc[j + 4] & 63)
    return int((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4)), int(
        (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
    )


def ref_qdot(t: str, w: np.ndarray, xq: np.ndarray, K: int) -> tuple[float, float]:
    """(the dot of weight row w with quantized row xq in float64 over the blocks' exact
    integer sums, the sum of the blocks' |terms|: the float32 paths' error scale)."""
    w = w.astype(np.int64)
    xq8 = xq.astype(np.uint8)
    total = scale = 0.0
    if t == "Q8_0":
        for b in range(K // 32):
            wb, xb = w[34 * b : 34 * b + 34], xq8[34 * b : 34 * b + 34]
            isum = int((wb[2:].astype(np.uint8).view(np.int8).astype(np.int64)
                        * xb[2:].view(np.int8).astype(np.int64)).sum())  # fmt: skip
            term = _f16(wb.astype(np.uint8)) * _f16(xb) * isum
            total, scale = total + term, scale + abs(term)
        return total, scale
    for s in range(K // 256):
        xb = xq8[292 * s : 292 * s + 292]
        dx = float(xb[:4].copy().view(np.float32)[0])
        q8 = xb[4:260].view(np.int8).astype(np.int64)
        bs = xb[260:292].copy().view(np.int16).astype(np.int64)
        if t in ("Q4_K", "Q5_K"):  # Q5_K: bit j of qh[l] adds 16 to sub-block j's codes
            bb = 144 if t == "Q4_K" else 176
            wb = w[bb * s : bb * s + bb].astype(np.uint8)
            qs = wb[bb - 128 :].astype(np.int64)
            qh = wb[16:48].astype(np.int64)
            isum = msum = 0
            for j in range(8):
                sc, m = _k_scale_min(wb[4:16], j)
                codes = qs[32 * (j // 2) : 32 * (j // 2) + 32]
                codes = codes >> 4 if j % 2 else codes & 0xF
                if t == "Q5_K":
                    codes = codes + (((qh >> j) & 1) << 4)
                isum += sc * int((codes * q8[32 * j : 32 * j + 32]).sum())
                msum += m * int(bs[2 * j] + bs[2 * j + 1])
            a, c = dx * _f16(wb) * isum, dx * _f16(wb[2:]) * msum
            total, scale = total + a - c, scale + abs(a) + abs(c)
        else:  # Q6_K
            wb = w[210 * s : 210 * s + 210].astype(np.uint8)
            ql, qh = wb[:128].astype(np.int64), wb[128:192].astype(np.int64)
            sc = wb[192:208].view(np.int8).astype(np.int64)
            isum = 0
            for n in range(2):
                for g in range(4):
                    lo = ql[64 * n + 32 * (g & 1) : 64 * n + 32 * (g & 1) + 32]
                    q = ((lo >> (0 if g < 2 else 4)) & 0xF) | (
                        ((qh[32 * n : 32 * n + 32] >> (2 * g)) & 3) << 4
                    )
                    pos = 128 * n + 32 * g + np.arange(32)
                    isum += int((sc[pos // 16] * (q - 32) * q8[pos]).sum())
            a = dx * _f16(wb[208:]) * isum
            total, scale = total + a, scale + abs(a)
    return total, scale


def _isa_dots() -> list[tuple[str, str]]:
    out = [(isa, "q8") for isa in ISAS]
    if "avx512" in ISAS:
        out.append(("avx512", "q8_madd"))
    return out


@pytest.mark.parametrize("act", [Q8_K, Q8_0])
def test_activation_quantizers_are_llama_cpp_rounding_on_every_path(act) -> None:
    g = torch.Generator().manual_seed(1)
    K = 768
    x = torch.randn(K, generator=g) * torch.rand(K, generator=g) * 5
    blk = 256 if act == Q8_K else 32
    x[:blk] = 0.0  # an all-zero block
    # ties: with max 127, iscale = -1 (Q8_K) / 127 / amax = 1 (Q8_0): x.5 rounds to even
    x[blk : 2 * blk] = torch.linspace(-3.5, 3.5, blk).round() + 0.5
    x[blk] = -127.0 if act == Q8_K else 127.0
    x[2 * blk] = x[2 * blk + 5] = 9.0  # equal magnitudes: the first decides the sign
    x[2 * blk + 3] = -9.0
    ref = ref_quant(x, act)
    for isa in ISAS:
        got = cpu_quantize_act(x, act, isa).numpy()
        assert np.array_equal(got, ref), (isa, np.flatnonzero(got != ref)[:8])


@pytest.mark.parametrize("t", TYPES)
def test_integer_dots_match_the_exact_integer_reference(t) -> None:
    """cpu_linear's q8 rows against the float64 sum of the exact integer block sums of the
    reference-quantized activations: within a few float32 roundings of each term."""
    rng = np.random.default_rng(3)
    N, K = 7, 224 if t == "Q8_0" else 768  # 7 Q8_0 blocks (an odd tail), 3 super-blocks
    raw = random_blocks(t, N, K, rng)
    weight = torch.from_numpy(np.ascontiguousarray(raw)).reshape(N, -1)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, K, generator=g) * 2
    act = Q8_0 if t == "Q8_0" else Q8_K
    kw = dict(ggml_type=pk.ggml_type_id(t), in_features=K)
    w = weight.numpy()
    for isa, dot in _isa_dots():
        y = store.cpu_linear(x, weight, isa=isa, dot=dot, threads=1, **kw).double()
        for u in range(3):
            xq = ref_quant(x[u], act)
            for n in range(N):
                ref, scale = ref_qdot(t, w[n], xq, K)
                assert abs(float(y[u, n]) - ref) <= 4e-6 * scale + 1e-30, (isa, dot, u, n)


@pytest.mark.parametrize("t", TYPES)
def test_q8_rows_are_bit_identical_for_any_t_and_threads(t) -> None:
    rng = np.random.default_rng(5)
    N, K = 9, 288 if t == "Q8_0" else 512
    raw = random_blocks(t, N, K, rng)
    weight = torch.from_numpy(np.ascontiguousarray(raw)).reshape(N, -1)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(600, K, generator=g)
    kw = dict(ggml_type=pk.ggml_type_id(t), in_features=K)
    ref = None
    for isa, dot in _isa_dots() + [("avx512", "q8")] * ("avx512" in ISAS and cpu_has_vnni()):
        alone = torch.cat(
            [store.cpu_linear(x[i : i + 1], weight, isa=isa, dot=dot, threads=1, **kw)
             for i in range(600)]
        )  # fmt: skip
        if isa == "avx512":  # with and without VNNI: the same integers, the same bits
            ref = alone if ref is None else ref
            assert torch.equal(alone, ref), dot
        for T in (2, 3, 7, 8, 9, 16, 17, 33, 64, 65, 600):
            for threads in THREADS:
                y = store.cpu_linear(x[:T], weight, isa=isa, dot=dot, threads=threads, **kw)
                assert torch.equal(y, alone[:T]), (isa, dot, T, threads)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0")])
def test_q8_expert_ffn_rows_equal_their_single_token_rows(types) -> None:
    """40 tokens over 3 experts, top-2 (the GEMM forms: each expert has >= 8 tokens), one
    pair absent: every token's row as when computed alone, on every path and thread count;
    the activations' rounding moves the result little from the fp32 path's."""
    rng = np.random.default_rng(7)
    H, F = (256, 512) if types[0] != "Q8_0" else (288, 352)
    slab = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(3)])
    fmt = pk.ggml_format(*types)
    g = torch.Generator().manual_seed(8)
    T = 40
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])
    table = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    x, wts = torch.randn(T, H, generator=g), torch.rand(T, 2, generator=g)
    kw = dict(fmt=fmt, slot_table=table, skip_absent=True)
    f32 = store.cpu_expert_ffn(x, slab, ids, wts, H, F, dot="f32", threads=1, **kw)
    for isa, dot in _isa_dots():
        alone = torch.cat(
            [store.cpu_expert_ffn(x[t : t + 1], slab, ids[t : t + 1], wts[t : t + 1], H, F,
                                  isa=isa, dot=dot, threads=1, **kw)
             for t in range(T)]
        )  # fmt: skip
        for n in (1, 9, T):
            for threads in THREADS:
                y = store.cpu_expert_ffn(
                    x[:n], slab, ids[:n], wts[:n], H, F, isa=isa, dot=dot, threads=threads, **kw
                )
                assert torch.equal(y, alone[:n]), (isa, dot, n, threads)
        # 8-bit activations (twice: x, then h) against fp32 ones: a few percent of the scale
        err = (alone - f32).abs().max() / f32.abs().max()
        assert float(err) < 0.05, (isa, dot, float(err))


def test_auto_uses_integer_dots_where_measured_faster() -> None:
    """cpu_dot 'auto': q8 for the K-quants on AVX-512 and AVX2 and Q8_0 on AVX2, f32 for
    the rest (expert_gemv.h's q8_by_default); 'f32' never quantizes."""
    rng = np.random.default_rng(9)
    K = 256
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(10))
    for t in TYPES:
        raw = random_blocks(t, 3, K, rng)
        weight = torch.from_numpy(np.ascontiguousarray(raw)).reshape(3, -1)
        kw = dict(ggml_type=pk.ggml_type_id(t), in_features=K, threads=1)
        for isa in ISAS:
            y = {
                d: store.cpu_linear(x, weight, isa=isa, dot=d, **kw) for d in ("auto", "q8", "f32")
            }
            q8 = (isa == "avx512" and t != "Q8_0") or isa == "avx2"
            assert torch.equal(y["auto"], y["q8" if q8 else "f32"]), (t, isa)
            assert not torch.equal(y["q8"], y["f32"])


def test_bad_dot_and_activation_type_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="cpu_dot must be one of"):
        store.set_cpu_dot("int8")
    with pytest.raises(ValueError, match="act must be"):
        cpu_quantize_act(torch.zeros(256), 12)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        cpu_quantize_act(torch.zeros(100), Q8_K)
