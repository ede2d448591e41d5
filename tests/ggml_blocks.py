"""GGML blocks for tests: valid random blocks of every type psr's expert kernels compute,
and gguf-py's own dequantization of them (the independent reference)."""

from __future__ import annotations

import numpy as np
import torch

import psr_kernels as pk
from psr_kernels import ggml

QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "BF16"}
# Types gguf-py cannot quantize, built from random codes with small positive f16 scales:
# (byte offset, magnitude) of each scale in a block, sized to keep weights ~0.05-0.2.
# IQ1_M's d is spread over the top nibbles of its four u16 scales (bytes 48..55).
F16_SCALES: dict[str, tuple[tuple[int, float], ...]] = {
    "Q2_K": ((80, 1e-3), (82, 5e-4)),  # scales[16] qs[64] d dmin
    "Q3_K": ((108, 3e-4),),  # hmask[32] qs[64] scales[12] d
    "Q4_K": ((0, 2e-4), (2, 1e-4)),  # d dmin scales[12] ...
    "Q5_K": ((0, 2e-4), (2, 1e-4)),
    "Q6_K": ((208, 2e-5),),  # ql[128] qh[64] scales[16] d
    "IQ4_NL": ((0, 3e-4),),  # d, then the codes
    "IQ4_XS": ((0, 1e-5),),
    "IQ2_XXS": ((0, 3e-4),),
    "IQ2_XS": ((0, 3e-4),),
    "IQ2_S": ((0, 3e-4),),
    "IQ3_XXS": ((0, 1e-4),),
    "IQ3_S": ((0, 1e-4),),
    "IQ1_S": ((0, 3e-3),),
    "IQ1_M": ((48, 3e-3),),
}


def scaled_blocks(t: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 `[n, BS]`: n valid random blocks of `t` (a type of F16_SCALES)."""
    bs = _gguf().GGML_QUANT_SIZES[_gguf().GGMLQuantizationType[t]][1]
    raw = rng.integers(0, 256, size=(n, bs), dtype=np.uint8)
    for at, mag in F16_SCALES[t]:
        d = (rng.uniform(0.5, 1.5, n) * mag).astype(np.float16)
        if t == "IQ1_M":  # nibble k of d in the top nibble of u16 scale k
            sc = raw[:, 48:56].copy().view(np.uint16) & 0x0FFF
            bits = d.view(np.uint16)
            for k in range(4):
                sc[:, k] |= ((bits >> (4 * k)) & 0xF) << 12
            raw[:, 48:56] = sc.view(np.uint8)
        else:
            raw[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    return raw


def random_blocks(t: str, R: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 `[R, bytes]`: R rows of K values in GGML type `t`."""
    if t == "FP8_B128":
        w = torch.from_numpy(rng.standard_normal((R, K)).astype(np.float32))
        s = torch.from_numpy(rng.random(((R + 127) // 128, K // 128)).astype(np.float32)) + 0.01
        return ggml.pack_fp8_b128(w.to(torch.float8_e4m3fn), s * 0.01).numpy()
    qt = _gguf().GGMLQuantizationType[t]
    if t in F16_SCALES:  # types gguf-py cannot quantize
        qk = _gguf().GGML_QUANT_SIZES[qt][0]
        return scaled_blocks(t, R * K // qk, rng).reshape(R, -1)
    w = rng.standard_normal((R, K)).astype(np.float32) * 0.1
    if t == "F32":
        return w.view(np.uint8)
    if t == "F16":
        return w.astype(np.float16).view(np.uint8)
    assert t in QUANTIZABLE
    return _gguf().quants.quantize(w, qt)


def gguf_dequant(raw: np.ndarray, t: str, shape: tuple[int, ...]) -> torch.Tensor:
    if t == "FP8_B128":  # psr's own block: its plain formula
        b = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1, 132)
        s = b[:, :4].contiguous().view(torch.float32)
        return (s * b[:, 4:].contiguous().view(torch.float8_e4m3fn).float()).reshape(shape)
    out = _gguf().quants.dequantize(raw, _gguf().GGMLQuantizationType[t]).astype(np.float32)
    return torch.from_numpy(out.reshape(shape))


def _gguf():  # type: ignore[no-untyped-def]
    import gguf

    return gguf


def expert_rows(types: tuple[str, str, str], H: int, F: int, rng: np.random.Generator):
    """One expert's slab row in these part types and its fp32 matrices by gguf-py."""
    lay = ggml.GGMLLayout.of(ggml.ggml_format(*types), H, F)
    shapes = ((F, H), (F, H), (H, F))
    raws = [random_blocks(t, *s, rng) for t, s in zip(types, shapes, strict=True)]
    parts = [torch.from_numpy(np.ascontiguousarray(r)).reshape(-1) for r in raws]
    mats = [gguf_dequant(r, t, s) for r, t, s in zip(raws, types, shapes, strict=True)]
    return ggml.pack_ggml_expert(lay, parts), mats


# Mixed rows as real files have them (Q4_K_M: Q4_K gate/up, Q6_K down), each block family.
MIXES = [
    ("Q4_K", "Q4_K", "Q6_K"),
    ("Q5_K", "Q8_0", "Q5_0"),
    ("MXFP4", "Q4_1", "Q5_1"),
    ("F16", "BF16", "F32"),
    ("Q4_0", "Q4_0", "Q8_0"),
    ("FP8_B128", "FP8_B128", "FP8_B128"),
]
# The low-bit types DeepSeek-V3 / Kimi-K2 files ship in (each decoder is checked alone
# against gguf-py; the Triton FFN test, slow under the interpreter, takes the last only).
LOW_BIT_MIXES = [
    ("Q2_K", "Q2_K", "Q3_K"),
    ("IQ4_XS", "IQ4_XS", "IQ4_NL"),
    ("IQ2_XXS", "IQ2_XXS", "IQ3_XXS"),  # the "dynamic" 1.5-3 bit quants' routed experts
    ("IQ2_XS", "IQ2_S", "IQ3_S"),
    ("IQ1_S", "IQ1_M", "IQ2_XXS"),
]
MIXES += LOW_BIT_MIXES
# Every block type in some mix.
assert set(pk.BLOCK_TYPES) - {"Q5_1"} <= {t for m in MIXES for t in m}
