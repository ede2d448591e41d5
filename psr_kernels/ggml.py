"""Experts in GGML blocks (the bytes of a GGUF file), run straight from the slab.

    y[t] = sum_j w[t, j] * down_j( act(gate_j x[t], up_j x[t]) ),  expert j in slot slots[t, j]

A GGUF file holds each expert matrix in one of GGML's block formats, blocks running along
the input dimension (a row of K inputs is K / QK blocks of BS bytes). psr keeps those bytes
as they are: a slab row is the expert's gate, up and down matrices back to back, each in its
own type (a Q4_K_M file mixes them: down in Q6_K, gate/up in Q4_K), every part starting at
a multiple of 16 bytes. The format of a row is `RowFormat.blocks(gate, up, down)`
(psr_kernels.rowformat; its word `ggml_format(...)`, "gguf:Q4_K,Q4_K,Q6_K"): it goes
wherever a quantized `fmt` goes (`expert_ffn(fmt=...)`), and its `GGMLLayout` lives there.

Types (`GGML_TYPES`; QK, BS and GGML's type ids, the kernels' constexpr codes, are the
`BlockType` traits of rowformat's `BLOCK_TYPE_TRAITS`):

    type   QK   BS   value of element i of a block
    F32     1    4   the float
    F16     1    2   the half
    BF16    1    2   the bfloat16
    Q8_0   32   34   d * q[i]                 d f16, q int8[32]
    Q4_0   32   18   d * (n[i] - 8)           n: nibbles, low nibbles first (i < 16)
    Q4_1   32   20   d * n[i] + m             d, m f16
    Q5_0   32   22   d * (n[i] + 16 h[i] - 16)  h: bit i of a 32-bit little-endian word
    Q5_1   32   24   d * (n[i] + 16 h[i]) + m
    MXFP4  32   17   fp4_e2m1(n[i]) * 2^(e - 127)   e: one e8m0 byte
    Q4_K  256  144   d sc[s] n[i] - dmin mn[s]     8 sub-blocks s of 32, 6-bit scales/mins
    Q5_K  256  176   d sc[s] (n[i] + 16 h[i]) - dmin mn[s]
    Q6_K  256  210   d sc[s] (q6[i] - 32)          16 sub-blocks of 16, int8 scales
    Q2_K  256   84   d sc[s] q2[i] - dmin mn[s]    16 sub-blocks of 16, 4-bit scales/mins
    Q3_K  256  110   d (sc[s] - 32) (q2[i] - 4 (1 - h[i]))  16 of 16, 6-bit scales
    IQ4_NL  32  18   d lv[n[i]]                    lv: 16 non-linear levels (gguf-py's table)
    IQ4_XS 256 136   d (sc[s] - 32) lv[n[i]]       8 sub-blocks of 32, 6-bit scales
    FP8_B128 128 132  s * e4m3(c[i])           s fp32: the checkpoint's 128 x 128 tile scale

`dequantize_ggml(data, type, shape)` is the plain-torch reference of each (tested against
gguf-py's own `dequantize`); the kernels decode each element of a weight tile from its
block by integer arithmetic (`_ggml_tile`: GGML's layouts, one branch per type) and
accumulate in fp32 with a fixed reduction order, as the other expert kernels do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from psr_kernels._common import SPLIT_K_DEFAULT, load_slot, pow2, store_down
from psr_kernels.activation import glu
from psr_kernels.quant import _fp8_e4m3_to_f32
from psr_kernels.rowformat import (
    BLOCK_TYPE_TRAITS,
    GGML_PREFIX,
    GGMLLayout,
    RowFormat,
    block_type,
    blocks_format,
)
from psr_kernels.rowformat import BLOCK_TYPES as BLOCK_TYPES  # the table's, named here too
from psr_kernels.rowformat import GGML_TYPES as GGML_TYPES
from psr_kernels.rowformat import is_ggml_format as is_ggml_format

FORMAT_PREFIX = GGML_PREFIX


def ggml_block(type_name: str) -> tuple[int, int]:
    """(elements, bytes) of one block of `type_name`."""
    t = block_type("ggml_block", type_name)
    return t.block_len, t.block_bytes


def ggml_type_id(type_name: str) -> int:
    """GGML's id of `type_name` (psr's own blocks: 200 and up), the kernels' constexpr."""
    return block_type("ggml_type_id", type_name).type_id


def ggml_row_bytes(type_name: str, k: int) -> int:
    """Bytes of one row of `k` inputs in `type_name`; `k` must fill whole blocks."""
    return block_type("ggml_block", type_name).row_bytes(k)


def ggml_format(gate: str, up: str, down: str) -> str:
    """The `fmt` word of rows whose gate, up, down parts are in these GGML types."""
    return RowFormat.blocks(gate, up, down).name


def ggml_types(fmt: RowFormat | str) -> tuple[str, str, str]:
    """(gate, up, down) types of a GGML row format."""
    g, u, d = (t.name for t in blocks_format(fmt).block_types)
    return g, u, d


def pack_ggml_parts(lay: GGMLLayout, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The store's parts of one row: the gate, up, down bytes (uint8 views, as the file
    holds them) with the zero padding between them, in order (no copy of the bytes)."""
    want = lay.part_bytes
    if len(parts) != 3:
        raise ValueError(f"pack_ggml_parts: expected gate, up, down bytes, got {len(parts)} parts")
    out: list[torch.Tensor] = []
    at = 0
    for name, p, n, off in zip(
        ("gate", "up", "down"), parts, want, (lay.gate, lay.up, lay.down), strict=True
    ):
        if p.dtype != torch.uint8 or p.dim() != 1 or p.numel() != n:
            raise ValueError(
                f"pack_ggml_parts: {name} must be {n} uint8 bytes ({lay.types}, H="
                f"{lay.hidden_size}, F={lay.ffn_size}), got {p.dtype} {list(p.shape)}"
            )
        if off > at:
            out.append(torch.zeros(off - at, dtype=torch.uint8))
        out.append(p)
        at = off + n
    if lay.nbytes > at:
        out.append(torch.zeros(lay.nbytes - at, dtype=torch.uint8))
    return out


def pack_ggml_expert(lay: GGMLLayout, parts: list[torch.Tensor]) -> torch.Tensor:
    """One slab row (uint8 `[nbytes]`) of an expert's gate, up, down bytes."""
    return torch.cat(pack_ggml_parts(lay, parts))


def pack_fp8_b128(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """FP8_B128 rows (uint8 `[R, K / 128 * 132]`) of a block-wise FP8 matrix as checkpoints
    ship it: e4m3 `codes [R, K]` (uint8 or float8_e4m3fn) and `scale_inv
    [ceil(R / 128), K / 128]` fp32 (w = code * scale_inv of its 128 x 128 tile). Lossless:
    each row carries its tile row's scales; K must be a multiple of 128."""
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise TypeError(f"pack_fp8_b128: codes must be 2-D e4m3 bytes, got {codes.dtype}")
    R, K = codes.shape
    if K % 128:
        raise ValueError(f"pack_fp8_b128: rows of {K} inputs are not whole 128-blocks")
    want = ((R + 127) // 128, K // 128)
    if scale_inv.dim() != 2 or tuple(scale_inv.shape) != want:
        raise ValueError(
            f"pack_fp8_b128: scale_inv must be {list(want)} for codes {[R, K]}, got "
            f"{list(scale_inv.shape)}"
        )
    s = scale_inv.to(torch.float32).repeat_interleave(128, 0)[:R]  # [R, K / 128]
    blocks = torch.cat(
        [s.contiguous().view(torch.uint8).reshape(R, K // 128, 4), codes.reshape(R, K // 128, 128)],
        -1,
    )
    return blocks.reshape(R, -1).contiguous()


# --------------------------------------------------------------------------- references


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of each block `b [..., BS]`, as fp32 `[..., 1]`."""
    return b[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Low nibbles of 16 bytes then their high nibbles: `[..., 16]` -> `[..., 32]`."""
    q = qs.to(torch.int32)
    return torch.cat([q & 0xF, q >> 4], -1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """Bit i of the little-endian word in 4 bytes, i = 0..31: `[..., 4]` -> `[..., 32]`."""
    i = torch.arange(32, device=qh.device)
    return (qh.to(torch.int32)[..., i // 8] >> (i % 8)) & 1


_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _e8m0(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as fp32 (e = 0: 2^-127, a subnormal; exact, as GGML's table)."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    return bits.view(torch.float32)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 six-bit scales and mins packed in 12 bytes `[..., 12]`."""
    s = s.to(torch.int32)
    s0, s1, s2 = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([s0 & 63, (s2 & 0xF) | ((s0 >> 6) << 4)], -1)
    mn = torch.cat([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], -1)
    return sc.float(), mn.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: 128 bytes -> 8 sub-blocks of 32 (chunk j's low nibbles, then high)."""
    q = qs.to(torch.int32).reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([q & 0xF, q >> 4], -2).flatten(-3, -2)  # [..., 8, 32]


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[..., 2:34].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[..., 2:18]) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[..., 4:20]).float() + _f16(b, 2)


def _q5(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0 / Q5_1's 5-bit codes: high bits at byte `at`, nibbles after them."""
    return (_nibbles(b[..., at + 4 : at + 20]) | (_bits32(b[..., at : at + 4]) << 4)).float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_q5(b, 2) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _q5(b, 4) + _f16(b, 2)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(_FP4, dtype=torch.float32, device=b.device)
    return lut[_nibbles(b[..., 1:17])] * _e8m0(b[..., 0:1])


def _qk_k(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: d sc q - dmin mn over the 8 sub-blocks of codes `q [..., 8, 32]`."""
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    return (d * sc[..., None] * q.float() - dmin * mn[..., None]).flatten(-2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _qk_k(b, _k_nibbles(b[..., 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    i = torch.arange(8, device=b.device)[:, None]
    hb = (b[..., None, 16:48].to(torch.int32) >> i) & 1  # bit s of qh[l]: sub-block s
    return _qk_k(b, _k_nibbles(b[..., 48:176]) + 16 * hb)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    ql = b[..., 0:128].to(torch.int32).reshape(*lead, 2, 2, 32)  # [half, 2 x 32, l]
    qh = b[..., 128:192].to(torch.int32).reshape(*lead, 2, 1, 32)
    sh = torch.arange(4, device=b.device).view(4, 1) * 2
    nib = torch.cat([ql & 0xF, ql >> 4], -2)  # groups g = 0..3 of 32 in each half
    q = (nib | (((qh >> sh) & 3) << 4)) - 32  # [..., 2, 4, 32]
    sc = b[..., 192:208].contiguous().view(torch.int8).float().reshape(*lead, 2, 4, 2, 1)
    d = _f16(b, 208)[..., None, None, None]
    out: torch.Tensor = (d * sc * q.float().reshape(*lead, 2, 4, 2, 16)).flatten(-4)
    return out


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16: (d sc[s]) q - dmin mn[s], 2-bit codes (4 runs of 32 a byte run)."""
    lead = b.shape[:-1]
    sc = b[..., 0:16].to(torch.int32)
    qs = b[..., 16:80].to(torch.int32).reshape(*lead, 2, 1, 32)
    sh = torch.arange(4, device=b.device).view(4, 1) * 2
    q = ((qs >> sh) & 3).reshape(*lead, 16, 16).float()
    dl = (_f16(b, 80) * (sc & 0xF).float())[..., None]
    ml = (_f16(b, 82) * (sc >> 4).float())[..., None]
    return (dl * q - ml).flatten(-2)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16: d (sc[s] - 32) (q - 4 (1 - h)), 2-bit codes and a high bit."""
    lead = b.shape[:-1]
    hm = b[..., 0:32].to(torch.int32).reshape(*lead, 1, 32)
    qs = b[..., 32:96].to(torch.int32).reshape(*lead, 2, 1, 32)
    s = b[..., 96:108].to(torch.int32)
    i = torch.arange(16, device=b.device)
    sc = ((s[..., i % 8] >> (4 * (i // 8))) & 0xF) | (
        ((s[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4
    )
    ql = (qs >> (torch.arange(4, device=b.device).view(4, 1) * 2)) & 3  # [..., 2, 4, 32]
    h = (hm >> torch.arange(8, device=b.device).view(8, 1)) & 1  # [..., 8, 32]
    q = ql.reshape(*lead, 8, 32) - 4 * (1 - h)
    dl = (_f16(b, 108) * (sc - 32).float())[..., None]
    return (dl * q.reshape(*lead, 16, 16).float()).flatten(-2)


@functools.cache
def _iq4_values() -> tuple[int, ...]:
    """IQ4_NL / IQ4_XS's 16 non-linear levels: gguf-py's table (data, not retyped)."""
    from gguf.quants import IQ4_NL

    return tuple(int(v) for v in IQ4_NL.kvalues)


def _iq4(n: torch.Tensor) -> torch.Tensor:
    return torch.tensor(_iq4_values(), dtype=torch.float32, device=n.device)[n]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _iq4(_nibbles(b[..., 2:18]))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """8 sub-blocks of 32: (d (sc[s] - 32)) level[n], 6-bit scales (low nibbles, 2 high bits)."""
    lead = b.shape[:-1]
    s = torch.arange(8, device=b.device)
    sh = b[..., 2:4].to(torch.int32)
    hi = (sh[..., s // 4] >> (2 * (s % 4))) & 3
    lo = (b[..., 4:8].to(torch.int32)[..., s // 2] >> (4 * (s % 2))) & 0xF
    dl = (_f16(b, 0) * ((lo | (hi << 4)) - 32).float())[..., None]
    n = _nibbles(b[..., 8:136].reshape(*lead, 8, 16))
    return (dl * _iq4(n)).flatten(-2)


# The IQ types' tables, named by gguf-py's class that holds each (its data, never retyped).
IQ_GRIDS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S")


@functools.cache
def iq_tables() -> Mapping[str, tuple[int, ...]]:
    """gguf-py's IQ tables as integers: each grid flattened (row r: values r * n ..),
    "KSIGNS" (128 bytes: 7 sign bits and their parity) and IQ1's `delta` * 8 ("IQ1_DELTA8")."""
    import numpy as np
    from gguf import quants

    out = {"KSIGNS": tuple(np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8).tolist())}
    for name in IQ_GRIDS:
        cls = getattr(quants, name)
        cls.init_grid()
        out[name] = tuple(int(v) for v in np.asarray(cls.grid).reshape(-1))
    out["IQ1_DELTA8"] = (int(quants.IQ1_S.delta * 8),)
    return MappingProxyType(out)


def _iq_grid(name: str, q: torch.Tensor) -> torch.Tensor:
    """fp32 grid rows `q [...]` -> `[..., n]` of gguf-py's grid `name`."""
    rows = 8 if name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S") else 4
    g = torch.tensor(iq_tables()[name], dtype=torch.float32, device=q.device).view(-1, rows)
    return g[q.long()]


def _bits8(b: torch.Tensor) -> torch.Tensor:
    """Bit j of each byte, j = 0..7: `[...]` -> `[..., 8]`."""
    return (b.to(torch.int32)[..., None] >> torch.arange(8, device=b.device)) & 1


def _signs(bits: torch.Tensor) -> torch.Tensor:
    return 1.0 - 2.0 * bits.float()  # bit set: -1


def _ksigns(idx: torch.Tensor) -> torch.Tensor:
    """The 8 signs (+-1) of 7-bit sign indices `idx [...]`: `[..., 8]`."""
    ks = torch.tensor(iq_tables()["KSIGNS"], dtype=torch.int32, device=idx.device)
    return _signs(_bits8(ks[idx.long()]))


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian u32 words of bytes `[..., 4n]` as int64 `[..., n]`."""
    w = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


def _u16(b: torch.Tensor) -> torch.Tensor:
    w = b.to(torch.int64).reshape(*b.shape[:-1], -1, 2)
    return w[..., 0] | (w[..., 1] << 8)


def _xxs(
    b: torch.Tensor, grid: str, qs: torch.Tensor, aux: torch.Tensor, mul: float
) -> torch.Tensor:
    """IQ2_XXS / IQ3_XXS: per sub-block of 32 a u32 `aux` (4 x 7 sign bits, a 4-bit scale),
    grid rows `qs [..., 8, G]` covering it."""
    lead = b.shape[:-1]
    db = _f16(b, 0) * (0.5 + (aux >> 28).float()) * mul  # [..., 8]
    sh = torch.arange(4, device=b.device) * 7
    sg = _ksigns((aux[..., None] >> sh) & 127)  # [..., 8, 4, 8]
    g = _iq_grid(grid, qs).reshape(*lead, 8, 4, 8)
    return (db[..., None, None] * g * sg).flatten(-3)


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    w = _u32(b[..., 2:66]).reshape(*b.shape[:-1], 8, 2)
    qs = b[..., 2:66].reshape(*b.shape[:-1], 8, 8)[..., 0:4]
    return _xxs(b, "IQ2_XXS", qs, w[..., 1], 0.25)


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    qs = b[..., 2:66].reshape(*b.shape[:-1], 8, 8)
    return _xxs(b, "IQ3_XXS", qs, _u32(b[..., 66:98]), 0.5)


def _scales4(sc: torch.Tensor) -> torch.Tensor:
    """Nibbles of scale bytes, low first: `[..., n]` -> float `[..., 2n]`."""
    s = sc.to(torch.int32)
    return torch.stack([s & 0xF, s >> 4], -1).flatten(-2).float()


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    db = _f16(b, 0) * (0.5 + _scales4(b[..., 66:74])) * 0.25  # [..., 16]
    q = _u16(b[..., 2:66])  # [..., 32]
    v = _iq_grid("IQ2_XS", q & 511) * _ksigns(q >> 9)  # [..., 32, 8]
    return (db.reshape(*lead, 16, 1, 1) * v.reshape(*lead, 16, 2, 8)).flatten(-3)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    db = _f16(b, 0) * (0.5 + _scales4(b[..., 74:82])) * 0.25  # [..., 16]
    qh = b[..., 66:74].to(torch.int32)[..., None] >> (torch.arange(4, device=b.device) * 2)
    q = b[..., 2:34].to(torch.int32) | ((qh.flatten(-2) & 3) << 8)  # [..., 32]
    v = _iq_grid("IQ2_S", q) * _signs(_bits8(b[..., 34:66]))  # [..., 32, 8]
    return (db.reshape(*lead, 16, 1, 1) * v.reshape(*lead, 16, 2, 8)).flatten(-3)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    db = _f16(b, 0) * (1 + 2 * _scales4(b[..., 106:110]))  # [..., 8]
    q = b[..., 2:66].to(torch.int32) | (_bits8(b[..., 66:74]).flatten(-2) << 8)  # [..., 64]
    v = _iq_grid("IQ3_S", q).reshape(*lead, 32, 8) * _signs(_bits8(b[..., 74:106]))
    return (db.reshape(*lead, 8, 1, 1) * v.reshape(*lead, 8, 4, 8)).flatten(-3)


def _iq1(dl: torch.Tensor, q: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """IQ1_S / IQ1_M: dl (grid + delta), delta's sign per group of 8 (`neg`)."""
    delta = iq_tables()["IQ1_DELTA8"][0] / 8
    d = torch.where(neg, -delta, delta).float()[..., None]
    return dl * (_iq_grid("IQ1_S", q) + d)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    qh = _u16(b[..., 34:50])  # [..., 8]
    dl = _f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()  # [..., 8]
    sh = torch.arange(4, device=b.device) * 3
    q = b[..., 2:34].to(torch.int64).reshape(*lead, 8, 4) | (((qh[..., None] >> sh) & 7) << 8)
    neg = ((qh & 0x8000) != 0)[..., None].expand(*lead, 8, 4)
    return _iq1(dl[..., None, None], q, neg).flatten(-3)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    sc = _u16(b[..., 48:56])  # [..., 4]
    bits = (sc >> 12) << (torch.arange(4, device=b.device) * 4)
    d16 = (bits[..., 0] | bits[..., 1] | bits[..., 2] | bits[..., 3]).to(torch.int16)
    d = d16.view(torch.float16).float()[..., None]  # [..., 1]
    sh = torch.arange(4, device=b.device) * 3
    s = ((sc[..., None] >> sh) & 7).flatten(-2)  # [..., 16]: a scale per 16
    dl = d * (2 * s + 1).float()
    qh = b[..., 32:48].to(torch.int64)[..., None] >> torch.tensor([0, 4], device=b.device)
    qh = qh.flatten(-2)  # [..., 32]
    q = b[..., 0:32].to(torch.int64) | ((qh & 7) << 8)
    v = _iq1(torch.ones(1, device=b.device), q, (qh & 8) != 0)  # [..., 32, 8]
    return (dl.reshape(*lead, 16, 1, 1) * v.reshape(*lead, 16, 2, 8)).flatten(-3)


def _fp8_b128(b: torch.Tensor) -> torch.Tensor:
    s = b[..., 0:4].contiguous().view(torch.float32)
    return s * b[..., 4:132].contiguous().view(torch.float8_e4m3fn).float()


# One reference dequantizer per block type: fp32 values [..., QK] of blocks [..., BS].
_BLOCK_REFS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "MXFP4": _mxfp4,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "IQ2_XXS": _iq2_xxs,
    "IQ2_XS": _iq2_xs,
    "IQ2_S": _iq2_s,
    "IQ3_XXS": _iq3_xxs,
    "IQ3_S": _iq3_s,
    "IQ1_S": _iq1_s,
    "IQ1_M": _iq1_m,
    "FP8_B128": _fp8_b128,
}
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _tile_perm(k: int) -> torch.Tensor:
    """Byte order of a Q4_K tile (csrc/cpu/expert_gemv.h's tile_q4k): tile byte i is byte
    perm[i] of its 8 rows' K / 256 * 144 bytes laid back to back."""
    nb = k // 256
    src = torch.arange(8 * nb * 144).reshape(8, nb, 144).transpose(0, 1)  # [b, r, 144]
    d, dmin = src[..., 0:2], src[..., 2:4]  # [b, 8, 2]
    words = src[..., 4:16].reshape(nb, 8, 3, 4).transpose(1, 2)  # [b, 3 words, 8 rows, 4]
    qs = src[..., 16:144].reshape(nb, 8, 4, 8, 4).permute(0, 2, 3, 1, 4)  # [b, p, c, r, 4]
    parts = (d, dmin, words, qs)
    return torch.cat([p.reshape(nb, -1) for p in parts], 1).reshape(-1)


def tile_q4_k(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Q4_K rows `[N, k / 256 * 144]` (N a multiple of 8) as Q4_K_X8 tiles: the torch
    reference of the CPU kernels' tile_q4k."""
    n = rows.shape[0]
    flat = rows.reshape(n // 8, -1)  # a tile's 8 rows back to back
    return flat[:, _tile_perm(k)].reshape(rows.shape)


def untile_q4_k(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of tile_q4_k: Q4_K_X8 tiles `[N, bytes]` back to Q4_K rows."""
    n = tiles.shape[0]
    out = torch.empty_like(tiles.reshape(n // 8, -1))
    out[:, _tile_perm(k)] = tiles.reshape(n // 8, -1)
    return out.reshape(tiles.shape)


def dequantize_ggml(data: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 values of `shape` (rows along the last dim) from GGML bytes `data` (uint8,
    `[..., bytes]` flattened to the tensor's bytes): the plain-torch reference."""
    bt = block_type("dequantize_ggml", type_name)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise TypeError("dequantize_ggml: data must be a uint8 tensor")
    k = int(shape[-1])
    rows = math.prod(shape[:-1])
    rb = ggml_row_bytes(type_name, k)
    if data.numel() != rows * rb:
        raise ValueError(
            f"dequantize_ggml: {type_name} {list(shape)} needs {rows * rb} bytes, "
            f"got {data.numel()}"
        )
    flat = data.reshape(-1)
    if bt.tile_rows > 1:  # the tiles' rows (a matrix: the last two dims)
        n = int(shape[-2]) if len(shape) > 1 else 1
        if n % bt.tile_rows:
            raise ValueError(f"dequantize_ggml: {type_name} holds rows in tiles of "
                             f"{bt.tile_rows}; {list(shape)} does not")  # fmt: skip
        flat = untile_q4_k(flat.reshape(-1, rb), k).reshape(-1)
        return _BLOCK_REFS["Q4_K"](flat.reshape(-1, bt.block_bytes)).reshape(shape)
    if type_name in _FLOAT_TYPES:
        return flat.contiguous().view(_FLOAT_TYPES[type_name]).float().reshape(shape)
    bs = bt.block_bytes
    return _BLOCK_REFS[type_name](flat.reshape(-1, bs)).reshape(shape)


def dequantize_ggml_expert(
    rows: torch.Tensor, lay: GGMLLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 `(gate [..., F, H], up [..., F, H], down [..., H, F])` of rows `[..., nbytes]`."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != lay.nbytes:
        raise ValueError(
            f"dequantize_ggml_expert: rows must be uint8 [..., {lay.nbytes}] ({lay.fmt}), got "
            f"{rows.dtype} {list(rows.shape)}"
        )
    batch = tuple(rows.shape[:-1])
    H, F = lay.hidden_size, lay.ffn_size
    out = []
    for t, off, n, shape in zip(
        lay.types,
        (lay.gate, lay.up, lay.down),
        lay.part_bytes,
        ((F, H), (F, H), (H, F)),
        strict=True,
    ):
        part = rows[..., off : off + n].contiguous()
        out.append(dequantize_ggml(part, t, (*batch, *shape)))
    return out[0], out[1], out[2]


# --------------------------------------------------------------------------- kernels


# The kernels' branches name the block types by their ids (the format table's).
_F32 = tl.constexpr(BLOCK_TYPE_TRAITS["F32"].type_id)
_F16 = tl.constexpr(BLOCK_TYPE_TRAITS["F16"].type_id)
_BF16 = tl.constexpr(BLOCK_TYPE_TRAITS["BF16"].type_id)
_Q8_0 = tl.constexpr(BLOCK_TYPE_TRAITS["Q8_0"].type_id)
_Q4_0 = tl.constexpr(BLOCK_TYPE_TRAITS["Q4_0"].type_id)
_Q4_1 = tl.constexpr(BLOCK_TYPE_TRAITS["Q4_1"].type_id)
_Q5_0 = tl.constexpr(BLOCK_TYPE_TRAITS["Q5_0"].type_id)
_Q5_1 = tl.constexpr(BLOCK_TYPE_TRAITS["Q5_1"].type_id)
_MXFP4 = tl.constexpr(BLOCK_TYPE_TRAITS["MXFP4"].type_id)
_Q4_K = tl.constexpr(BLOCK_TYPE_TRAITS["Q4_K"].type_id)
_Q5_K = tl.constexpr(BLOCK_TYPE_TRAITS["Q5_K"].type_id)
_Q6_K = tl.constexpr(BLOCK_TYPE_TRAITS["Q6_K"].type_id)
_FP8_B128 = tl.constexpr(BLOCK_TYPE_TRAITS["FP8_B128"].type_id)
_Q2_K = tl.constexpr(BLOCK_TYPE_TRAITS["Q2_K"].type_id)
_Q3_K = tl.constexpr(BLOCK_TYPE_TRAITS["Q3_K"].type_id)
_IQ4_NL = tl.constexpr(BLOCK_TYPE_TRAITS["IQ4_NL"].type_id)
_IQ4_XS = tl.constexpr(BLOCK_TYPE_TRAITS["IQ4_XS"].type_id)


def _packed_bytes(values: tuple[int, ...]) -> int:
    """Up to 8 signed bytes as one little-endian int64 (value i in byte i): a table a kernel
    indexes by shifting, built at import from the data it comes from."""
    word = sum((v & 0xFF) << (8 * i) for i, v in enumerate(values))
    return word - (1 << 64) if word >= 1 << 63 else word  # two's complement


_IQ2_XXS = tl.constexpr(BLOCK_TYPE_TRAITS["IQ2_XXS"].type_id)
_IQ2_XS = tl.constexpr(BLOCK_TYPE_TRAITS["IQ2_XS"].type_id)
_IQ2_S = tl.constexpr(BLOCK_TYPE_TRAITS["IQ2_S"].type_id)
_IQ3_XXS = tl.constexpr(BLOCK_TYPE_TRAITS["IQ3_XXS"].type_id)
_IQ3_S = tl.constexpr(BLOCK_TYPE_TRAITS["IQ3_S"].type_id)
_IQ1_S = tl.constexpr(BLOCK_TYPE_TRAITS["IQ1_S"].type_id)


def _table_offsets() -> dict[str, int]:
    """Byte offset of each of `iq_tables()` in the kernels' table (`iq_table`)."""
    offs, at = {}, 0
    for name, values in iq_tables().items():
        offs[name] = at
        at += len(values)
    return offs


_TAB = _table_offsets()
_T_KSIGNS = tl.constexpr(_TAB["KSIGNS"])
_T_IQ2_XXS = tl.constexpr(_TAB["IQ2_XXS"])
_T_IQ2_XS = tl.constexpr(_TAB["IQ2_XS"])
_T_IQ2_S = tl.constexpr(_TAB["IQ2_S"])
_T_IQ3_XXS = tl.constexpr(_TAB["IQ3_XXS"])
_T_IQ3_S = tl.constexpr(_TAB["IQ3_S"])
_T_IQ1_S = tl.constexpr(_TAB["IQ1_S"])
_IQ1_DELTA = tl.constexpr(iq_tables()["IQ1_DELTA8"][0] / 8)


@functools.cache
def iq_table(device: torch.device) -> torch.Tensor:
    """The IQ types' grids and sign table (`iq_tables()`, int8 bytes back to back at the
    offsets `_TAB`) on `device`: the GGML kernels' `tab_ptr`."""
    vals = [v for t in iq_tables().values() for v in t]
    return torch.tensor(vals, dtype=torch.int16).to(torch.uint8).to(device)


# IQ4's 16 levels (gguf-py's table), 8 to an int64 constant.
_IQ4_LO = tl.constexpr(_packed_bytes(_iq4_values()[:8]))
_IQ4_HI = tl.constexpr(_packed_bytes(_iq4_values()[8:]))


@triton.jit
def _u8(p, m):
    return tl.load(p, mask=m, other=0).to(tl.int32)


@triton.jit
def _f16_at(p, m):
    """The little-endian f16 at byte pointers `p` (any alignment), as fp32."""
    bits = _u8(p, m) | (_u8(p + 1, m) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nib(byte, hi):
    return tl.where(hi, byte >> 4, byte & 0xF)


@triton.jit
def _k_scale_min(s_ptr, sb, m):
    """Q4_K / Q5_K's six-bit scale and min of sub-block `sb` (0..7) from 12 bytes."""
    j = sb % 4
    a = _u8(s_ptr + j, m)
    b = _u8(s_ptr + j + 4, m)
    c = _u8(s_ptr + j + 8, m)
    lo = sb < 4
    sc = tl.where(lo, a & 63, (c & 0xF) | ((a >> 6) << 4))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _iq4_level(n):
    """IQ4's level of nibbles `n` (0..15), as fp32."""
    word = tl.where(n < 8, tl.full(n.shape, _IQ4_LO, tl.int64), _IQ4_HI)
    b = ((word >> (8 * (n % 8)).to(tl.int64)) & 0xFF).to(tl.int32)
    return tl.where(b >= 128, b - 256, b).to(tl.float32)


@triton.jit
def _i8(p, m):
    return tl.load(p.to(tl.pointer_type(tl.int8)), mask=m, other=0).to(tl.int32)


@triton.jit
def _signed(v, sign_byte, j):
    """v, negated where bit j of the sign byte is set."""
    return tl.where(((sign_byte >> j) & 1) != 0, -v, v)


@triton.jit
def _xxs_tile(blk, i, m, tab, GRID: tl.constexpr, G: tl.constexpr, MUL: tl.constexpr):
    """IQ2_XXS (G = 8 values a grid row) / IQ3_XXS (G = 4): per sub-block of 32 a u32 of 4 x 7
    sign-index bits and a 4-bit scale; grid indices one byte each."""
    ib = i // 32
    g = (i % 32) // 8
    j = i % 8
    aux = blk + 2 + (8 * ib + 4 if G == 8 else 64 + 4 * ib)
    b3 = _u8(aux + 3, m)
    low = _u8(aux, m) | (_u8(aux + 1, m) << 8) | (_u8(aux + 2, m) << 16) | ((b3 & 0xF) << 24)
    db = _f16_at(blk, m) * (0.5 + (b3 >> 4).to(tl.float32)) * MUL
    sb = _u8(tab + _T_KSIGNS + ((low >> (7 * g)) & 127), m)
    if G == 8:
        q = _u8(blk + 2 + 8 * ib + g, m)
    else:
        q = _u8(blk + 2 + 8 * ib + 2 * g + j // 4, m)
    gv = _i8(tab + GRID + q * G + j % G, m).to(tl.float32)
    return _signed(db * gv, sb, j)


@triton.jit
def _iq1_tile(blk, i, m, tab, T: tl.constexpr):
    """IQ1_S / IQ1_M: dl (grid + delta), grid rows of 8 in -1, 0, 1."""
    t = i // 8
    if T == _IQ1_S:
        qh = _u8(blk + 34 + 2 * (i // 32), m) | (_u8(blk + 35 + 2 * (i // 32), m) << 8)
        dl = _f16_at(blk, m) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        q = _u8(blk + 2 + t, m) | (((qh >> (3 * (t % 4))) & 7) << 8)
        neg = (qh & 0x8000) != 0
    else:  # IQ1_M: qs[32], qh[16], 4 u16 scales whose top nibbles hold d
        sc = blk + 48
        bits = (_u8(sc + 1, m) >> 4) | (_u8(sc + 3, m) & 0xF0)
        bits = bits | ((_u8(sc + 5, m) >> 4) << 8) | ((_u8(sc + 7, m) >> 4) << 12)
        d = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        s = i // 16
        w16 = _u8(sc + 2 * (s // 4), m) | (_u8(sc + 2 * (s // 4) + 1, m) << 8)
        dl = d * (2 * ((w16 >> (3 * (s % 4))) & 7) + 1).to(tl.float32)
        h = _u8(blk + 32 + t // 2, m) >> (4 * (t % 2))
        q = _u8(blk + t, m) | ((h & 7) << 8)
        neg = (h & 8) != 0
    gv = _i8(tab + _T_IQ1_S + q * 8 + i % 8, m).to(tl.float32)
    return dl * (gv + tl.where(neg, -_IQ1_DELTA, _IQ1_DELTA))


@triton.jit
def _iq_tile(row, k, m, tab, T: tl.constexpr):
    """`_ggml_tile` of the IQ types whose codes index gguf-py's grids (in `tab`)."""
    i = k % 256
    if T == _IQ2_XXS:
        w = _xxs_tile(row + (k // 256) * 66, i, m, tab, _T_IQ2_XXS, 8, 0.25)
    elif T == _IQ3_XXS:
        w = _xxs_tile(row + (k // 256) * 98, i, m, tab, _T_IQ3_XXS, 4, 0.5)
    elif T == _IQ2_XS:  # d, qs[32] u16 (9-bit grid index, 7-bit sign index), scales[8]
        blk = row + (k // 256) * 74
        s = i // 16
        sc = (_u8(blk + 66 + s // 2, m) >> (4 * (s % 2))) & 0xF
        db = _f16_at(blk, m) * (0.5 + sc.to(tl.float32)) * 0.25
        t = i // 8
        q16 = _u8(blk + 2 + 2 * t, m) | (_u8(blk + 3 + 2 * t, m) << 8)
        gv = _i8(tab + _T_IQ2_XS + (q16 & 511) * 8 + i % 8, m).to(tl.float32)
        w = _signed(db * gv, _u8(tab + _T_KSIGNS + (q16 >> 9), m), i % 8)
    elif T == _IQ2_S:  # d, qs[32], signs[32], qh[8] (2 bits a row), scales[8]
        blk = row + (k // 256) * 82
        s = i // 16
        sc = (_u8(blk + 74 + s // 2, m) >> (4 * (s % 2))) & 0xF
        db = _f16_at(blk, m) * (0.5 + sc.to(tl.float32)) * 0.25
        t = i // 8
        q = _u8(blk + 2 + t, m) | (((_u8(blk + 66 + t // 4, m) >> (2 * (t % 4))) & 3) << 8)
        gv = _i8(tab + _T_IQ2_S + q * 8 + i % 8, m).to(tl.float32)
        w = _signed(db * gv, _u8(blk + 34 + t, m), i % 8)
    elif T == _IQ3_S:  # d, qs[64], qh[8] (a bit a row), signs[32], scales[4]
        blk = row + (k // 256) * 110
        ib = i // 32
        sc = (_u8(blk + 106 + ib // 2, m) >> (4 * (ib % 2))) & 0xF
        db = _f16_at(blk, m) * (1 + 2 * sc).to(tl.float32)
        t = i // 4
        q = _u8(blk + 2 + t, m) | (((_u8(blk + 66 + t // 8, m) >> (t % 8)) & 1) << 8)
        gv = _i8(tab + _T_IQ3_S + q * 4 + i % 4, m).to(tl.float32)
        w = _signed(db * gv, _u8(blk + 74 + i // 8, m), i % 8)
    elif T == _IQ1_S:
        w = _iq1_tile(row + (k // 256) * 50, i, m, tab, T)
    else:  # IQ1_M
        w = _iq1_tile(row + (k // 256) * 56, i, m, tab, T)
    return w


@triton.jit
def _super_block_tile(row, k, m, tab, T: tl.constexpr):
    """`_ggml_tile` of the types in super-blocks of 256 (K-quants, IQ4_XS)."""
    if T == _Q2_K:  # scales[16] (sc | mn << 4), qs[64], d, dmin; sub-blocks of 16
        i = k % 256
        blk = row + (k // 256) * 84
        q = (_u8(blk + 16 + (i // 128) * 32 + i % 32, m) >> (2 * ((i % 128) // 32))) & 3
        s = _u8(blk + i // 16, m)
        w = _f16_at(blk + 80, m) * (s & 0xF).to(tl.float32) * q.to(tl.float32)
        w = w - _f16_at(blk + 82, m) * (s >> 4).to(tl.float32)
    elif T == _Q3_K:  # hmask[32], qs[64], scales[12] (6 bits, offset 32), d
        i = k % 256
        blk = row + (k // 256) * 110
        l32 = i % 32
        ql = (_u8(blk + 32 + (i // 128) * 32 + l32, m) >> (2 * ((i % 128) // 32))) & 3
        q = ql - 4 * (1 - ((_u8(blk + l32, m) >> (i // 32)) & 1))  # a clear high bit: -4
        s = i // 16
        lo = (_u8(blk + 96 + s % 8, m) >> (4 * (s // 8))) & 0xF
        hi = (_u8(blk + 104 + s % 4, m) >> (2 * (s // 4))) & 3
        sc = ((lo | (hi << 4)) - 32).to(tl.float32)
        w = _f16_at(blk + 108, m) * sc * q.to(tl.float32)
    elif T == _IQ4_XS:  # d, scales_h (u16), scales_l[4], 8 sub-blocks of 32 IQ4_NL nibbles
        i = k % 256
        blk = row + (k // 256) * 136
        s = i // 32
        j = i % 32
        n = _nib(_u8(blk + 8 + 16 * s + j % 16, m), j >= 16)
        lo = (_u8(blk + 4 + s // 2, m) >> (4 * (s % 2))) & 0xF
        hi = (_u8(blk + 2 + s // 4, m) >> (2 * (s % 4))) & 3
        sc = ((lo | (hi << 4)) - 32).to(tl.float32)
        w = _f16_at(blk, m) * sc * _iq4_level(n)
    elif T == _Q4_K or T == _Q5_K:
        i = k % 256
        qs = 16 if T == _Q4_K else 48  # the nibbles' byte
        blk = row + (k // 256) * (144 if T == _Q4_K else 176)
        j = i // 64
        hi = (i % 64) >= 32
        sb = 2 * j + hi.to(tl.int32)
        l32 = i % 32
        q = _nib(_u8(blk + qs + 32 * j + l32, m), hi)
        if T == _Q5_K:
            q += ((_u8(blk + 16 + l32, m) >> sb) & 1) << 4
        sc, mn = _k_scale_min(blk + 4, sb, m)
        w = _f16_at(blk, m) * sc * q.to(tl.float32) - _f16_at(blk + 2, m) * mn
    elif T == _Q6_K:
        i = k % 256
        blk = row + (k // 256) * 210
        half = i // 128
        g = (i % 128) // 32
        l32 = i % 32
        ql = _nib(_u8(blk + half * 64 + l32 + (g % 2) * 32, m), g >= 2)
        qh = (_u8(blk + 128 + half * 32 + l32, m) >> (2 * g)) & 3
        q = (ql | (qh << 4)) - 32
        sc = tl.load(
            (blk + 192 + half * 8 + 2 * g + l32 // 16).to(tl.pointer_type(tl.int8)), mask=m, other=0
        )
        w = _f16_at(blk + 208, m) * sc.to(tl.float32) * q.to(tl.float32)
    else:  # the IQ types on grids
        w = _iq_tile(row, k, m, tab, T)
    return w


@triton.jit
def _ggml_tile(row, k, m, tab, T: tl.constexpr):
    """fp32 weights at columns `k` ([1, BK] int32) of rows starting at byte pointers
    `row` ([R, 1]) in GGML type `T` (its type id); masked elements read as 0."""
    if T == _F32:
        w = tl.load((row + 4 * k).to(tl.pointer_type(tl.float32)), mask=m, other=0.0)
    elif T == _F16:
        w = tl.load((row + 2 * k).to(tl.pointer_type(tl.float16)), mask=m, other=0.0)
        w = w.to(tl.float32)
    elif T == _BF16:  # the upper half of an fp32
        b = tl.load((row + 2 * k).to(tl.pointer_type(tl.int16)), mask=m, other=0)
        w = ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif T == _Q8_0:
        blk = row + (k // 32) * 34
        q = tl.load((blk + 2 + k % 32).to(tl.pointer_type(tl.int8)), mask=m, other=0)
        w = _f16_at(blk, m) * q.to(tl.float32)
    elif T == _Q4_0 or T == _Q4_1:
        i = k % 32
        blk = row + (k // 32) * (18 if T == _Q4_0 else 20)
        n = _nib(_u8(blk + (2 if T == _Q4_0 else 4) + i % 16, m), i >= 16).to(tl.float32)
        if T == _Q4_0:
            w = _f16_at(blk, m) * (n - 8.0)
        else:
            w = _f16_at(blk, m) * n + _f16_at(blk + 2, m)
    elif T == _Q5_0 or T == _Q5_1:
        i = k % 32
        qh = 2 if T == _Q5_0 else 4  # the high bits' byte; the nibbles follow them
        blk = row + (k // 32) * (22 if T == _Q5_0 else 24)
        hb = (_u8(blk + qh + i // 8, m) >> (i % 8)) & 1
        q = (_nib(_u8(blk + qh + 4 + i % 16, m), i >= 16) | (hb << 4)).to(tl.float32)
        if T == _Q5_0:
            w = _f16_at(blk, m) * (q - 16.0)
        else:
            w = _f16_at(blk, m) * q + _f16_at(blk + 2, m)
    elif T == _MXFP4:  # e2m1 codes times an e8m0 scale
        i = k % 32
        blk = row + (k // 32) * 17
        n = _nib(_u8(blk + 1 + i % 16, m), i >= 16)
        c = n & 7
        mag = tl.where(c < 5, c, tl.where(c == 5, 6, tl.where(c == 6, 8, 12)))  # 2 |v|
        v = tl.where(n >= 8, -mag, mag).to(tl.float32)
        e = _u8(blk, m)
        half = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        w = v * half  # (2 v) * 2^(e - 128)
    elif T == _IQ4_NL:  # d, then 16 bytes of nibbles indexing the levels
        i = k % 32
        blk = row + (k // 32) * 18
        w = _f16_at(blk, m) * _iq4_level(_nib(_u8(blk + 2 + i % 16, m), i >= 16))
    elif T == _FP8_B128:  # an fp32 tile scale, then 128 e4m3 codes
        blk = row + (k // 128) * 132
        c = _u8(blk + 4 + k % 128, m)
        s = tl.load(blk.to(tl.pointer_type(tl.float32)), mask=m, other=0.0)
        w = s * _fp8_e4m3_to_f32(c)
    else:  # the K-quants' super-blocks of 256
        w = _super_block_tile(row, k, m, tab, T)
    return w


@triton.jit
def _ggml_dot(part, rows, rmask, k0, K, RB, v_ptr, tab, T: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k w[rows, k] * v[k] over the tile k0 <= k < k0 + BLOCK_K of a GGML matrix at
    byte pointer `part` (rows of RB bytes); v fp32/bf16/fp16 at `v_ptr`."""
    ks = k0 + tl.arange(0, BLOCK_K)
    km = ks < K
    v = tl.load(v_ptr + ks, mask=km, other=0.0).to(tl.float32)
    m = rmask[:, None] & km[None, :]
    w = _ggml_tile(part + rows[:, None].to(tl.int64) * RB, ks[None, :], m, tab, T)
    return tl.sum(w * v[None, :], axis=1)


@triton.jit
def _ggml_gate_up_kernel(
    x_ptr,
    s_xt,
    slab_ptr,
    s_slot,
    slots_ptr,
    table_ptr,  # slot table [E] (HAS_TABLE): slots_ptr then holds expert ids
    h_ptr,
    bias_ptr,  # [T*K, 2F + H] fp32 per routed expert (HAS_BIAS)
    w_ptr,  # [T, K] gate weights scaling the input (SCALE_INPUT)
    T,
    H,
    F,
    C,
    alpha,
    limit,
    gate_off,
    up_off,
    RB_G,
    RB_U,
    tab_ptr,  # the IQ types' grids and signs (`iq_table`)
    K: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    T_GATE: tl.constexpr,
    T_UP: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tk = tl.program_id(0)
    t = tk // K
    fs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fm = fs < F
    slot = load_slot(slots_ptr, tk, table_ptr, HAS_TABLE)
    ok = (slot >= 0) & (slot < C)  # out-of-range slots read nothing (the wrapper checks)
    rm = ok & fm
    base = slab_ptr + slot.to(tl.int64) * s_slot
    x_row = x_ptr + t * s_xt
    acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        acc_g += _ggml_dot(base + gate_off, fs, rm, h0, H, RB_G, x_row, tab_ptr, T_GATE, BLOCK_H)
        acc_u += _ggml_dot(base + up_off, fs, rm, h0, H, RB_U, x_row, tab_ptr, T_UP, BLOCK_H)
    if SCALE_INPUT:
        wk = tl.load(w_ptr + tk).to(tl.float32)
        acc_g, acc_u = acc_g * wk, acc_u * wk
    h = glu(acc_g, acc_u, bias_ptr + tk * (2 * F + H), fs, fm, F, alpha, limit, HAS_BIAS, ACT)
    tl.store(h_ptr + tk * F + fs, h, mask=fm)


@triton.jit
def _ggml_down_kernel(
    h_ptr,
    slab_ptr,
    s_slot,
    slots_ptr,
    table_ptr,
    w_ptr,
    y_ptr,
    s_yt,
    part_ptr,  # [T, K, H] fp32 per-expert partials (SPLIT_K)
    bias_ptr,  # [T*K, 2F + H] fp32 (HAS_BIAS): the down bias at 2F
    T,
    H,
    F,
    C,
    down_off,
    RB_D,
    tab_ptr,
    K: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    SPLIT_K: tl.constexpr,  # one expert a program (grid z = K), partials summed after
    T_DOWN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    t = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hs < H
    y = tl.zeros([BLOCK_H], dtype=tl.float32)
    j0 = tl.program_id(2)  # 0 unless SPLIT_K
    for j in range(j0, j0 + (1 if SPLIT_K else K)):
        slot = load_slot(slots_ptr, t * K + j, table_ptr, HAS_TABLE)
        ok = (slot >= 0) & (slot < C)
        rm = ok & hm
        wj = 1.0 if SCALE_INPUT else tl.load(w_ptr + t * K + j).to(tl.float32)
        base = slab_ptr + slot.to(tl.int64) * s_slot
        h_row = h_ptr + (t * K + j) * F
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            acc += _ggml_dot(base + down_off, hs, rm, f0, F, RB_D, h_row, tab_ptr, T_DOWN, BLOCK_F)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + (t * K + j) * (2 * F + H) + 2 * F + hs, mask=hm, other=0.0)
        y += tl.where(ok, wj * acc, 0.0)  # an absent expert (slot -1) adds nothing
    store_down(y, y_ptr, s_yt, part_ptr, t, j0, H, hs, hm, K, SPLIT_K)


@functools.lru_cache(maxsize=256)
def ggml_launch_config(lay: GGMLLayout) -> tuple[Mapping[str, int], Mapping[str, int]]:
    """Constexprs (all but K) and warps of the gate/up and down kernels for `lay`."""
    H, F = lay.hidden_size, lay.ffn_size
    # 16 output rows a program, as the other quantized kernels (the decoded tiles stay in
    # registers); reduction tiles of 128 columns.
    t_gate, t_up, t_down = lay.triton_type_ids
    gate_up = dict(
        T_GATE=t_gate,
        T_UP=t_up,
        BLOCK_F=16,
        BLOCK_H=min(pow2(H, 16), 128),
        num_warps=4,
    )
    down = dict(
        T_DOWN=t_down,
        BLOCK_H=16,
        BLOCK_F=min(pow2(F, 16), 128),
        SPLIT_K=SPLIT_K_DEFAULT,
        num_warps=4,
    )
    return MappingProxyType(gate_up), MappingProxyType(down)


def ggml_part_args(
    lay: GGMLLayout, device: torch.device
) -> tuple[dict[str, object], dict[str, object]]:
    """Where the GGML kernels read a row's parts: the gate/up and down kernels' byte
    offsets and bytes per row, and the IQ tables on `device` (`psr_kernels.expert_ffn`'s
    launcher)."""
    tab = iq_table(device)
    gate_up = dict(gate_off=lay.gate, up_off=lay.up, RB_G=lay.rb_gate, RB_U=lay.rb_up, tab_ptr=tab)
    return gate_up, dict(down_off=lay.down, RB_D=lay.rb_down, tab_ptr=tab)


@triton.jit
def _ggml_decode_kernel(
    src, out, R, K, RB, tab, T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    rs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rs < R)[:, None] & (ks < K)[None, :]
    w = _ggml_tile(src + rs[:, None].to(tl.int64) * RB, ks[None, :], m, tab, T)
    tl.store(out + rs[:, None].to(tl.int64) * K + ks[None, :], w, mask=m)


def decode_ggml(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> torch.Tensor:
    """fp32 `[R, K]` of a GGML matrix decoded by the kernels' element decoder (`_ggml_tile`),
    on the device Triton runs on: for tests and for dequantizing dense tensors there."""
    from psr_kernels._common import check_launchable

    bt = block_type("decode_ggml", type_name)
    R, K = int(shape[0]), int(shape[1])
    rb = ggml_row_bytes(type_name, K)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.numel() != R * rb:
        raise ValueError(f"decode_ggml: {type_name} [{R}, {K}] needs {R * rb} uint8 bytes")
    check_launchable("decode_ggml", data)
    src = data.reshape(-1).contiguous()
    if bt.is_float and src.data_ptr() % 4:
        src = src.clone()
    out = torch.empty(R, K, dtype=torch.float32, device=data.device)
    grid = (triton.cdiv(R, 16), triton.cdiv(K, 128))
    tab = iq_table(data.device)
    _ggml_decode_kernel[grid](src, out, R, K, rb, tab, T=bt.type_id, BLOCK_R=16, BLOCK_K=128)
    return out
