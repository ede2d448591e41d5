"""Experts read as float matrices: a safetensors checkpoint's (every expert tensor checked
against the config) or a built model's experts module's, expert by expert; and the expert
biases of the families that have them (gpt-oss)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import psr_kernels as pk
from psr.models.checkpoint import Checkpoint, CheckpointError
from psr.models.families import (
    Family,
    expert_parts,
    expert_tensor_names,
    family_of,
    fused_expert_names,
    gpt_oss_bias_table,
    gpt_oss_matrices,
)
from psr.models.rows import PartsReader, RowSource, matrix_source
from psr.models.tiers import float_locators
from psr.runtime.spec import MoESpec


def safetensors_source(
    ckpt: Checkpoint, spec: MoESpec, moe_idx: list[int], dtype: torch.dtype, fmt: pk.RowFormat
) -> RowSource:
    """The checkpoint's experts as the store's rows in format `fmt`, each layer's tensors
    checked; rows stay in the file where it holds their bytes."""
    readers = [expert_reader(ckpt, spec, d) for d in moe_idx]
    src = matrix_source(readers, spec, dtype, fmt, fmt.name)
    sdt = str(src.dtype).removeprefix("torch.")
    locs, why = float_locators(ckpt, spec.family, moe_idx, spec.num_experts, sdt, fmt)
    return dataclasses.replace(src, locators=locs, why_not=why)


def module_reader(experts: nn.Module, fam: Family) -> PartsReader:
    """A built experts module's weights, expert by expert, as contiguous CPU tensors."""
    return lambda e: [t.detach().to("cpu").contiguous() for t in expert_parts(experts, e, fam)]


def on_device(device: torch.device, tables: list[torch.Tensor | None]) -> list[torch.Tensor]:
    out = []
    for t in tables:
        if t is None:
            raise CheckpointError("experts of this family have biases, but a layer has none")
        out.append(t.to(device, torch.float32).contiguous())
    return out


def _check_transposed(
    ckpt: Checkpoint, spec: MoESpec, d: int, biases_only: bool = False
) -> dict[str, str]:
    """The expert tensors of decoder layer `d` in gpt-oss's or Llama 4's layout
    (`gate_up_proj [E, H, 2F]`, `down_proj [E, F, H]`, gpt-oss's biases), checked."""
    E, H, F = spec.num_experts, spec.hidden_size, spec.ffn_size
    want = {} if biases_only else {"gate_up_proj": [E, H, 2 * F], "down_proj": [E, F, H]}
    if spec.expert_bias:
        want |= {"gate_up_proj_bias": [E, 2 * F], "down_proj_bias": [E, H]}
    p = f"model.layers.{d}.{family_of(spec.family).block}.experts"
    names = {n: f"{p}.{n}" for n in want}
    for key, name in names.items():
        if name not in ckpt:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path}")
        ckpt.require_float(name, "expert weight")
        if ckpt.shape(name) != want[key]:
            raise CheckpointError(
                f"tensor {name!r} has shape {ckpt.shape(name)}, expected {want[key]}"
            )
    return names


def _transposed_reader(ckpt: Checkpoint, spec: MoESpec, d: int) -> PartsReader:
    n = _check_transposed(ckpt, spec, d)
    interleaved = family_of(spec.family).expert_layout == "gpt_oss"

    def read(e: int) -> list[torch.Tensor]:
        gu, dn = ckpt.get_row(n["gate_up_proj"], e), ckpt.get_row(n["down_proj"], e)
        return list(gpt_oss_matrices(gu, dn, interleaved))

    return read


def bias_tables(
    ckpt: Checkpoint, spec: MoESpec, moe_idx: list[int], device: torch.device, blocks: bool
) -> list[torch.Tensor]:
    """Per MoE layer, its experts' biases `[E, 2F + H]` fp32 on `device` (gpt-oss): small
    (2F + H values an expert), kept on the device, never copied. `blocks`: the weights
    were read as blocks (MXFP4): only the biases are checked here."""
    out = []
    for d in moe_idx:
        n = _check_transposed(ckpt, spec, d, biases_only=blocks)
        gub, db = ckpt.get(n["gate_up_proj_bias"]), ckpt.get(n["down_proj_bias"])
        out.append(gpt_oss_bias_table(gub, db))
    return on_device(device, list(out))


def expert_reader(ckpt: Checkpoint, spec: MoESpec, d: int) -> PartsReader:
    """Checks decoder layer `d`'s expert tensors; returns expert id -> its matrices."""
    if family_of(spec.family).expert_layout in ("gpt_oss", "llama4"):
        return _transposed_reader(ckpt, spec, d)
    E, H, Fd = spec.num_experts, spec.hidden_size, spec.ffn_size
    fused = fused_expert_names(spec.family, d)
    gu_name, dn_name = next(((g, n) for g, n in fused if g in ckpt and n in ckpt), fused[-1])
    if gu_name in ckpt and dn_name in ckpt:
        for name, shape in ((gu_name, [E, 2 * Fd, H]), (dn_name, [E, H, Fd])):
            ckpt.require_float(name, "expert weight")
            if ckpt.shape(name) != shape:
                raise CheckpointError(
                    f"tensor {name!r} has shape {ckpt.shape(name)}, expected {shape}"
                )
        return lambda e: [ckpt.get_row(gu_name, e), ckpt.get_row(dn_name, e)]
    want = {"gate": [Fd, H], "up": [Fd, H], "down": [H, Fd]}

    def read(e: int) -> list[torch.Tensor]:
        cands = expert_tensor_names(spec.family, d, e)
        names = next((c for c in cands if all(n in ckpt for n in c)), None)
        if names is None:
            missing = next(n for n in cands[-1] if n not in ckpt)
            raise CheckpointError(
                f"tensor {missing!r} not found in checkpoint "
                f"{ckpt.path} (nor the fused {gu_name!r})"
            )
        for name, key in zip(names, ("gate", "up", "down"), strict=True):
            ckpt.require_float(name, "expert weight")
            if ckpt.shape(name) != want[key]:
                raise CheckpointError(
                    f"tensor {name!r} has shape {ckpt.shape(name)}, expected {want[key]}"
                )
        return [ckpt.get(n) for n in names]

    return read
