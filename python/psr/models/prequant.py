"""Checkpoints a lab ships quantized, loaded as they are (never through bf16).

* gpt-oss's MXFP4 (`quantization_config.quant_method = "mxfp4"`): each expert matrix is
  `*_blocks [E, out, in / 32, 16]` (two e2m1 codes a byte, the low nibble first) and
  `*_scales [E, out, in / 32]` (e8m0). The store holds the same codes and scales as GGML's
  MXFP4 blocks (scale byte, then low nibbles = the block's first 16 values): a lossless
  reordering of nibbles within each block; gate and up rows are gpt-oss's interleaved
  `gate_up` rows (even, odd).
* Block-wise FP8 (`quant_method = "fp8"`, `weight_block_size = [128, 128]`: DeepSeek-V3 /
  R1, Qwen3-FP8): every linear weight is e4m3 with `weight_scale_inv` per 128 x 128 tile.
  Experts are stored as FP8_B128 blocks (`psr_kernels.pack_fp8_b128`: the codes as they are,
  each row carrying its tile row's scales); dense weights are dequantized once to the model
  dtype (`Checkpoint.get`, `psr.models.checkpoint.dequantize_fp8_tiles`).

Any other `quantization_config` is refused with the methods psr does load.
"""

from __future__ import annotations

from typing import Any

import torch

import psr_kernels as pk
from psr.models.checkpoint import Checkpoint, CheckpointError
from psr.models.families import FAMILIES, expert_tensor_names
from psr.models.rows import PartsReader, RowSource, block_source
from psr.runtime.spec import MoESpec

PREQUANT_METHODS = ("mxfp4", "fp8")


def quant_method(config: dict[str, Any], where: str) -> str | None:
    """The checkpoint's pre-quantization (`mxfp4`, `fp8`) or None; other methods refused."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in PREQUANT_METHODS:
        raise CheckpointError(
            f"{where}: quantization_config.quant_method {method!r} is not one psr loads "
            f"(it loads {', '.join(PREQUANT_METHODS)} checkpoints as they are, and any bf16 / "
            f"fp32 checkpoint)"
        )
    if method == "fp8":
        bs = qc.get("weight_block_size")
        if list(bs or []) != [128, 128]:
            raise CheckpointError(
                f"{where}: fp8 checkpoints load with weight_block_size [128, 128]; this one "
                f"has {bs!r}"
            )
    return str(method)


def mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GGML MXFP4 bytes `[R, in / 32 * 17]` of gpt-oss's `blocks [R, nb, 16]` and
    `scales [R, nb]`: the same codes and scales, nibbles reordered within each block."""
    b = blocks.to(torch.int32)
    v = torch.stack([b & 0xF, b >> 4], -1).flatten(-2)  # [R, nb, 32]: value order
    qs = v[..., :16] | (v[..., 16:] << 4)
    out = torch.cat([scales.to(torch.int32)[..., None], qs], -1).to(torch.uint8)
    return out.reshape(blocks.shape[0], -1).contiguous()


def _require(ckpt: Checkpoint, name: str, shape: list[int], dtype: str) -> None:
    if name not in ckpt:
        raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path}")
    if ckpt.shape(name) != shape or ckpt.dtype(name) != dtype:
        raise CheckpointError(
            f"tensor {name!r} in {ckpt.path} is {ckpt.dtype(name)} {ckpt.shape(name)}, "
            f"expected {dtype} {shape}"
        )


def mxfp4_reader(ckpt: Checkpoint, family: str, d: int, E: int, H: int, F: int) -> PartsReader:
    """gpt-oss's MXFP4 experts of decoder layer `d`, checked, as GGML MXFP4 row bytes."""
    p = f"model.layers.{d}.{FAMILIES[family].block}.experts"
    names = {
        "gub": (f"{p}.gate_up_proj_blocks", [E, 2 * F, H // 32, 16], "U8"),
        "gus": (f"{p}.gate_up_proj_scales", [E, 2 * F, H // 32], "U8"),
        "db": (f"{p}.down_proj_blocks", [E, H, F // 32, 16], "U8"),
        "ds": (f"{p}.down_proj_scales", [E, H, F // 32], "U8"),
    }
    if H % 32 or F % 32:
        raise CheckpointError(f"{ckpt.path}: MXFP4 experts need sizes that are multiples of 32")
    for name, shape, dt in names.values():
        _require(ckpt, name, shape, dt)

    def read(e: int) -> list[torch.Tensor]:
        gu = mxfp4_to_ggml(ckpt.get_row(names["gub"][0], e), ckpt.get_row(names["gus"][0], e))
        down = mxfp4_to_ggml(ckpt.get_row(names["db"][0], e), ckpt.get_row(names["ds"][0], e))
        return [gu[0::2].reshape(-1), gu[1::2].reshape(-1), down.reshape(-1)]

    return read


def fp8_reader(ckpt: Checkpoint, family: str, d: int, E: int, H: int, F: int) -> PartsReader:
    """Block-wise FP8 per-expert weights of decoder layer `d` as FP8_B128 row bytes."""
    if H % 128 or F % 128:
        raise CheckpointError(
            f"{ckpt.path}: block-wise FP8 experts load with sizes that are multiples of 128 "
            f"(hidden {H}, expert FFN {F})"
        )
    want = ([F, H], [F, H], [H, F])

    def names(e: int) -> tuple[str, str, str]:
        cands = expert_tensor_names(family, d, e)
        found = next((c for c in cands if all(n in ckpt for n in c)), None)
        if found is None:
            missing = next(n for n in cands[-1] if n not in ckpt)
            raise CheckpointError(f"tensor {missing!r} not found in checkpoint {ckpt.path}")
        return found

    for n, shape in zip(names(0), want, strict=True):  # the first expert checked up front
        _require(ckpt, n, shape, "F8_E4M3")
        _require(ckpt, f"{n}_scale_inv", [-(-shape[0] // 128), shape[1] // 128], "F32")

    def read(e: int) -> list[torch.Tensor]:
        out = []
        for n, shape in zip(names(e), want, strict=True):
            _require(ckpt, n, shape, "F8_E4M3")
            codes, s = ckpt.get_raw(n), ckpt.get_raw(f"{n}_scale_inv")
            out.append(pk.pack_fp8_b128(codes, s).reshape(-1))
        return out

    return read


def layer_format(method: str) -> pk.RowFormat:
    """The row format of every MoE layer of a checkpoint pre-quantized by `method`."""
    t = "MXFP4" if method == "mxfp4" else "FP8_B128"
    return pk.RowFormat.blocks(t, t, t)


def parts_reader(
    method: str, ckpt: Checkpoint, family: str, d: int, E: int, H: int, F: int
) -> PartsReader:
    return (mxfp4_reader if method == "mxfp4" else fp8_reader)(ckpt, family, d, E, H, F)


def prequant_source(method: str, ckpt: Checkpoint, spec: MoESpec, moe_idx: list[int]) -> RowSource:
    """A pre-quantized checkpoint's experts as the store's rows, every expert tensor checked
    first; they cannot stay in the file (its blocks are rebuilt at load)."""
    E, H, F = spec.num_experts, spec.hidden_size, spec.ffn_size
    readers = [parts_reader(method, ckpt, spec.family, d, E, H, F) for d in moe_idx]
    fmts = [layer_format(method)] * len(moe_idx)
    return block_source(readers, fmts, spec, method, None, f"{method} blocks are rebuilt at load")
