"""Batch-1 MoE expert FFN that reads expert weights straight from slab slots.

    y[t] = sum_j w[t, j] * down_j( silu(gate_j x[t]) * up_j x[t] ),  expert j in slot slots[t, j]

Each slab row holds one expert packed as `[gate (F x H), up (F x H), down (H x F)]`,
row-major (the layout psr's store registers; HF's fused `gate_up_proj[e]` is gate then
up). `pack_expert` writes a row, `unpack_expert` views one (or a batch `[..., 3HF]`)
as its three matrices, and `_layout` gives the offsets the kernels read at: the only
places that know the layout.
Two kernels, both accumulating in fp32 with a fixed reduction order (no atomics), so
results are bit-reproducible run to run:
  1. `_gate_up_kernel`, grid (T*k, F/BLOCK_F): h[t, j] = silu(gate_j x) * (up_j x);
  2. `_down_kernel`, grid (T, H/BLOCK_H): y[t] = sum_j w[t, j] * (down_j h[t, j]).
At batch 1 this is a grouped GEMV: each weight byte is read once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from psr_kernels._common import check_float, check_launchable, pow2


@triton.jit
def _gate_up_kernel(
    x_ptr,
    s_xt,
    slab_ptr,
    s_slot,
    slots_ptr,
    h_ptr,
    T,
    H,
    F,
    C,
    up_offset,  # element offsets of `up` and `down` in a slab row (`_layout`)
    K: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tk = tl.program_id(0)
    t = tk // K
    fs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fm = fs < F
    slot = tl.load(slots_ptr + tk).to(tl.int64)
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
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + tk * F + fs, h, mask=fm)


@triton.jit
def _down_kernel(
    h_ptr,
    slab_ptr,
    s_slot,
    slots_ptr,
    w_ptr,
    y_ptr,
    s_yt,
    T,
    H,
    F,
    C,
    down_offset,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    t = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hs < H
    y = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(K):
        slot = tl.load(slots_ptr + t * K + j).to(tl.int64)
        ok = (slot >= 0) & (slot < C)
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
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
        y += wj * acc
    tl.store(y_ptr + t * s_yt + hs, y.to(y_ptr.dtype.element_ty), mask=hm)


# --------------------------------------------------------------------------- slab layout


class _Layout(NamedTuple):
    gate: int  # element offset of gate [F, H] in a slab row
    up: int  # of up [F, H]
    down: int  # of down [H, F]
    row: int  # elements in a row: 3 * H * F


def _layout(hidden_size: int, ffn_size: int) -> _Layout:
    fh = hidden_size * ffn_size
    return _Layout(gate=0, up=fh, down=2 * fh, row=3 * fh)


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
    lay = _layout(H, F)
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


def ffn_launch_config(T: int, H: int, F: int) -> tuple[dict[str, int], dict[str, int]]:
    """Block sizes of the gate/up and down kernels (no autotuning)."""
    gate_up = dict(BLOCK_F=min(pow2(F, 16), 64), BLOCK_H=min(pow2(H, 16), 128), num_warps=4)
    # Enough output tiles to fill the GPU at T = 1.
    down = dict(
        BLOCK_H=max(16, min(64, pow2(triton.cdiv(H * T, 128)))),
        BLOCK_F=min(pow2(F, 16), 128),
        num_warps=4,
    )
    return gate_up, down


def _check_ffn(
    op: str,
    x: torch.Tensor,
    slab: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
) -> None:
    check_float(op, "x", x, 2)
    check_float(op, "slab", slab, 2)
    check_float(op, "weights", weights, 2)
    T, H = x.shape
    if H != hidden_size:
        raise ValueError(f"{op}: x has hidden size {H}, expected {hidden_size}")
    if ffn_size < 1:
        raise ValueError(f"{op}: ffn_size must be positive, got {ffn_size}")
    row = _layout(hidden_size, ffn_size).row
    if slab.shape[1] != row:
        raise ValueError(
            f"{op}: slab rows hold {slab.shape[1]} elements, expected 3 * H * F = {row}"
        )
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


def ffn_buffers(
    op: str,
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    num_slots: int,
    ffn_size: int,
    out_dtype: torch.dtype | None,
    check_slots: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What both expert FFN launches need: the inputs contiguous where the kernels index
    them, the output `y`, and the fp32 gate/up intermediate `h` (None when there is
    nothing to compute: then `y` is already the zero answer)."""
    T, H = x.shape
    K = slots.shape[1]
    if check_slots:
        _check_slot_range(op, slots, num_slots)
    y = torch.empty(T, H, dtype=out_dtype or x.dtype, device=x.device)
    if T == 0 or K == 0:
        return x, slots, weights, y.zero_(), None
    x = x if x.stride(1) == 1 else x.contiguous()
    h = torch.empty(T * K, ffn_size, dtype=torch.float32, device=x.device)
    return x, slots.contiguous(), weights.float().contiguous(), y, h


def _check_slot_range(op: str, slots: torch.Tensor, C: int) -> None:
    if slots.numel() and not bool(((slots >= 0) & (slots < C)).all()):
        raise IndexError(f"{op}: slot ids must be in [0, {C}), got {slots.tolist()}")


def expert_ffn(
    x: torch.Tensor,
    slab: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    out_dtype: torch.dtype | None = None,
    check_slots: bool = True,
) -> torch.Tensor:
    """Routed SwiGLU experts of `x [T, H]` read from `slab [C, 3*H*F]` slots.

    Args:
        slots: `[T, k]` int slot of each routed expert; weights: `[T, k]` gate weights.
        out_dtype: output dtype (default x.dtype); accumulation is always fp32.
        check_slots: validate slot ids on the host (a sync); out-of-range slots are
            otherwise read as zeros rather than faulting.
    Returns `[T, H]`, contiguous.
    """
    op = "expert_ffn"
    _check_ffn(op, x, slab, slots, weights, hidden_size, ffn_size)
    check_launchable(op, x, slab, slots, weights)
    T, H = x.shape
    K = slots.shape[1]
    C = slab.shape[0]
    F = ffn_size
    x, slots, weights, y, h = ffn_buffers(op, x, slots, weights, C, F, out_dtype, check_slots)
    if h is None:
        return y
    lay = _layout(H, F)
    c1, c2 = ffn_launch_config(T, H, F)
    _gate_up_kernel[(T * K, triton.cdiv(F, c1["BLOCK_F"]))](
        x_ptr=x,
        s_xt=x.stride(0),
        slab_ptr=slab,
        s_slot=slab.stride(0),
        slots_ptr=slots,
        h_ptr=h,
        T=T,
        H=H,
        F=F,
        C=C,
        up_offset=lay.up,
        K=K,
        **c1,
    )
    _down_kernel[(T, triton.cdiv(H, c2["BLOCK_H"]))](
        h_ptr=h,
        slab_ptr=slab,
        s_slot=slab.stride(0),
        slots_ptr=slots,
        w_ptr=weights,
        y_ptr=y,
        s_yt=y.stride(0),
        T=T,
        H=H,
        F=F,
        C=C,
        down_offset=lay.down,
        K=K,
        **c2,
    )
    return y


def expert_ffn_ref(
    x: torch.Tensor,
    slab: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    hidden_size: int,
    ffn_size: int,
    *,
    out_dtype: torch.dtype | None = None,
    check_slots: bool = True,
) -> torch.Tensor:
    """Plain-torch reference of `expert_ffn` (fp32 math on the stored weights)."""
    op = "expert_ffn_ref"
    _check_ffn(op, x, slab, slots, weights, hidden_size, ffn_size)
    if check_slots:
        _check_slot_range(op, slots, slab.shape[0])
    gate, up, down = unpack_expert(slab[slots.long()].float(), hidden_size, ffn_size)
    xf = x.float()[:, None, :, None]  # [T, 1, H, 1]; gate/up [T, k, F, H], down [T, k, H, F]
    g = (gate @ xf).squeeze(-1)  # [T, k, F]
    u = (up @ xf).squeeze(-1)
    h = torch.nn.functional.silu(g) * u
    out = (down @ h[..., None]).squeeze(-1)  # [T, k, H]
    y = (out * weights.float()[..., None]).sum(1)
    return y.to(out_dtype or x.dtype).contiguous()
