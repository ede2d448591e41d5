"""Grouped dequant-GEMM of routed experts for prefill: many tokens, each expert's rows once.

    y[t] = sum_j w[t, j] * down_e( act(gate_e x[t], up_e x[t]) ),  e = ids[t, j]

The decode kernels (psr_kernels.expert_ffn) are GEMV-shaped: a program per routed
(token, expert), so T tokens read an expert's weights T times. Here the routed pairs are
sorted by expert (stable: within an expert, ascending token), each expert's run cut into
tiles of `GROUP_M` pairs (`expert_groups`: the tile table, as fused-MoE kernels build it),
and each program computes one tile against a block of one expert's rows with `tl.dot`:
the weight tile dequantized in registers from the slab row by the format's element decoder
(`_weight_tile`: float rows, `linear._quant_tile` for int8 / fp8 / int4 with their scale
groups, `ggml._ggml_tile` for every GGML block type and FP8_B128: the dense layers' and
decode kernels' own decoders), so a weight tile read serves GROUP_M tokens.
  1. `_grouped_gate_up_kernel`, grid (tiles, F / BLOCK_F): h[pair] = act(gate x, up x);
  2. `_grouped_down_kernel`, grid (tiles, H / BLOCK_H): y_pair[pair] = w (down h + bias);
then each token's k pairs are summed in order j = 0..k-1. No atomics: fp32 accumulation,
a fixed reduction order and block sizes fixed per row layout (never per token count), so
a token's result depends on its own row and experts only, whatever else is in the call.
The dots take fp32 operands: exact fp32 ("ieee") for fp32 activations, TF32 on tensor
cores for bf16 / fp16 activations (10 mantissa bits: more than the activations carry).

Options as the decode kernels: a slot table (ids are expert ids), `skip_absent`, the
clamped activation, per-expert biases, input scaling (Llama 4). `grouped_expert_ffn_ref`
(same arguments) is its plain-torch reference: each expert through `expert_row_ffn_ref`
over its tokens, in fp32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import triton
import triton.language as tl

from psr_kernels._common import check_launchable, load_slot, pow2
from psr_kernels.activation import SILU, Activation, glu
from psr_kernels.expert_ffn import (
    _check_ffn,
    _check_slot_range,
    _check_table,
    expert_row_ffn_ref,
)
from psr_kernels.ggml import _ggml_tile, iq_table
from psr_kernels.linear import _quant_tile
from psr_kernels.quant import check_aligned
from psr_kernels.rowformat import FormatLike, RowFormat, RowKind, RowLayout

# Routed pairs a program computes (the M of its tiles): fixed, so a token's sums never
# depend on how many tokens share its expert.
GROUP_M = 32
# `KIND` constexpr of the kernels: where `_weight_tile` decodes a part from.
_KIND: Mapping[RowKind, int] = MappingProxyType(
    {RowKind.FLOAT: 0, RowKind.QUANT: 1, RowKind.BLOCKS: 2}
)


@triton.jit
def _weight_tile(base, part, s_part, rows, rm, ks, km, K, RB, G, NG, tab,
                 KIND: tl.constexpr, CODE: tl.constexpr):  # fmt: skip
    """fp32 weights `[R, BK]` of rows `rows` at columns `ks` of one part (gate, up or down)
    of the slab row at `base`: float rows at element offset `part` (rows of K elements);
    quantized codes at byte `part`, their scales at byte `s_part` (NG groups of G a row);
    GGML blocks of type id CODE at byte `part` (rows of RB bytes). Masked ones read 0."""
    m = rm[:, None] & km[None, :]
    if KIND == 0:
        offs = rows[:, None].to(tl.int64) * K + ks[None, :]
        w = tl.load(base + part + offs, mask=m, other=0.0).to(tl.float32)
    elif KIND == 1:
        r64 = rows[:, None].to(tl.int64)
        s_rows = (base + s_part).to(tl.pointer_type(tl.float32)) + r64 * NG
        w = _quant_tile(base + part + r64 * RB, ks[None, :], m, s_rows, G, CODE)
    else:
        w = _ggml_tile(base + part + rows[:, None].to(tl.int64) * RB, ks[None, :], m, tab, CODE)
    return w


@triton.jit
def _tile(tiles_ptr, order_ptr, table_ptr, C, HAS_TABLE: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's tile: (expert, its slot, the sorted rows, their mask, their pairs,
    whether it has nothing to do: no rows (the bound's spare tiles), or a slot out of
    [0, C), which reads nothing, as in the decode kernels; the wrapper checks slots)."""
    at = tl.program_id(0) * 3
    e = tl.load(tiles_ptr + at)
    slot = load_slot(tiles_ptr, at, table_ptr, HAS_TABLE)
    first, end = tl.load(tiles_ptr + at + 1), tl.load(tiles_ptr + at + 2)
    rows = first + tl.arange(0, BLOCK_M)
    rm = rows < end
    p = tl.load(order_ptr + rows, mask=rm, other=0)
    idle = (first >= end) | (slot < 0) | (slot >= C)
    return e, slot, rows, rm, p, idle


@triton.jit(do_not_specialize=["K"])  # k = 1 (prefill's per-expert calls) and k > 1 share a binary
def _grouped_gate_up_kernel(
    x_ptr,
    s_xt,
    slab_ptr,
    s_slot,
    tiles_ptr,  # [tiles, 3] int32: expert, first sorted row, end (expert_groups)
    order_ptr,  # [pairs] int32: the routed pair (t * K + j) of each sorted row
    table_ptr,  # slot table [E] (HAS_TABLE)
    h_ptr,  # [pairs, F] fp32, by sorted row
    bias_ptr,  # [E, 2F + H] fp32 per expert id: gate, up, down biases (HAS_BIAS)
    w_ptr,  # [T, K] gate weights, scaling the input (SCALE_INPUT)
    H,
    F,
    C,
    alpha,
    limit,
    gate_off,
    up_off,
    gate_s_off,
    up_s_off,
    RB_G,
    RB_U,
    G,
    NG,
    tab_ptr,
    K,  # routed experts per token: pair p is token p // K
    HAS_TABLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    KIND: tl.constexpr,
    CODE_G: tl.constexpr,
    CODE_U: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    e, slot, rows, rm, p, idle = _tile(tiles_ptr, order_ptr, table_ptr, C, HAS_TABLE, BLOCK_M)
    if idle:  # its pairs' rows stay zero
        return
    t = (p // K).to(tl.int64)
    fs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fm = fs < F
    base = slab_ptr + slot * s_slot
    acc_g = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hm = hs < H
        xm = rm[:, None] & hm[None, :]
        xt = tl.load(x_ptr + t[:, None] * s_xt + hs[None, :], mask=xm, other=0.0).to(tl.float32)
        wg = _weight_tile(base, gate_off, gate_s_off, fs, fm, hs, hm, H, RB_G, G, NG, tab_ptr,
                          KIND, CODE_G)  # fmt: skip
        wu = _weight_tile(base, up_off, up_s_off, fs, fm, hs, hm, H, RB_U, G, NG, tab_ptr,
                          KIND, CODE_U)  # fmt: skip
        acc_g = tl.dot(xt, tl.trans(wg), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(xt, tl.trans(wu), acc_u, input_precision=PRECISION)
    if SCALE_INPUT:  # gate (w x) = w (gate x): the weight scales the sums
        wk = tl.load(w_ptr + p, mask=rm, other=0.0).to(tl.float32)[:, None]
        acc_g, acc_u = acc_g * wk, acc_u * wk
    h = glu(acc_g, acc_u, bias_ptr + e * (2 * F + H), fs, fm, F, alpha, limit, HAS_BIAS, ACT)
    hp = h_ptr + rows[:, None].to(tl.int64) * F + fs[None, :]
    tl.store(hp, h, mask=rm[:, None] & fm[None, :])


@triton.jit
def _grouped_down_kernel(
    h_ptr,
    slab_ptr,
    s_slot,
    tiles_ptr,
    order_ptr,
    table_ptr,
    w_ptr,
    y_ptr,  # [pairs, H] fp32, by routed pair (t * K + j)
    bias_ptr,
    H,
    F,
    C,
    down_off,
    down_s_off,
    RB_D,
    G,
    NG,
    tab_ptr,
    HAS_TABLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    KIND: tl.constexpr,
    CODE_D: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    e, slot, rows, rm, p, idle = _tile(tiles_ptr, order_ptr, table_ptr, C, HAS_TABLE, BLOCK_M)
    if idle:  # its pairs' rows stay zero
        return
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hs < H
    base = slab_ptr + slot * s_slot
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        fs = f0 + tl.arange(0, BLOCK_F)
        fm = fs < F
        hp = h_ptr + rows[:, None].to(tl.int64) * F + fs[None, :]
        hv = tl.load(hp, mask=rm[:, None] & fm[None, :], other=0.0)
        wd = _weight_tile(base, down_off, down_s_off, hs, hm, fs, fm, F, RB_D, G, NG, tab_ptr,
                          KIND, CODE_D)  # fmt: skip
        acc = tl.dot(hv, tl.trans(wd), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * (2 * F + H) + 2 * F + hs, mask=hm, other=0.0)[None, :]
    if not SCALE_INPUT:
        acc *= tl.load(w_ptr + p, mask=rm, other=0.0).to(tl.float32)[:, None]
    yp = y_ptr + p[:, None].to(tl.int64) * H + hs[None, :]
    tl.store(yp, acc, mask=rm[:, None] & hm[None, :])


# --------------------------------------------------------------------------- ops


def expert_groups(
    ids: torch.Tensor, num_experts: int, present: torch.Tensor | None = None, block_m: int = GROUP_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouping of routed pairs `ids [T, k]` (expert ids in [0, num_experts)) by expert,
    on their device without a host sync: `order` int32 `[T k]`, the pairs (t * k + j)
    sorted by expert, each expert's in ascending pair order, and `tiles` int32 `[n, 3]`,
    each (expert, first row of `order`, end of the expert's run): a tile is its rows
    first .. min(first + block_m, end), every expert's run cut from its start. n is the
    bound T k // block_m + min(E, T k); the tiles past the used ones are empty (first =
    end = 0, expert E - 1). `present` (bool `[T, k]`): only those pairs (the others are
    sorted last, in no tile)."""
    E, dev = num_experts, ids.device
    key = ids.reshape(-1).long()
    if present is not None:
        key = torch.where(present.reshape(-1), key, E)
    order = torch.sort(key, stable=True).indices
    # scatter_add_, not bincount: bincount sizes its output from the max (a host sync)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:E]
    starts = torch.cumsum(counts, 0) - counts
    per = (counts + block_m - 1) // block_m
    cum = torch.cumsum(per, 0)
    n = key.numel() // block_m + min(E, key.numel()) if E else 0
    i = torch.arange(n, device=dev)
    expert = torch.searchsorted(cum, i, right=True).clamp(max=max(E - 1, 0))
    used = i < cum[-1] if E else i < 0
    begin = torch.where(used, starts[expert] + (i - cum[expert] + per[expert]) * block_m, 0)
    end = torch.where(used, starts[expert] + counts[expert], 0)
    tiles = torch.stack([expert, begin, end], 1)
    return order.to(torch.int32), tiles.to(torch.int32).contiguous()


@functools.lru_cache(maxsize=1024)
def _one_expert_groups(
    pairs: int, device: torch.device, block_m: int = GROUP_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_groups` of `pairs` pairs all routed to expert 0 (prefill's per-expert calls:
    one slab row), without the spare tiles; cached per count and device (read-only: the
    kernels only read them), so those calls launch nothing but the two kernels."""
    begin = torch.arange(0, pairs, block_m, dtype=torch.int32)
    tiles = torch.stack([torch.zeros_like(begin), begin, torch.full_like(begin, pairs)], 1)
    order = torch.arange(pairs, dtype=torch.int32)
    return order.to(device), tiles.to(device)


@functools.lru_cache(maxsize=256)
def grouped_launch_config(lay: RowLayout) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """Constexprs and warps of the gate/up and down kernels for `lay` (no autotuning; a
    function of the layout alone, never of the token count; cached: read-only mappings)."""
    H, F = lay.hidden_size, lay.ffn_size
    kind = _KIND[lay.fmt.kind]
    if lay.fmt.is_blocks:
        codes = lay.triton_type_ids  # type: ignore[union-attr]
    elif lay.fmt.is_quant:
        codes = (lay.fmt.code,) * 3
    else:
        codes = (0, 0, 0)
    bf, bh = min(pow2(F, 16), 64), min(pow2(H, 16), 64)
    gate_up = dict(KIND=kind, CODE_G=codes[0], CODE_U=codes[1], BLOCK_M=GROUP_M, BLOCK_F=bf,
                   BLOCK_H=bh, num_warps=4)  # fmt: skip
    down = dict(KIND=kind, CODE_D=codes[2], BLOCK_M=GROUP_M, BLOCK_H=bh, BLOCK_F=bf, num_warps=4)
    return MappingProxyType(gate_up), MappingProxyType(down)


def _part_args(lay: RowLayout, device: torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
    """Where the kernels read a row's parts (`_weight_tile`'s offsets, bytes a row and
    scale groups; unused ones 1)."""
    tab = iq_table(device) if lay.fmt.is_blocks else torch.zeros(1, dtype=torch.int8, device=device)
    a1: dict[str, Any] = dict(gate_off=lay.gate, up_off=lay.up, gate_s_off=0, up_s_off=0, RB_G=1,
                              RB_U=1, G=1, NG=1, tab_ptr=tab)  # fmt: skip
    a2: dict[str, Any] = dict(down_off=lay.down, down_s_off=0, RB_D=1, G=1, NG=1, tab_ptr=tab)
    if lay.fmt.is_quant:
        q: Any = lay
        a1.update(gate_s_off=q.gate_scale, up_s_off=q.up_scale, RB_G=q.row_bytes_h,
                  RB_U=q.row_bytes_h, G=q.group_h, NG=q.groups_h)  # fmt: skip
        a2.update(down_s_off=q.down_scale, RB_D=q.row_bytes_f, G=q.group_f, NG=q.groups_f)
    elif lay.fmt.is_blocks:
        b: Any = lay
        a1.update(RB_G=b.rb_gate, RB_U=b.rb_up)
        a2.update(RB_D=b.rb_down)
    return a1, a2


def _check(
    op: str,
    x: torch.Tensor,
    slab: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    fmt: RowFormat,
    group_size: int,
    slot_table: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[RowLayout, int]:
    """The argument checks of the kernel and its reference: (row layout, expert count)."""
    lay = _check_ffn(op, x, slab, ids, weights, hidden_size, ffn_size, fmt, group_size)
    _check_table(op, slot_table, ids)
    E = slab.shape[0] if slot_table is None else slot_table.shape[0]
    _check_expert_bias(op, bias, E, hidden_size, ffn_size)
    return lay, E


def _check_expert_bias(
    op: str, bias: torch.Tensor | None, num_experts: int, hidden_size: int, ffn_size: int
) -> None:
    if bias is None:
        return
    want = [num_experts, 2 * ffn_size + hidden_size]
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32:
        raise TypeError(f"{op}: bias must be a float32 tensor {want}")
    if list(bias.shape) != want or not bias.is_contiguous():
        raise ValueError(
            f"{op}: bias must be a contiguous [E, 2F + H] = {want} tensor (gate, up, down "
            f"biases of each expert id), got {list(bias.shape)}"
        )


def _present(
    ids: torch.Tensor, slot_table: torch.Tensor | None, skip_absent: bool
) -> torch.Tensor | None:
    """The pairs computed here: with skip_absent, those whose expert has a slot."""
    if slot_table is None or not skip_absent:
        return None
    return slot_table[ids.long()] != -1


def grouped_expert_ffn(
    x: torch.Tensor,
    slab: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    fmt: FormatLike = None,
    group_size: int = 128,
    out_dtype: torch.dtype | None = None,
    check_slots: bool = True,
    slot_table: torch.Tensor | None = None,
    act: Activation = SILU,
    bias: torch.Tensor | None = None,
    scale_input: bool = False,
    skip_absent: bool = False,
) -> torch.Tensor:
    """Routed experts of many tokens `x [T, H]` from slab rows, grouped by expert (module
    docstring): for prefill, where each expert serves many tokens.

    Args as `expert_ffn`'s, except: `ids [T, k]` are slots, or with `slot_table [E]`
    expert ids; `bias` is `[E, 2F + H]` fp32 per expert id (per slot without a table):
    gate, up, down biases. Returns `[T, H]` (out_dtype, default x's), contiguous.
    """
    op = "grouped_expert_ffn"
    rf = RowFormat.of_kernel(op, fmt)
    lay, E = _check(op, x, slab, ids, weights, hidden_size, ffn_size, rf, group_size,
                    slot_table, bias)  # fmt: skip
    check_launchable(op, x, slab, ids, weights, slot_table, bias)
    if not rf.is_float:
        check_aligned(op, slab)
    if check_slots:
        _check_slot_range(op, ids, slab.shape[0], slot_table, skip_absent)
    T, H = x.shape
    K = ids.shape[1]
    out = out_dtype or x.dtype
    if T == 0 or K == 0:
        return torch.zeros(T, H, dtype=out, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = weights.contiguous()
    if E == 1 and slot_table is None:  # one expert (prefill's calls): every pair in order
        order, tiles = _one_expert_groups(T * K, x.device)
    else:
        order, tiles = expert_groups(ids, E, _present(ids, slot_table, skip_absent))
    h = torch.empty(T * K, ffn_size, dtype=torch.float32, device=x.device)
    y = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)  # absent pairs: 0
    if tiles.shape[0]:  # (empty tiles store nothing)
        _launch(lay, x, slab, order, tiles, weights, y, h, slot_table, act, bias, scale_input)
    pairs = y.view(T, K, H)
    acc = pairs[:, 0]
    for j in range(1, K):  # each token's pairs in order j = 0..k-1
        acc = acc + pairs[:, j]
    return acc.to(out).contiguous()


def _launch(
    lay: RowLayout,
    x: torch.Tensor,
    slab: torch.Tensor,
    order: torch.Tensor,
    tiles: torch.Tensor,
    weights: torch.Tensor,
    y: torch.Tensor,
    h: torch.Tensor,
    table: torch.Tensor | None,
    act: Activation,
    bias: torch.Tensor | None,
    scale_input: bool,
) -> None:
    """The gate/up then the down kernel over the tile table, on checked arguments."""
    H, F = lay.hidden_size, lay.ffn_size
    c1, c2 = grouped_launch_config(lay)
    a1, a2 = _part_args(lay, slab.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common: dict[str, Any] = dict(
        slab_ptr=slab,
        s_slot=slab.stride(0),
        tiles_ptr=tiles,
        order_ptr=order,
        table_ptr=tiles if table is None else table,
        bias_ptr=h if bias is None else bias,
        w_ptr=weights,
        H=H,
        F=F,
        C=slab.shape[0],
        HAS_TABLE=table is not None,
        HAS_BIAS=bias is not None,
        SCALE_INPUT=scale_input,
        PRECISION=precision,
    )
    n = tiles.shape[0]
    _grouped_gate_up_kernel[(n, triton.cdiv(F, c1["BLOCK_F"]))](
        x_ptr=x,
        s_xt=x.stride(0),
        h_ptr=h,
        alpha=float(act.alpha),
        limit=float(act.limit) if math.isfinite(act.limit) else 0.0,
        K=weights.shape[1],
        ACT=act.code,
        **common,
        **a1,
        **c1,
    )
    _grouped_down_kernel[(n, triton.cdiv(H, c2["BLOCK_H"]))](h_ptr=h, y_ptr=y, **common, **a2, **c2)


def grouped_expert_ffn_ref(
    x: torch.Tensor,
    slab: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    fmt: FormatLike = None,
    group_size: int = 128,
    out_dtype: torch.dtype | None = None,
    check_slots: bool = True,
    slot_table: torch.Tensor | None = None,
    act: Activation = SILU,
    bias: torch.Tensor | None = None,
    scale_input: bool = False,
    skip_absent: bool = False,
) -> torch.Tensor:
    """Plain-torch reference of `grouped_expert_ffn` (same arguments): each expert once
    over its tokens from its row (`expert_row_ffn_ref`), in fp32, weighted and summed."""
    op = "grouped_expert_ffn_ref"
    rf = RowFormat.of_kernel(op, fmt)
    _check(op, x, slab, ids, weights, hidden_size, ffn_size, rf, group_size, slot_table, bias)
    if check_slots:
        _check_slot_range(op, ids, slab.shape[0], slot_table, skip_absent)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf, w = x.float(), weights.float()
    for e in torch.unique(ids).tolist():
        slot = e if slot_table is None else int(slot_table[e])
        if slot == -1 and skip_absent:
            continue
        tok, pos = torch.where(ids == e)
        we = w[tok, pos][:, None]
        xe = xf[tok] * we if scale_input else xf[tok]
        b = None if bias is None else bias[e]
        ye = expert_row_ffn_ref(xe, slab[slot], hidden_size, ffn_size, fmt=rf,
                                group_size=group_size, act=act, bias=b)  # fmt: skip
        out.index_put_((tok,), ye if scale_input else ye * we, accumulate=True)
    return out.to(out_dtype or x.dtype)
