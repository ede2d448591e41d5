"""Batch-1 MoE expert FFN that reads expert weights straight from slab slots.

    y[t] = sum_j w[t, j] * down_j( silu(gate_j x[t]) * up_j x[t] ),  expert j in slot slots[t, j]

Each slab row holds one expert packed as `[gate (F x H), up (F x H), down (H x F)]`,
row-major (the layout psr's store registers; HF's fused `gate_up_proj[e]` is gate then
up). `pack_expert` writes a row, `unpack_expert` views one (or a batch `[..., 3HF]`)
as its three matrices, and `FloatLayout` (psr_kernels.rowformat) gives the offsets the
kernels read at: the only places that know the layout.
Two kernels, both accumulating in fp32 with a fixed reduction order (no atomics), so
results are bit-reproducible run to run:
  1. `_gate_up_kernel`, grid (T*k, F/BLOCK_F): h[t, j] = silu(gate_j x) * (up_j x);
  2. `_down_kernel`, grid (T, H/BLOCK_H): y[t] = sum_j w[t, j] * (down_j h[t, j]).
At batch 1 this is a grouped GEMV: each weight byte is read once.

`expert_ffn` is the one entry and `_launch_ffn` the one launcher: the rows' `RowFormat`
(`fmt`; None: float rows) picks these kernels, those of `psr_kernels.quant` (int8, fp8,
int4) or of `psr_kernels.ggml` (GGUF's blocks), with their constexprs and part offsets.
`expert_ffn_ref` (same arguments) and `expert_row_ffn_ref` (one expert, one row) are its
plain-torch references, both computing through `swiglu_ref`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from psr_kernels._common import (
    SPLIT_K_DEFAULT,
    check_float,
    check_launchable,
    load_slot,
    pow2,
    store_down,
    sum_experts,
)
from psr_kernels.activation import SILU, Activation, glu
from psr_kernels.ggml import (
    _ggml_down_kernel,
    _ggml_gate_up_kernel,
    dequantize_ggml_expert,
    ggml_launch_config,
    ggml_part_args,
)
from psr_kernels.quant import (
    _quant_down_kernel,
    _quant_gate_up_kernel,
    check_aligned,
    check_quant_slab,
    dequantize_expert,
    quant_launch_config,
    quant_part_args,
)
from psr_kernels.rowformat import (
    NATIVE,
    FloatLayout,
    FormatLike,
    GGMLLayout,
    RowFormat,
    RowKind,
    RowLayout,
)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    s_xt,
    slab_ptr,
    s_slot,
    slots_ptr,
    table_ptr,  # slot table [E] (HAS_TABLE): slots_ptr then holds expert ids
    h_ptr,
    bias_ptr,  # [T*K, 2F + H] fp32 per routed expert: gate, up, down biases (HAS_BIAS)
    w_ptr,  # [T, K] gate weights, scaling the expert's input (SCALE_INPUT: Llama 4)
    T,
    H,
    F,
    C,
    up_offset,  # element offsets of `up` and `down` in a slab row (`_layout`)
    alpha,  # the clamped SwiGLU's (ACT == 1)
    limit,
    K: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tk = tl.program_id(0)
    t = tk // K
    fs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fm = fs < F
    slot = load_slot(slots_ptr, tk, table_ptr, HAS_TABLE)
    ok = (slot >= 0) & (slot < C)  # out-of-range slots read nothing (the wrapper checks)
    base = slab_ptr + slot * s_slot
    acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hm = hs < H
        x = tl.load(x_ptr + t * s_xt + hs, mask=hm, other=0.0).to(tl.float32)
        wm = ok & fm[:, None] & hm[None, :]
        offs = fs[:, None].to(tl.int64) * H + hs[None, :]
        g = tl.load(base + offs, mask=wm, other=0.0).to(tl.float32)
        u = tl.load(base + up_offset + offs, mask=wm, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * x[None, :], axis=1)
        acc_u += tl.sum(u * x[None, :], axis=1)
    if SCALE_INPUT:  # gate (w x) = w (gate x): the weight scales the sums, not the output
        wk = tl.load(w_ptr + tk).to(tl.float32)
        acc_g, acc_u = acc_g * wk, acc_u * wk
    h = glu(acc_g, acc_u, bias_ptr + tk * (2 * F + H), fs, fm, F, alpha, limit, HAS_BIAS, ACT)
    tl.store(h_ptr + tk * F + fs, h, mask=fm)


@triton.jit
def _down_kernel(
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
    down_offset,
    K: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    SPLIT_K: tl.constexpr,  # one expert a program (grid z = K), partials summed after
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
        wj = 1.0 if SCALE_INPUT else tl.load(w_ptr + t * K + j).to(tl.float32)
        base = slab_ptr + slot * s_slot + down_offset
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            fs = f0 + tl.arange(0, BLOCK_F)
            fm = fs < F
            hv = tl.load(h_ptr + (t * K + j) * F + fs, mask=fm, other=0.0)
            d = tl.load(
                base + hs[:, None].to(tl.int64) * F + fs[None, :],
                mask=ok & hm[:, None] & fm[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(d * hv[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + (t * K + j) * (2 * F + H) + 2 * F + hs, mask=hm, other=0.0)
        y += tl.where(ok, wj * acc, 0.0)  # an absent expert (slot -1) adds nothing
    store_down(y, y_ptr, s_yt, part_ptr, t, j0, H, hs, hm, K, SPLIT_K)


# --------------------------------------------------------------------------- slab layout


def dequantize_rows(
    fmt: RowFormat, rows: torch.Tensor, hidden_size: int, ffn_size: int, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(gate [..., F, H], up [..., F, H], down [..., H, F])` of rows `[..., row]` of
    format `fmt`: views of float rows, or the reference dequantizer's fp32 matrices (here,
    not on RowFormat, so the table imports no kernel module)."""
    if fmt.is_float:
        return unpack_expert(rows, hidden_size, ffn_size)
    if fmt.is_blocks:
        lay = GGMLLayout.of(fmt, hidden_size, ffn_size)
        return dequantize_ggml_expert(rows, lay)
    return dequantize_expert(rows, hidden_size, ffn_size, fmt, group_size=group_size)


def unpack_expert(
    row: torch.Tensor, hidden_size: int, ffn_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of one packed expert's `(gate [F, H], up [F, H], down [H, F])`.

    `row` is a slab row `[3*H*F]`, or any batch of them `[..., 3*H*F]` (e.g. `slab`
    itself, or `slab[slots]`); the views then have the batch dims in front:
    `[..., F, H]`, `[..., F, H]`, `[..., H, F]`. No copies. The inverse of `pack_expert`.
    """
    H, F = hidden_size, ffn_size
    if not isinstance(row, torch.Tensor) or row.dim() < 1:
        raise ValueError("unpack_expert: row must be a tensor with at least 1 dim")
    lay = FloatLayout(NATIVE, H, F)
    if H < 1 or F < 1 or row.shape[-1] != lay.row:
        raise ValueError(
            f"unpack_expert: rows hold {row.shape[-1]} elements, expected "
            f"3 * H * F = {lay.row} (H={H}, F={F})"
        )
    batch = row.shape[:-1]
    gate = row[..., lay.gate : lay.up].view(*batch, F, H)
    up = row[..., lay.up : lay.down].view(*batch, F, H)
    down = row[..., lay.down :].view(*batch, H, F)
    return gate, up, down


def pack_expert(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One slab row `[3*H*F]` from an expert's `gate [F, H]`, `up [F, H]`, `down [H, F]`."""
    F, H = gate.shape
    if up.shape != (F, H) or down.shape != (H, F):
        raise ValueError(
            f"pack_expert: expected gate/up [F, H] and down [H, F], got "
            f"{list(gate.shape)}, {list(up.shape)}, {list(down.shape)}"
        )
    return torch.cat([gate.reshape(-1), up.reshape(-1), down.reshape(-1)])


# --------------------------------------------------------------------------- ops


@functools.lru_cache(maxsize=1024)
def ffn_launch_config(T: int, H: int, F: int) -> tuple[Mapping[str, int], Mapping[str, int]]:
    """Block sizes of the gate/up and down kernels (no autotuning; cached per shape:
    read-only mappings; the same for every T)."""
    gate_up = dict(BLOCK_F=min(pow2(F, 16), 64), BLOCK_H=min(pow2(H, 16), 128), num_warps=4)
    # Enough output tiles to fill the GPU at T = 1; not a function of T (it was of H * T), so
    # no tile shape, nor a reduction layout a compiler derives from it, varies with the
    # batch: a token's bits are its T = 1 bits on every backend.
    down = dict(
        BLOCK_H=max(16, min(64, pow2(triton.cdiv(H, 128)))),
        BLOCK_F=min(pow2(F, 16), 128),
        SPLIT_K=SPLIT_K_DEFAULT,
        num_warps=4,
    )
    return MappingProxyType(gate_up), MappingProxyType(down)


def _check_uint8_slab(
    op: str, slab: torch.Tensor, fmt: RowFormat, hidden_size: int, ffn_size: int, group_size: int
) -> RowLayout:
    """The layout of `fmt`'s rows after checking `slab` is `[C, nbytes]` uint8 of them."""
    if fmt.is_quant:
        return check_quant_slab(op, slab, fmt, hidden_size, ffn_size, group_size)
    if not isinstance(slab, torch.Tensor) or slab.dtype != torch.uint8 or slab.dim() != 2:
        raise TypeError(f"{op}: slab must be a 2-D uint8 tensor [C, nbytes] for {fmt}")
    lay = GGMLLayout.of(fmt, hidden_size, ffn_size)
    if slab.shape[1] != lay.nbytes:
        raise ValueError(
            f"{op}: slab rows hold {slab.shape[1]} bytes, expected {lay.nbytes} "
            f"({fmt}, H={hidden_size}, F={ffn_size})"
        )
    return lay


def _check_ffn(
    op: str,
    x: torch.Tensor,
    slab: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    fmt: RowFormat,
    group_size: int,
) -> RowLayout:
    """Shared argument checks of `expert_ffn` and its reference; returns the row layout."""
    check_float(op, "x", x, 2)
    if fmt.is_float:
        check_float(op, "slab", slab, 2)
    check_float(op, "weights", weights, 2)
    T, H = x.shape
    if H != hidden_size:
        raise ValueError(f"{op}: x has hidden size {H}, expected {hidden_size}")
    if ffn_size < 1:
        raise ValueError(f"{op}: ffn_size must be positive, got {ffn_size}")
    lay: RowLayout
    if fmt.is_float:
        lay = FloatLayout(fmt, hidden_size, ffn_size)
        if slab.shape[1] != lay.row:
            raise ValueError(
                f"{op}: slab rows hold {slab.shape[1]} elements, expected 3 * H * F = {lay.row}"
            )
    else:
        lay = _check_uint8_slab(op, slab, fmt, hidden_size, ffn_size, group_size)
    if slab.stride(1) != 1:
        raise ValueError(f"{op}: slab rows must be contiguous (stride(1) == 1)")
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: slots must be an int32/int64 tensor")
    if slots.dim() != 2 or slots.shape[0] != T:
        raise ValueError(f"{op}: slots must be [T={T}, k], got {list(slots.shape)}")
    if weights.shape != slots.shape:
        raise ValueError(
            f"{op}: weights {list(weights.shape)} and slots {list(slots.shape)} differ"
        )
    return lay


def _check_table(op: str, table: torch.Tensor | None, slots: torch.Tensor) -> None:
    if table is None:
        return
    if not isinstance(table, torch.Tensor) or table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: slot_table must be an int32/int64 tensor")
    if table.dim() != 1 or table.stride(0) != 1 or table.device != slots.device:
        raise ValueError(
            f"{op}: slot_table must be a contiguous 1-D tensor on {slots.device}, got "
            f"shape {list(table.shape)} on {table.device}"
        )


def _check_slot_range(
    op: str, slots: torch.Tensor, C: int, table: torch.Tensor | None = None, absent: bool = False
) -> None:
    if table is not None:
        E = table.shape[0]
        if slots.numel() and not bool(((slots >= 0) & (slots < E)).all()):
            raise IndexError(f"{op}: expert ids must be in [0, {E}), got {slots.tolist()}")
        slots = table[slots.long()]
        if absent:  # skip_absent: slot -1 is an expert computed elsewhere
            slots = slots[slots != -1]
    if slots.numel() and not bool(((slots >= 0) & (slots < C)).all()):
        raise IndexError(f"{op}: slot ids must be in [0, {C}), got {slots.tolist()}")


def _float_part_args(lay: FloatLayout) -> tuple[dict[str, int], dict[str, int]]:
    return dict(up_offset=lay.up), dict(down_offset=lay.down)


class _Kernels(NamedTuple):
    """One kind of rows' kernel pair, launch config and part arguments."""

    gate_up: Any
    down: Any
    config: Callable[[Any, int], tuple[Mapping[str, int], Mapping[str, int]]]
    part_args: Callable[[Any, torch.device], tuple[dict[str, Any], dict[str, Any]]]


_KERNELS: Mapping[RowKind, _Kernels] = MappingProxyType(
    {
        RowKind.FLOAT: _Kernels(
            _gate_up_kernel,
            _down_kernel,
            lambda lay, T: ffn_launch_config(T, lay.hidden_size, lay.ffn_size),
            lambda lay, device: _float_part_args(lay),
        ),
        RowKind.QUANT: _Kernels(
            _quant_gate_up_kernel,
            _quant_down_kernel,
            lambda lay, T: quant_launch_config(lay),
            lambda lay, device: quant_part_args(lay),
        ),
        RowKind.BLOCKS: _Kernels(
            _ggml_gate_up_kernel,
            _ggml_down_kernel,
            lambda lay, T: ggml_launch_config(lay),
            ggml_part_args,
        ),
    }
)


# Launch constexprs that override a row kind's defaults (BLOCK_* and num_warps of either
# kernel, SPLIT_K of the down kernel): set by `set_ffn_tuning`, e.g. from a GPU sweep
# (bench/ggml_gemv.py --sweep). Empty: every kind launches its config function's values.
_TUNING: dict[RowKind, tuple[dict[str, int], dict[str, int]]] = {}


def set_ffn_tuning(
    kind: RowKind, gate_up: Mapping[str, int] | None = None, down: Mapping[str, int] | None = None
) -> tuple[dict[str, int], dict[str, int]] | None:
    """Override `kind`'s launch constexprs (None for both: back to the defaults); returns
    the previous override. Only tile sizes, warps and SPLIT_K: the kernels' math stays, and
    SPLIT_K keeps every bit (tests/kernels/test_expert_ffn_split.py)."""
    tiles = {"BLOCK_F", "BLOCK_H", "num_warps"}
    for name, c, ok in (("gate_up", gate_up, tiles), ("down", down, tiles | {"SPLIT_K"})):
        bad = sorted(set(c or {}) - ok)
        if bad:
            raise ValueError(f"set_ffn_tuning: {name} takes {sorted(ok)}, not {bad}")
    prev = _TUNING.pop(kind, None)
    if gate_up or down:
        _TUNING[kind] = (dict(gate_up or {}), dict(down or {}))
    return prev


def _launch_ffn(
    lay: RowLayout,
    x: torch.Tensor,
    slab: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    y: torch.Tensor,
    h: torch.Tensor,
    table: torch.Tensor | None = None,
    act: Activation = SILU,
    bias: torch.Tensor | None = None,
    scale_input: bool = False,
) -> None:
    """Run the gate/up then the down kernel of `lay`'s rows on checked arguments and
    buffers: h = act(gate x, up x), then y = sum_j w_j * (down_j h_j + bias_j). The one
    launcher of every format: the format picks the kernels, their constexprs and where
    they read a row's parts."""
    T, H = x.shape
    K = slots.shape[1]
    F = lay.ffn_size
    kern = _KERNELS[lay.fmt.kind]
    c1, c2 = kern.config(lay, T)
    tuned = _TUNING.get(lay.fmt.kind)
    if tuned is not None:  # bench/ggml_gemv.py --sweep's, or a measured table's
        c1, c2 = {**c1, **tuned[0]}, {**c2, **tuned[1]}
    a1, a2 = kern.part_args(lay, slab.device)
    split = bool(c2["SPLIT_K"])
    part = torch.empty((T, K, H), dtype=torch.float32, device=x.device) if split else y
    common = dict(
        slab_ptr=slab,
        s_slot=slab.stride(0),
        slots_ptr=slots,
        table_ptr=slots if table is None else table,
        bias_ptr=h if bias is None else bias,
        w_ptr=weights,
        T=T,
        H=H,
        F=F,
        C=slab.shape[0],
        K=K,
        HAS_TABLE=table is not None,
        HAS_BIAS=bias is not None,
        SCALE_INPUT=scale_input,
    )
    kern.gate_up[(T * K, triton.cdiv(F, c1["BLOCK_F"]))](
        x_ptr=x,
        s_xt=x.stride(0),
        h_ptr=h,
        alpha=float(act.alpha),
        limit=float(act.limit) if math.isfinite(act.limit) else 0.0,
        ACT=act.code,
        **common,
        **a1,
        **c1,
    )
    kern.down[(T, triton.cdiv(H, c2["BLOCK_H"]), K if split else 1)](
        h_ptr=h, y_ptr=y, s_yt=y.stride(0), part_ptr=part, **common, **a2, **c2
    )
    if split:
        sum_experts(part, y)


def expert_ffn(
    x: torch.Tensor,
    slab: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    fmt: FormatLike = None,
    group_size: int = 128,
    out_dtype: torch.dtype | None = None,
    check_slots: bool = True,
    slot_table: torch.Tensor | None = None,
    checked: bool = False,
    act: Activation = SILU,
    bias: torch.Tensor | None = None,
    scale_input: bool = False,
    skip_absent: bool = False,
) -> torch.Tensor:
    """Routed gated-MLP experts of `x [T, H]` read from slab slots.

    Args:
        slab: `[C, 3*H*F]` float rows (`pack_expert`; fmt None), or `[C, nbytes]` uint8
            rows of a quantized `fmt` (`quantize_expert`; base and row stride 16-byte
            aligned).
        slots: `[T, k]` int slot of each routed expert; weights: `[T, k]` gate weights.
        fmt: the rows' `RowFormat`, or its word: None (float rows), one of QUANT_FORMATS
            ('int8', 'fp8', 'int4') or a GGML row format (`psr_kernels.ggml.ggml_format`,
            "gguf:Q4_K,Q4_K,Q6_K": a GGUF file's blocks as they are): picks the kernels.
        group_size: the int4 scale group (unused otherwise).
        out_dtype: output dtype (default x.dtype); accumulation is always fp32.
        check_slots: validate slot ids on the host (a sync); out-of-range slots are
            otherwise read as zeros rather than faulting.
        slot_table: `[E]` int slot of each expert (the device slot map): `slots` then
            holds the routed expert ids and the kernels look their slots up, so the ids
            go from the router to the experts without leaving the device.
        checked: the caller checked arguments of these shapes, dtypes, devices and
            alignment on an earlier call (the runtime's first per layer) and passes the
            same again: skip the checks (~12 µs of host time per call).
        act: the expert kind's gated activation (`Activation`; default SwiGLU).
        bias: `[T, k, 2F + H]` fp32 biases of each routed expert (gate F, up F, down H),
            for expert kinds with biases (gpt-oss); the runtime keeps every expert's
            biases on the device and gathers them by the routed ids.
        scale_input: the gate weight scales each expert's input instead of its output,
            y = sum_j expert_j(w_j x) (Llama 4).
        skip_absent: with a slot_table, an expert whose slot is -1 is absent (computed
            elsewhere: the CPU part of experts_on cpu / hybrid) and adds exactly nothing,
            weight and bias included; without it, -1 is out of range.
    Returns `[T, H]`, contiguous.
    """
    op = "expert_ffn"
    rf = RowFormat.of_kernel(op, fmt)
    if checked:
        lay = rf.layout(hidden_size, ffn_size, group_size)
    else:
        lay = _check_ffn(op, x, slab, slots, weights, hidden_size, ffn_size, rf, group_size)
        _check_table(op, slot_table, slots)
        _check_bias(op, bias, slots, hidden_size, ffn_size)
        check_launchable(op, x, slab, slots, weights, slot_table, bias)
        if not rf.is_float:
            check_aligned(op, slab)
    T, H = x.shape
    K = slots.shape[1]
    if check_slots:
        _check_slot_range(op, slots, slab.shape[0], slot_table, skip_absent)
    y = torch.empty(T, H, dtype=out_dtype or x.dtype, device=x.device)
    if T == 0 or K == 0:
        return y.zero_()
    # Contiguous where the kernels index them; the fp32 gate/up intermediate h.
    x = x if x.stride(1) == 1 else x.contiguous()
    # Weights of any float dtype: the kernels load and widen them to fp32.
    slots, weights = slots.contiguous(), weights.contiguous()
    h = torch.empty(T * K, ffn_size, dtype=torch.float32, device=x.device)
    _launch_ffn(lay, x, slab, slots, weights, y, h, slot_table, act, bias, scale_input)
    return y


def _check_bias(
    op: str, bias: torch.Tensor | None, slots: torch.Tensor, hidden_size: int, ffn_size: int
) -> None:
    if bias is None:
        return
    want = [*slots.shape, 2 * ffn_size + hidden_size]
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32:
        raise TypeError(f"{op}: bias must be a float32 tensor {want}")
    if list(bias.shape) != want or not bias.is_contiguous():
        raise ValueError(
            f"{op}: bias must be a contiguous [T, k, 2F + H] = {want} tensor (gate, up, down "
            f"biases of each routed expert), got {list(bias.shape)}"
        )


# --------------------------------------------------------------------------- references


def swiglu_ref(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    act: Activation = SILU,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated expert, act(x @ gate^T, x @ up^T) @ down^T (SwiGLU by default; `act`),
    computed in `dtype`: the one place the references write it (the kernels compute in
    fp32).

    `gate`, `up` `[..., F, H]` and `down` `[..., H, F]` are one expert or a batch of
    them; `x` `[..., N, H]` broadcasts against their batch dims; `bias` `[..., 2F + H]`
    (gate, up, down biases) likewise. Returns `[..., N, H]` in `dtype` (for 2-D operands
    and SwiGLU, bit-identical to HF's `F.linear` MLP).
    """
    x, gate, up, down = (t.to(dtype) for t in (x, gate, up, down))
    g, u = x @ gate.mT, x @ up.mT
    if bias is not None:
        F = gate.shape[-2]
        b = bias.to(dtype).unsqueeze(-2)  # [..., 1, 2F + H]: over the N rows
        g, u = g + b[..., :F], u + b[..., F : 2 * F]
    if act.kind == "clamped":
        g = g.clamp(max=act.limit)
        u = u.clamp(-act.limit, act.limit)
        h = g * torch.sigmoid(g * act.alpha) * (u + 1)
    else:
        h = torch.nn.functional.silu(g) * u
    y = h @ down.mT
    return y if bias is None else y + b[..., 2 * gate.shape[-2] :]


def expert_row_ffn_ref(
    x: torch.Tensor,
    row: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    fmt: FormatLike = None,
    group_size: int = 128,
    act: Activation = SILU,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert of `x [N, H]` from its slab (or host) row, in plain torch: the
    runtime's prefill and scoring path on the CPU (`bias`: the expert's `[2F + H]`).

    Float rows of x's dtype compute in that dtype (as the model's own MLP does); other
    float rows (e.g. bf16 rows for fp32 x) and quantized rows (`fmt`) in fp32, as the
    kernels do. Returns `[N, H]` in x's dtype.
    """
    rf = RowFormat.of_kernel("expert_row_ffn_ref", fmt)
    gate, up, down = dequantize_rows(rf, row, hidden_size, ffn_size, group_size)
    dtype = x.dtype if rf.is_float and row.dtype == x.dtype else torch.float32
    return swiglu_ref(x, gate, up, down, dtype, act, bias).to(x.dtype)


def expert_ffn_ref(
    x: torch.Tensor,
    slab: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    fmt: FormatLike = None,
    group_size: int = 128,
    out_dtype: torch.dtype | None = None,
    check_slots: bool = True,
    slot_table: torch.Tensor | None = None,
    checked: bool = False,
    act: Activation = SILU,
    bias: torch.Tensor | None = None,
    scale_input: bool = False,
    skip_absent: bool = False,
) -> torch.Tensor:
    """Plain-torch reference of `expert_ffn` (same arguments): the stored weights
    (dequantized for a quantized `fmt`) in fp32 math."""
    op = "expert_ffn_ref"
    rf = RowFormat.of_kernel(op, fmt)
    if not checked:
        _check_ffn(op, x, slab, slots, weights, hidden_size, ffn_size, rf, group_size)
        _check_table(op, slot_table, slots)
        _check_bias(op, bias, slots, hidden_size, ffn_size)
    if check_slots:
        _check_slot_range(op, slots, slab.shape[0], slot_table, skip_absent)
    present = None
    if slot_table is not None:
        slots = slot_table[slots.long()]
        if skip_absent:  # absent experts read row 0, their outputs dropped below
            present = slots != -1
            slots = torch.where(present, slots, 0)
    # gate/up [T, k, F, H], down [T, k, H, F]; x as [T, 1, 1, H]: one row per expert.
    gate, up, down = dequantize_rows(rf, slab[slots.long()], hidden_size, ffn_size, group_size)
    w = weights.float()[..., None, None]  # [T, k, 1, 1]
    xin = x[:, None, None, :] * w if scale_input else x[:, None, None, :]
    out = swiglu_ref(xin, gate, up, down, act=act, bias=bias).squeeze(-2)  # [T, k, H]
    if present is not None:
        out = torch.where(present[..., None], out, 0.0)
    y = out.sum(1) if scale_input else (out * w[..., 0]).sum(1)
    return y.to(out_dtype or x.dtype).contiguous()
