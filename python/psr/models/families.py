"""Model families psr can offload: router semantics and expert tensor names.

Adding a family means describing its router here (a `MoESpec`) and where its expert
weights live; attention, norms and the KV cache stay transformers' own modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psr.runtime.spec import MoESpec

SUPPORTED = ("olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")


def unsupported(model_type: str) -> ValueError:
    return ValueError(
        f"unsupported architecture {model_type!r}; psr supports: {', '.join(SUPPORTED)} "
        "(Moonlight-16B-A3B loads as deepseek_v3)"
    )


# config.json keys each family's MoESpec reads: (experts, top-k, hidden, expert FFN).
_REQUIRED = {
    "olmoe": ("num_experts", "num_experts_per_tok", "hidden_size", "intermediate_size"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size"),
    "deepseek_v3": (
        "n_routed_experts",
        "num_experts_per_tok",
        "hidden_size",
        "moe_intermediate_size",
    ),
}


def check_config(
    raw: dict[str, Any], aliases: dict[str, str] | None = None, where: str = "config.json"
) -> None:
    """The raw config names a supported family and sets its MoE sizes explicitly, as
    positive ints with top-k <= experts (transformers would fill in silent defaults).
    `aliases`: the config class's `attribute_map` (alias -> attribute), e.g. Qwen3-MoE
    saves `num_experts` as `num_local_experts`."""
    mt = raw.get("model_type")
    if mt not in SUPPORTED:
        raise unsupported(str(mt))
    aliases = aliases or {}
    values = {}
    for key in _REQUIRED[mt]:
        names = [key, *(a for a, k in aliases.items() if k == key)]
        if key in aliases:
            names.append(aliases[key])
        found = next((n for n in names if n in raw), None)
        if found is None:
            raise ValueError(f"{where} ({mt}) lacks {key!r}")
        v = values[key] = raw[found]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where} ({mt}): {found} must be a positive int, got {v!r}")
    experts, top_k = _REQUIRED[mt][:2]
    if values[top_k] > values[experts]:
        raise ValueError(
            f"{where} ({mt}): {top_k}={values[top_k]} experts per token exceeds "
            f"{experts}={values[experts]}"
        )


def moe_spec(cfg: Any) -> MoESpec:
    """The MoESpec of a transformers config."""
    mt = getattr(cfg, "model_type", None)
    if mt in ("olmoe", "qwen2_moe", "qwen3_moe"):
        return MoESpec(
            family=mt,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            ffn_size=cfg.moe_intermediate_size if mt != "olmoe" else cfg.intermediate_size,
            renormalize=bool(cfg.norm_topk_prob),
        )
    if mt == "mixtral":
        return MoESpec(
            family=mt,
            num_experts=cfg.num_local_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            ffn_size=cfg.intermediate_size,
            renormalize=True,
            weights_in_logits_dtype=False,
        )
    if mt == "deepseek_v3":
        return MoESpec(
            family=mt,
            num_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            ffn_size=cfg.moe_intermediate_size,
            scoring="sigmoid",
            renormalize=bool(cfg.norm_topk_prob),
            n_group=int(cfg.n_group or 1),
            topk_group=int(cfg.topk_group or 1),
            scaling=float(cfg.routed_scaling_factor),
            logits_fp32=True,
            weights_in_logits_dtype=False,
        )
    raise unsupported(str(mt))


def expert_tensor_names(family: str, layer: int, expert: int) -> list[tuple[str, str, str]]:
    """Candidate (gate, up, down) per-expert tensor names on disk, most likely first
    (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`)."""
    p = f"model.layers.{layer}"
    out = [tuple(f"{p}.mlp.experts.{expert}.{m}_proj.weight" for m in ("gate", "up", "down"))]
    if family == "mixtral":
        out.insert(
            0,
            tuple(f"{p}.block_sparse_moe.experts.{expert}.{w}.weight" for w in ("w1", "w3", "w2")),
        )
    return out


def fused_expert_names(layer: int) -> tuple[str, str]:
    """Fused layout: gate_up_proj [E, 2F, H] (gate rows first), down_proj [E, H, F]."""
    p = f"model.layers.{layer}.mlp.experts"
    return f"{p}.gate_up_proj", f"{p}.down_proj"


def disk_names(family: str, param_name: str) -> list[str]:
    """Candidate on-disk names of a non-expert parameter of the transformers model."""
    out = [param_name]
    if family == "mixtral" and ".mlp.gate." in param_name:
        out.append(param_name.replace(".mlp.gate.", ".block_sparse_moe.gate."))
    return out


def expert_parts(experts: nn.Module, e: int) -> list[torch.Tensor]:
    """Expert `e`'s weights from a built experts module, in packing order: fused
    `[gate_up, down]`, Mixtral `[w1, w3, w2]`, else `[gate, up, down]`."""
    if hasattr(experts, "gate_up_proj"):
        return [experts.gate_up_proj[e], experts.down_proj[e]]
    ex = experts[e]
    if hasattr(ex, "w1"):
        return [ex.w1.weight, ex.w3.weight, ex.w2.weight]
    return [ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight]
