"""GGML blocks for tests: valid random blocks of every type psr's expert kernels compute,
and gguf-py's own dequantization of them (the independent reference)."""

from __future__ import annotations

import numpy as np
import torch

import psr_kernels as pk
from psr_kernels import ggml

QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "BF16"}
# Byte offsets of the f16 scales (d, dmin) of each type built from random bytes.
F16_SCALES = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_blocks(t: str, R: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 `[R, bytes]`: R rows of K values in GGML type `t`."""
    if t == "FP8_B128":
        w = torch.from_numpy(rng.standard_normal((R, K)).astype(np.float32))
        s = torch.from_numpy(rng.random(((R + 127) // 128, K // 128)).astype(np.float32)) + 0.01
        return ggml.pack_fp8_b128(w.to(torch.float8_e4m3fn), s * 0.01).numpy()
    qt = _gguf().GGMLQuantizationType[t]
    if t in F16_SCALES:  # types gguf-py cannot quantize: random codes, small f16 scales
        qk, bs = _gguf().GGML_QUANT_SIZES[qt]
        b = rng.integers(0, 256, size=(R, K // qk, bs), dtype=np.uint8)
        for at in F16_SCALES[t]:
            d = (rng.random((R, K // qk)) * 2e-3 + 1e-4).astype(np.float16)
            b[..., at : at + 2] = d.view(np.uint8).reshape(R, K // qk, 2)
        return b.reshape(R, -1)
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
    ("Q2_K", "Q2_K", "Q3_K"),  # the low-bit mixes DeepSeek-V3 / Kimi-K2 ship in
    ("IQ4_XS", "IQ4_XS", "IQ4_NL"),
]
# Every block type in some mix.
assert set(pk.BLOCK_TYPES) - {"Q5_1"} <= {t for m in MIXES for t in m}
