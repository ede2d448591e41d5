"""Quantized expert copies: one packed uint8 slab row per expert, run straight from the slab.

    y[t] = sum_j w[t, j] * down_j( silu(gate_j x[t]) * up_j x[t] ),  expert j in slot slots[t, j]

`expert_ffn(..., fmt=...)` (psr_kernels.expert_ffn) computes it from such a slab: as for
float rows, but the slab is `[C, nbytes]` uint8 and every row holds one expert's
quantized weights and their fp32 scales, so a miss or prefetch moves 1/2 (int8, fp8) or
about 1/4 (int4) of the bf16 bytes. Weight-only, symmetric formats (`FORMATS`):

* `int8`: per output channel; q = round(w / s) in [-127, 127], s = max|w_row| / 127.
* `fp8`: OCP e4m3 "FN" (bias 7, max 448, no inf, NaN = 0x7F/0xFF), per output channel;
  s = max|w_row| / 448, codes = e4m3(clamp(w / s, +-448)) with round-to-nearest-even.
  The kernels decode the bits with integer arithmetic, so no fp8 hardware is needed.
* `int4`: group-wise along the input dim (G = group_size, a power of two in [16, 256],
  must divide the dim; a dim smaller than G is one group, the whole row); q in [-7, 7],
  s = max|w_group| / 7; two signed (two's complement) nibbles per byte, low nibble
  first (even column), each row starting on a fresh byte (ceil(K/2) bytes per row).

An all-zero row or group gets s = 1. Row layout (`QuantLayout`; every part starts at a
multiple of 16 bytes and `nbytes` is one too, so fp32 scale loads stay aligned in every
slot of the slab):

    part    shape (elements)    bytes                     dtype
    gate    [F, H]              F * B(H)                  codes
    up      [F, H]              F * B(H)                  codes
    down    [H, F]              H * B(F)                  codes
    gate_s  [F, H / G_H]        4 * F * (H / G_H)         fp32
    up_s    [F, H / G_H]        4 * F * (H / G_H)         fp32
    down_s  [H, F / G_F]        4 * H * (F / G_F)         fp32

B(K) = K bytes per row for int8/fp8 and ceil(K / 2) for int4; G_H, G_F are the groups
along H and F (the whole row for int8/fp8). `quantize_expert` writes a row,
`dequantize_expert` reads one (or a batch) back in fp32: the reference.

Kernels: `_quant_gate_up_kernel` then `_quant_down_kernel` (the one launcher, which
`expert_ffn` calls for a quantized `fmt`), the structure of the float-row kernels (fp32
accumulation, fixed reduction order, no atomics: bit-reproducible), with the format a
constexpr. Each reduction tile lies inside one scale group, so a tile's
partial dot product of the raw codes is scaled once per row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from psr_kernels._common import SPLIT_K_DEFAULT, check_launchable, load_slot, pow2, store_down
from psr_kernels.activation import glu
from psr_kernels.rowformat import (
    ALIGN,
    FP8,
    INT4,
    INT8,
    QUANT_FORMATS,
    QuantLayout,
    RowFormat,
    quant_format,
    quant_layout,
)

FORMATS: tuple[str, ...] = QUANT_FORMATS
_ALIGN = ALIGN


def bytes_ratio(
    fmt: RowFormat | str,
    hidden_size: int,
    ffn_size: int,
    group_size: int = 128,
    base_itemsize: int = 2,
) -> float:
    """Bytes of a quantized expert row (scales and padding included) over the unquantized
    expert's 3*H*F*base_itemsize: what a copy of the format costs relative to the model dtype."""
    lay = quant_layout("bytes_ratio", fmt, hidden_size, ffn_size, group_size)
    return lay.nbytes / (3 * hidden_size * ffn_size * base_itemsize)


# --------------------------------------------------------------------------- host side


def _int8_codes(v: torch.Tensor) -> torch.Tensor:
    return v.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)


def _int8_values(codes: torch.Tensor, K: int) -> torch.Tensor:
    return codes.view(torch.int8).float()


def _fp8_codes(v: torch.Tensor) -> torch.Tensor:
    # Clamp first: the cast itself would map |v| > 448 to NaN (e4m3fn has no inf).
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _fp8_values(codes: torch.Tensor, K: int) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


def _int4_codes(v: torch.Tensor) -> torch.Tensor:
    n = v.round().clamp(-7, 7).to(torch.int32) & 0xF  # two's complement nibbles
    if v.shape[-1] % 2:
        n = torch.nn.functional.pad(n, (0, 1))
    return (n[:, 0::2] | (n[:, 1::2] << 4)).to(torch.uint8)


def _int4_values(codes: torch.Tensor, K: int) -> torch.Tensor:
    b = codes.to(torch.int32)
    n = torch.stack([b & 0xF, b >> 4], -1).flatten(-2)[..., :K]
    return ((n ^ 8) - 8).float()  # sign-extend the nibble


class _Codec(NamedTuple):
    encode: Callable[[torch.Tensor], torch.Tensor]  # scaled fp32 [R, K] -> codes [R, B(K)]
    decode: Callable[[torch.Tensor, int], torch.Tensor]  # codes [..., R, B(K)] -> [..., R, K]


# The host-side codes of each quantized format (the kernels' side is the FMT constexpr).
_CODECS: Mapping[RowFormat, _Codec] = MappingProxyType(
    {
        INT8: _Codec(_int8_codes, _int8_values),
        FP8: _Codec(_fp8_codes, _fp8_values),
        INT4: _Codec(_int4_codes, _int4_values),
    }
)


def _quantize_matrix(
    w: torch.Tensor, fmt: RowFormat, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [R, B(K)], scales fp32 [R, K / group]) of one fp32 matrix [R, K]."""
    R, K = w.shape
    qmax = fmt.qmax
    wg = w.reshape(R, K // group, group)
    s = wg.abs().amax(-1) / qmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    v = (wg / s[..., None]).reshape(R, K)
    codes = _CODECS[fmt].encode(v)
    return codes.contiguous(), s.contiguous()


def quantize_expert(
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    fmt: RowFormat | str,
    *,
    group_size: int = 128,
) -> torch.Tensor:
    """One packed slab row (uint8 `[nbytes]`, CPU) of an expert's `gate [F, H]`,
    `up [F, H]`, `down [H, F]` (any float dtype; quantized from their fp32 values)."""
    op = "quantize_expert"
    fmt = quant_format(op, fmt)
    for name, m in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(m, torch.Tensor) or m.dim() != 2 or not m.is_floating_point():
            raise ValueError(f"{op}: {name} must be a 2-D float tensor")
    F, H = gate.shape
    if up.shape != (F, H) or down.shape != (H, F):
        raise ValueError(
            f"{op}: expected gate/up [F, H] and down [H, F], got "
            f"{list(gate.shape)}, {list(up.shape)}, {list(down.shape)}"
        )
    lay = quant_layout(op, fmt, H, F, group_size)
    row = torch.zeros(lay.nbytes, dtype=torch.uint8)
    parts = [
        (_quantize_matrix(m.detach().to("cpu", torch.float32), fmt, g), at, s_at)
        for m, g, at, s_at in (
            (gate, lay.group_h, lay.gate, lay.gate_scale),
            (up, lay.group_h, lay.up, lay.up_scale),
            (down, lay.group_f, lay.down, lay.down_scale),
        )
    ]
    for (codes, scales), at, s_at in parts:
        row[at : at + codes.numel()] = codes.reshape(-1)
        sb = scales.reshape(-1).view(torch.uint8)
        row[s_at : s_at + sb.numel()] = sb
    return row


def _dequantize_matrix(
    row: torch.Tensor, at: int, s_at: int, R: int, K: int, rb: int, group: int, fmt: RowFormat
) -> torch.Tensor:
    batch = row.shape[:-1]
    codes = row[..., at : at + R * rb].reshape(*batch, R, rb)
    ng = K // group
    scales = row[..., s_at : s_at + 4 * R * ng].contiguous().view(torch.float32)
    scales = scales.reshape(*batch, R, ng, 1)
    q = _CODECS[fmt].decode(codes, K)
    return (q.reshape(*batch, R, ng, group) * scales).reshape(*batch, R, K)


def dequantize_expert(
    row: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    fmt: RowFormat | str,
    *,
    group_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 `(gate [..., F, H], up [..., F, H], down [..., H, F])` of packed rows
    `[..., nbytes]` (one row, `slab`, or `slab[slots]`): the reference dequantizer."""
    op = "dequantize_expert"
    lay = quant_layout(op, fmt, hidden_size, ffn_size, group_size)
    fmt = lay.fmt
    if not isinstance(row, torch.Tensor) or row.dim() < 1 or row.dtype != torch.uint8:
        raise ValueError(f"{op}: row must be a uint8 tensor with at least 1 dim")
    if row.shape[-1] != lay.nbytes:
        raise ValueError(
            f"{op}: rows hold {row.shape[-1]} bytes, expected {lay.nbytes} "
            f"({fmt}, H={hidden_size}, F={ffn_size})"
        )
    H, F = lay.hidden_size, lay.ffn_size
    gate = _dequantize_matrix(
        row, lay.gate, lay.gate_scale, F, H, lay.row_bytes_h, lay.group_h, fmt
    )
    up = _dequantize_matrix(row, lay.up, lay.up_scale, F, H, lay.row_bytes_h, lay.group_h, fmt)
    down = _dequantize_matrix(
        row, lay.down, lay.down_scale, H, F, lay.row_bytes_f, lay.group_f, fmt
    )
    return gate, up, down


# --------------------------------------------------------------------------- kernels


@triton.jit
def _fp8_e4m3_to_f32(c):
    """fp32 value of e4m3fn codes `c` (int32 in [0, 255]) by integer arithmetic."""
    e = (c >> 3) & 0xF
    m = c & 0x7
    # Normal: exponent e - 7 rebased to fp32's bias 127; built as bits, no fp8 hardware.
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # e == 0: m * 2^-9 (no fp32 subnormals involved)
    mag = tl.where(e == 0, sub, normal)
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    return mag * tl.where(c >= 128, -1.0, 1.0)  # a product keeps -0.0 (0 - x would not)


@triton.jit
def _qdot(w_ptr, rows, rmask, k0, K, RB, v_ptr, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k q[rows, k] * v[k] over the tile k0 <= k < k0 + BLOCK_K of a code matrix at
    byte pointer `w_ptr` (rows of RB bytes); v fp32/bf16/fp16 at `v_ptr`. Raw codes: the
    caller applies the tile's scales."""
    r64 = rows[:, None].to(tl.int64)
    if FMT == 2:
        # int4: a tile of BLOCK_K / 2 bytes, low nibble = even column, high = odd column.
        i = tl.arange(0, BLOCK_K // 2)
        ke = k0 + 2 * i
        me = ke < K
        ve = tl.load(v_ptr + ke, mask=me, other=0.0).to(tl.float32)
        vo = tl.load(v_ptr + ke + 1, mask=(ke + 1) < K, other=0.0).to(tl.float32)
        bm = rmask[:, None] & me[None, :]
        b = tl.load(w_ptr + r64 * RB + (k0 // 2 + i)[None, :], mask=bm, other=0).to(tl.int32)
        lo = ((b & 0xF) ^ 8) - 8  # sign-extend the nibbles
        hi = ((b >> 4) ^ 8) - 8
        prod = lo.to(tl.float32) * ve[None, :] + hi.to(tl.float32) * vo[None, :]
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < K
        v = tl.load(v_ptr + ks, mask=km, other=0.0).to(tl.float32)
        wm = rmask[:, None] & km[None, :]
        if FMT == 0:
            p8 = w_ptr.to(tl.pointer_type(tl.int8))
            q = tl.load(p8 + r64 * RB + ks[None, :], mask=wm, other=0).to(tl.float32)
        else:
            c = tl.load(w_ptr + r64 * RB + ks[None, :], mask=wm, other=0).to(tl.int32)
            q = _fp8_e4m3_to_f32(c)
        prod = q * v[None, :]
    return tl.sum(prod, axis=1)


@triton.jit
def _tile_scales(s_ptr, rows, rmask, k0, G, NG):
    """fp32 scales of `rows` for the group holding column k0 (scale parts at byte pointer
    `s_ptr`, NG groups of G per row)."""
    sp = s_ptr.to(tl.pointer_type(tl.float32))
    return tl.load(sp + rows.to(tl.int64) * NG + k0 // G, mask=rmask, other=0.0)


@triton.jit
def _quant_gate_up_kernel(
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
    alpha,  # the clamped SwiGLU's (ACT == 1)
    limit,
    gate_off,  # byte offsets of the parts in a slab row (QuantLayout), multiples of 16
    up_off,
    gate_s_off,
    up_s_off,
    RB,  # bytes per gate/up row
    G,  # scale group along H
    NG,  # groups per row
    K: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    FMT: tl.constexpr,
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
    base = slab_ptr + slot * s_slot
    x_row = x_ptr + t * s_xt
    acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):  # each tile lies in one scale group (the launch config)
        dg = _qdot(base + gate_off, fs, rm, h0, H, RB, x_row, FMT, BLOCK_H)
        du = _qdot(base + up_off, fs, rm, h0, H, RB, x_row, FMT, BLOCK_H)
        acc_g += dg * _tile_scales(base + gate_s_off, fs, rm, h0, G, NG)
        acc_u += du * _tile_scales(base + up_s_off, fs, rm, h0, G, NG)
    if SCALE_INPUT:
        wk = tl.load(w_ptr + tk).to(tl.float32)
        acc_g, acc_u = acc_g * wk, acc_u * wk
    h = glu(acc_g, acc_u, bias_ptr + tk * (2 * F + H), fs, fm, F, alpha, limit, HAS_BIAS, ACT)
    tl.store(h_ptr + tk * F + fs, h, mask=fm)


@triton.jit
def _quant_down_kernel(
    h_ptr,
    slab_ptr,
    s_slot,
    slots_ptr,
    table_ptr,  # slot table [E] (HAS_TABLE): slots_ptr then holds expert ids
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
    down_s_off,
    RB,  # bytes per down row
    G,  # scale group along F
    NG,
    K: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    SPLIT_K: tl.constexpr,  # one expert a program (grid z = K), partials summed after
    FMT: tl.constexpr,
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
        base = slab_ptr + slot * s_slot
        h_row = h_ptr + (t * K + j) * F
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            d = _qdot(base + down_off, hs, rm, f0, F, RB, h_row, FMT, BLOCK_F)
            acc += d * _tile_scales(base + down_s_off, hs, rm, f0, G, NG)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + (t * K + j) * (2 * F + H) + 2 * F + hs, mask=hm, other=0.0)
        y += tl.where(ok, wj * acc, 0.0)  # an absent expert (slot -1) adds nothing
    store_down(y, y_ptr, s_yt, part_ptr, t, j0, H, hs, hm, K, SPLIT_K)


# --------------------------------------------------------------------------- ops


def _reduction_block(group: int, cap: int) -> int:
    """A reduction tile inside one scale group: a power-of-two group is tiled by
    min(group, cap); a group that is not one (a whole short int4 row) is one tile."""
    if group & (group - 1) == 0:
        return max(16, min(group, cap))
    return pow2(group, 16)


@functools.lru_cache(maxsize=256)
def quant_launch_config(lay: QuantLayout) -> tuple[Mapping[str, int], Mapping[str, int]]:
    """Constexprs (all but K) and warps of the gate/up and down kernels for `lay` (no
    autotuning; the same for every T; cached per layout: read-only mappings)."""
    H, F = lay.hidden_size, lay.ffn_size
    code = lay.fmt.code
    if lay.fmt.grouped:
        bh, bf = _reduction_block(lay.group_h, 128), _reduction_block(lay.group_f, 128)
    else:  # one group per row: any tiling
        bh, bf = min(pow2(H, 16), 128), min(pow2(F, 16), 128)
    # 16 output rows per program: the decoded [16, 128] tiles fit in registers without
    # spills on sm_80/sm_90 (ptxas -v; expert_ffn's 64-row gate/up tile and 32-64-row down
    # tiles spill with fp8 decoding), and T = 1 still launches k * F / 16 gate/up and H / 16
    # down programs (512 and 128 for OLMoE).
    gate_up = dict(FMT=code, BLOCK_F=16, BLOCK_H=bh, num_warps=4)
    down = dict(FMT=code, BLOCK_H=16, BLOCK_F=bf, SPLIT_K=SPLIT_K_DEFAULT, num_warps=4)
    return MappingProxyType(gate_up), MappingProxyType(down)


def check_quant_slab(
    op: str,
    slab: torch.Tensor,
    fmt: RowFormat | str,
    hidden_size: int,
    ffn_size: int,
    group_size: int,
) -> QuantLayout:
    """The layout of `fmt`'s rows, after checking `slab` holds them: 2-D uint8
    `[C, nbytes]` (row contiguity is checked with the float slabs')."""
    if not isinstance(slab, torch.Tensor):
        raise TypeError(f"{op}: slab must be a tensor, got {type(slab).__name__}")
    if slab.dtype != torch.uint8 or slab.dim() != 2:
        raise TypeError(
            f"{op}: slab must be a 2-D uint8 tensor [C, nbytes], got {slab.dtype} "
            f"{list(slab.shape)}"
        )
    lay = quant_layout(op, fmt, hidden_size, ffn_size, group_size)
    if slab.shape[1] != lay.nbytes:
        raise ValueError(
            f"{op}: slab rows hold {slab.shape[1]} bytes, expected {lay.nbytes} "
            f"({fmt}, H={hidden_size}, F={ffn_size}, group_size={group_size})"
        )
    return lay


def check_aligned(op: str, slab: torch.Tensor) -> None:
    """The kernels read fp32 scales at 16-aligned offsets of each row: the rows must be
    aligned too (the references do not care)."""
    if slab.data_ptr() % _ALIGN or slab.stride(0) % _ALIGN:
        raise ValueError(
            f"{op}: slab rows must start at 16-byte aligned addresses (data_ptr "
            f"{slab.data_ptr()} and row stride {slab.stride(0)} must be multiples of 16)"
        )


def quant_part_args(lay: QuantLayout) -> tuple[dict[str, int], dict[str, int]]:
    """Where the quantized kernels read a row's parts: the gate/up and down kernels' byte
    offsets, bytes per row and scale groups (`psr_kernels.expert_ffn`'s launcher)."""
    gate_up = dict(
        gate_off=lay.gate,
        up_off=lay.up,
        gate_s_off=lay.gate_scale,
        up_s_off=lay.up_scale,
        RB=lay.row_bytes_h,
        G=lay.group_h,
        NG=lay.groups_h,
    )
    down = dict(
        down_off=lay.down,
        down_s_off=lay.down_scale,
        RB=lay.row_bytes_f,
        G=lay.group_f,
        NG=lay.groups_f,
    )
    return gate_up, down


@triton.jit
def _fp8_decode_kernel(c_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    c = tl.load(c_ptr + i, mask=m, other=0).to(tl.int32)
    tl.store(out_ptr + i, _fp8_e4m3_to_f32(c), mask=m)


def decode_fp8_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3fn codes (uint8) decoded by the kernels' integer decoder
    (`_fp8_e4m3_to_f32`), on the device Triton runs on: for tests and debugging."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError("decode_fp8_e4m3: codes must be a uint8 tensor")
    check_launchable("decode_fp8_e4m3", codes)
    flat = codes.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), dtype=torch.float32, device=codes.device)
    if flat.numel():
        _fp8_decode_kernel[(triton.cdiv(flat.numel(), 256),)](flat, out, flat.numel(), BLOCK=256)
    return out.reshape(codes.shape)
