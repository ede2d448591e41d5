"""The model families psr offloads: one declarative entry per family.

An entry says where a decoder layer's MoE block, router and experts live in the
transformers model (transformers 5.x gives every family a router module returning
`(logits, weights, ids)` and an experts module called as `experts(x, ids, weights)`, so
psr swaps those two and leaves attention, norms, shared experts and the KV cache to
transformers), which router kind it has (`ROUTER_KINDS`: how psr's routing kernels
reproduce and bias it), its expert kind, the config keys its sizes come from, and how
its experts are named on disk. The loader, the wiring (`hf.py`), `save_pretrained` /
`restore`, `psr inspect` and the runtime's `MoESpec` read only the entry.

Adding a family: an entry in `FAMILIES` plus its tiny checkpoint in the tests
(docs/design.md, "Adding a family").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tables and config checks need no torch (`psr inspect` of a GGUF)
    import torch
    from torch import nn

    from psr.runtime.spec import MoESpec

# Router kinds: how the family's router turns logits into (weights, ids), as psr's
# routing kernels reproduce it (`scoring` of psr_kernels.RouteSpec), with the logical
# cache's bias added where the family's own top-k selection happens.
ROUTER_KINDS: dict[str, str] = {
    "softmax_topk": "softmax over all experts, then top-k (renormalised or not)",
    "topk_softmax": "top-k of the logits (gpt-oss: with the router's bias), then softmax "
    "over the k",
    "sigmoid_topk": "sigmoid + correction bias for selection, optional group-limited top-k "
    "(group score: top-2 sum)",
    "softmax_group_max": "softmax, group-limited top-k with the group's maximum as its score "
    "(DeepSeek-V2 group_limited_greedy)",
    "softmax_bias": "softmax, the correction bias added to the probabilities for selection, "
    "renormalised with a floor (ERNIE moe_norm_min)",
    "sparsemixer": "PhiMoE's sparsemixer: top-1, then a second pick; each weight a softmax "
    "over the experts within a relative threshold of the pick",
    "topk_sigmoid": "top-k of the logits, each weight the sigmoid of its logit (Llama 4)",
}
_SCORING = {
    "softmax_topk": "softmax",
    "topk_softmax": "topk_softmax",
    "sigmoid_topk": "sigmoid",
    "softmax_group_max": "softmax",
    "softmax_bias": "softmax",
    "sparsemixer": "sparsemixer",
    "topk_sigmoid": "topk_sigmoid",
}

# Expert kinds: the expert FFN psr's kernels compute. SwiGLU: down(act(gate x) * up x),
# act = SiLU, no biases.
EXPERT_KINDS: dict[str, str] = {
    "swiglu": "down(silu(gate x) * up x), no biases",
    "gpt_oss": "biases on both projections, gate/up columns interleaved, clamped SwiGLU "
    "(g = min(gate, limit), u = clamp(up, +-limit), g sigmoid(alpha g) (u + 1))",
    "scaled_input": "SwiGLU whose input the router's weight scales: expert(w x) (Llama 4)",
}


@dataclass(frozen=True)
class Family:
    """One architecture (a transformers `model_type`) as psr offloads it.

    Module paths are attribute names inside a decoder layer (`block`) and inside the MoE
    block (`router`, `experts`, `bias`); disk names are relative to
    `model.layers.{i}.{disk_block}`."""

    model_type: str
    router_kind: str
    # config keys: (experts per layer, experts per token, hidden size, expert FFN size)
    keys: tuple[str, str, str, str]
    route: Callable[[Any], dict[str, Any]] = field(default=lambda cfg: {})  # MoESpec extras
    expert_kind: str = "swiglu"
    block: str = "mlp"  # the decoder layer's MoE block attribute
    router: str = "gate"  # the router module inside the block
    router_weight: str = "weight"  # the router's weight inside the router module
    bias: str | None = None  # the correction bias inside the block, if any
    router_bias: str | None = None  # the router's own bias inside the router module
    disk_block: str | None = None  # the block's name on disk when it differs (Mixtral)
    # per-expert tensors on disk: `experts.{e}.{name}.weight` for (gate, up, down)
    per_expert: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    # fused tensors on disk: gate_up [E, 2F, H] (gate rows first) and down [E, H, F]
    fused: tuple[str, str] | None = ("experts.gate_up_proj", "experts.down_proj")
    # "standard" (gate and up as [F, H] rows), "gpt_oss" (gate_up_proj [E, H, 2F] with
    # gate/up columns interleaved, down_proj [E, F, H], and their biases) or "llama4"
    # (gate_up_proj [E, H, 2F], gate columns first, down_proj [E, F, H])
    expert_layout: str = "standard"
    # psr runs the block's forward itself (Llama 4's block calls its router and experts
    # in its own way): shared expert + routed experts, returning (out, logits)
    own_forward: bool = False
    # other on-disk renames inside the block: (model name, disk name)
    renames: tuple[tuple[str, str], ...] = ()
    # config checks: (key, the values it may take) for keys psr relies on
    allowed: tuple[tuple[str, tuple[Any, ...]], ...] = (("hidden_act", ("silu",)),)
    groups: bool = False  # n_group / topk_group in the config
    # transformers' config lists `layer_types` (all full_attention unless the config says
    # otherwise): what `psr inspect` reads without building the config (GGUF files)
    layer_types: bool = False
    notes: str = ""

    @property
    def scoring(self) -> str:
        return _SCORING[self.router_kind]

    def disk_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.disk_block or self.block}"


def _renorm(cfg: Any) -> dict[str, Any]:
    return {"renormalize": bool(getattr(cfg, "norm_topk_prob", False))}


def _deepseek_v3_like(cfg: Any) -> dict[str, Any]:
    return {
        "renormalize": bool(getattr(cfg, "norm_topk_prob", False)),
        "n_group": int(cfg.n_group or 1),
        "topk_group": int(cfg.topk_group or 1),
        "scaling": float(cfg.routed_scaling_factor),
        "logits_fp32": True,
        "weights_in_logits_dtype": False,
    }


def _deepseek_v2(cfg: Any) -> dict[str, Any]:
    grouped = cfg.topk_method == "group_limited_greedy"
    return {
        "n_group": int(cfg.n_group or 1) if grouped else 1,
        "topk_group": int(cfg.topk_group or 1) if grouped else 1,
        "group_score": "max",
        "scaling": float(cfg.routed_scaling_factor),
        "logits_fp32": True,
        "weights_in_logits_dtype": False,
    }


def _ernie(cfg: Any) -> dict[str, Any]:
    return {
        "renormalize": True,
        "norm_min": float(cfg.moe_norm_min),
        "logits_fp32": True,
        "weights_in_logits_dtype": False,
    }


def _deepseek_v3_family(model_type: str, **kw: Any) -> Family:
    """DeepSeek-V3's router and layout (GLM-4.5 and dots1 share them): sigmoid scores plus
    the gate's correction bias, group-limited top-k, shared experts, dense first layers."""
    return Family(
        model_type,
        "sigmoid_topk",
        _DSV3_KEYS,
        _deepseek_v3_like,
        bias="gate.e_score_correction_bias",
        groups=True,
        **kw,
    )


_QWEN_KEYS = ("num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size")
_DSV3_KEYS = ("n_routed_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size")
_MIXTRAL_KEYS = ("num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size")
_MIXTRAL_DISK = dict(disk_block="block_sparse_moe", per_expert=("w1", "w3", "w2"))

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "olmoe",
            "softmax_topk",
            ("num_experts", "num_experts_per_tok", "hidden_size", "intermediate_size"),
            _renorm,
        ),
        Family(
            "qwen2_moe",
            "softmax_topk",
            _QWEN_KEYS,
            _renorm,
            layer_types=True,
            notes="sigmoid-gated shared",
        ),
        Family("qwen3_moe", "softmax_topk", _QWEN_KEYS, _renorm),
        Family(
            "qwen3_next",
            "softmax_topk",
            _QWEN_KEYS,
            _renorm,
            notes="hybrid attention (Gated DeltaNet layers); sigmoid-gated shared expert",
        ),
        Family(
            "qwen3_5_moe_text",
            "softmax_topk",
            _QWEN_KEYS,
            lambda cfg: {"renormalize": True},
            notes="the text model of Qwen3.5-MoE; hybrid attention; sigmoid-gated shared expert",
        ),
        Family(
            "hunyuan_v1_moe",
            "softmax_topk",
            ("num_experts", "moe_topk", "hidden_size", "intermediate_size"),
            lambda cfg: {"renormalize": True},
            router_weight="wg.weight",
            notes="shared MLP beside the routed experts",
        ),
        Family(
            "mixtral",
            "topk_softmax",
            _MIXTRAL_KEYS,
            lambda cfg: {"renormalize": True, "weights_in_logits_dtype": False},
            **_MIXTRAL_DISK,  # type: ignore[arg-type]
        ),
        Family(
            "granitemoe",
            "topk_softmax",
            _MIXTRAL_KEYS,
            lambda cfg: {"renormalize": True},
            block="block_sparse_moe",
            router="router",
            per_expert=None,
            fused=("input_linear.weight", "output_linear.weight"),
            renames=(("router.weight", "router.layer.weight"),),
        ),
        _deepseek_v3_family(
            "deepseek_v3", allowed=(("hidden_act", ("silu",)), ("topk_method", ("noaux_tc",)))
        ),
        _deepseek_v3_family("glm4_moe"),
        _deepseek_v3_family("dots1"),
        Family(
            "minimax_m2",
            "sigmoid_topk",
            _MIXTRAL_KEYS,
            lambda cfg: {
                "renormalize": True,
                "logits_fp32": True,
                "weights_in_logits_dtype": False,
            },
            bias="e_score_correction_bias",
            **_MIXTRAL_DISK,  # type: ignore[arg-type]
        ),
        Family(
            "deepseek_v2",
            "softmax_group_max",
            _DSV3_KEYS,
            _deepseek_v2,
            groups=True,
            allowed=(
                ("hidden_act", ("silu",)),
                ("topk_method", ("greedy", "group_limited_greedy")),
            ),
        ),
        Family(
            "gpt_oss",
            "topk_softmax",
            _MIXTRAL_KEYS,
            lambda cfg: {
                "activation": "clamped",
                "act_alpha": float(cfg.swiglu_alpha),
                "act_limit": float(cfg.swiglu_limit),
                "expert_bias": True,
                "router_bias": True,
            },
            expert_kind="gpt_oss",
            router="router",
            router_bias="bias",
            per_expert=None,
            fused=None,
            expert_layout="gpt_oss",
            layer_types=True,
            allowed=(),
            notes="sliding-window and full attention layers with sinks (transformers' own)",
        ),
        Family(
            "phimoe",
            "sparsemixer",
            _MIXTRAL_KEYS,
            lambda cfg: {"mixer_eps": float(cfg.router_jitter_noise)},
            router="router",
            renames=(("router.weight", "gate.weight"),),
            allowed=(("hidden_act", ("silu",)), ("num_experts_per_tok", (2,))),
            notes="LayerNorm blocks: predictions RMS-norm with the LayerNorm's weight (an "
            "approximation of the next router's input; routing itself is exact)",
            **_MIXTRAL_DISK,  # type: ignore[arg-type]
        ),
        Family(
            "llama4_text",
            "topk_sigmoid",
            _MIXTRAL_KEYS,
            lambda cfg: {"input_scaled": True},
            expert_kind="scaled_input",
            block="feed_forward",
            router="router",
            per_expert=None,
            fused=None,
            expert_layout="llama4",
            own_forward=True,
            notes="dense layers by interleave_moe_layer_step; shared expert; chunked attention",
        ),
        Family(
            "ernie4_5_moe",
            "softmax_bias",
            ("moe_num_experts", "moe_k", "hidden_size", "moe_intermediate_size"),
            _ernie,
            bias="gate.moe_statics.e_score_correction_bias",
            renames=(("gate.moe_statics.", "moe_statics."),),
        ),
    )
}

# Families transformers has that psr does not offload yet: what each lacks.
NOT_YET: dict[str, str] = {
    "llama4": "the multimodal Llama 4 checkpoint (its text model, llama4_text, is supported)",
    "qwen3_5_moe": "the multimodal Qwen3.5-MoE checkpoint (its text model, qwen3_5_moe_text, "
    "is supported)",
}

SUPPORTED = tuple(FAMILIES)


def unsupported(model_type: str) -> ValueError:
    why = NOT_YET.get(model_type)
    if why is not None:
        return ValueError(f"architecture {model_type!r} is not supported yet: psr lacks {why}")
    return ValueError(
        f"unsupported architecture {model_type!r}; psr supports: {', '.join(SUPPORTED)} "
        "(Moonlight-16B-A3B loads as deepseek_v3)"
    )


def family_of(model_type: object) -> Family:
    fam = FAMILIES.get(str(model_type))
    if fam is None:
        raise unsupported(str(model_type))
    return fam


def _find(raw: dict[str, Any], key: str, aliases: dict[str, str]) -> str | None:
    names = [key, *(a for a, k in aliases.items() if k == key)]
    if key in aliases:
        names.append(aliases[key])
    return next((n for n in names if n in raw), None)


def _positive_int(raw: dict[str, Any], found: str, mt: str, where: str) -> int:
    v = raw[found]
    if isinstance(v, list) and v and all(x == v[0] for x in v):
        v = v[0]  # Hunyuan may list a per-layer value; psr needs one for all layers
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{where} ({mt}): {found} must be a positive int, got {v!r}")
    return v


def check_config(
    raw: dict[str, Any], aliases: dict[str, str] | None = None, where: str = "config.json"
) -> None:
    """The raw config names a supported family and sets what its entry needs explicitly
    (transformers would fill in silent defaults): positive sizes, top-k <= experts, an
    activation and methods psr computes, groups that divide the experts. `aliases`: the
    config class's `attribute_map` (alias -> attribute), e.g. Qwen3-MoE saves
    `num_experts` as `num_local_experts`. Raises a one-line ValueError naming the key."""
    mt = raw.get("model_type")
    fam = family_of(mt)
    aliases = aliases or {}
    values = {}
    for key in fam.keys:
        found = _find(raw, key, aliases)
        if found is None:
            raise ValueError(f"{where} ({mt}) lacks {key!r}")
        values[key] = _positive_int(raw, found, str(mt), where)
    experts, top_k = fam.keys[:2]
    if values[top_k] > values[experts]:
        raise ValueError(
            f"{where} ({mt}): {top_k}={values[top_k]} experts per token exceeds "
            f"{experts}={values[experts]}"
        )
    for key, ok in fam.allowed:
        if key in raw and raw[key] not in ok:
            raise ValueError(
                f"{where} ({mt}): {key}={raw[key]!r} is not supported (psr computes "
                f"{', '.join(map(repr, ok))})"
            )
    if fam.groups:
        _check_groups(raw, values[experts], values[top_k], str(mt), where)


def _check_groups(raw: dict[str, Any], E: int, k: int, mt: str, where: str) -> None:
    if raw.get("topk_method") == "greedy":
        return  # DeepSeek-V2 without the group limit
    n_group, topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
    for key, v in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where} ({mt}): {key} must be a positive int, got {v!r}")
    if E % n_group:
        raise ValueError(f"{where} ({mt}): n_group={n_group} does not divide the {E} experts")
    if topk_group > n_group:
        raise ValueError(f"{where} ({mt}): topk_group={topk_group} exceeds n_group={n_group}")
    if n_group > 1 and k > topk_group * (E // n_group):
        raise ValueError(
            f"{where} ({mt}): num_experts_per_tok={k} exceeds the {topk_group * (E // n_group)} "
            f"experts of topk_group={topk_group} groups"
        )


def _attr(cfg: Any, key: str) -> int:
    v = getattr(cfg, key)
    return int(v[0]) if isinstance(v, list) else int(v)


def moe_sizes(cfg: Any) -> tuple[int, int, int, int]:
    """(experts, top-k, hidden size, expert FFN size) of a config, by its family's keys."""
    fam = family_of(getattr(cfg, "model_type", None))
    E, k, H, F = (_attr(cfg, key) for key in fam.keys)
    return E, k, H, F


def moe_spec(cfg: Any) -> MoESpec:
    """The MoESpec of a transformers config, from its family's entry."""
    from psr.runtime.spec import MoESpec

    fam = family_of(getattr(cfg, "model_type", None))
    E, k, H, F = moe_sizes(cfg)
    return MoESpec(
        family=fam.model_type,
        num_experts=E,
        top_k=k,
        hidden_size=H,
        ffn_size=F,
        scoring=fam.scoring,
        **fam.route(cfg),
    )


# --- on-disk names ----------------------------------------------------------------------


def expert_tensor_names(family: str, layer: int, expert: int) -> list[tuple[str, str, str]]:
    """Candidate (gate, up, down) per-expert tensor names on disk, most likely first."""
    fam = FAMILIES[family]
    out = []
    for p in dict.fromkeys((fam.disk_prefix(layer), f"model.layers.{layer}.{fam.block}")):
        if fam.per_expert is not None:
            out.append(tuple(f"{p}.experts.{expert}.{m}.weight" for m in fam.per_expert))
        if fam.per_expert != ("gate_proj", "up_proj", "down_proj"):
            out.append(
                tuple(f"{p}.experts.{expert}.{m}_proj.weight" for m in ("gate", "up", "down"))
            )
    return out  # type: ignore[return-value]


def fused_expert_names(family: str, layer: int) -> list[tuple[str, str]]:
    """Candidate fused names on disk: gate_up_proj [E, 2F, H] (gate rows first), down_proj
    [E, H, F]; the family's own first, then transformers' module names."""
    fam = FAMILIES[family]
    p = f"model.layers.{layer}.{fam.block}"
    out = [(f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj")]
    if fam.fused is not None:
        d = fam.disk_prefix(layer)
        out.insert(0, (f"{d}.{fam.fused[0]}", f"{d}.{fam.fused[1]}"))
    return list(dict.fromkeys(out))


def disk_names(family: str, param_name: str) -> list[str]:
    """Candidate on-disk names of a non-expert tensor of the transformers model: its own
    name, then the family's renames (the MoE block's disk name, a router's)."""
    fam = FAMILIES[family]
    out = [param_name]
    head, sep, rest = param_name.partition(f".{fam.block}.")
    if not sep or not head.startswith("model.layers."):
        return out
    block = fam.disk_block or fam.block
    for model_name, disk_name in fam.renames:
        if rest.startswith(model_name):
            out.append(f"{head}.{block}.{disk_name}{rest[len(model_name) :]}")
    if block != fam.block:
        out.append(f"{head}.{block}.{rest}")
    return list(dict.fromkeys(out))


# --- modules of a built model -----------------------------------------------------------


def moe_block(layer: nn.Module, fam: Family) -> nn.Module | None:
    """The decoder layer's routed MoE block, or None for a dense layer."""
    block = getattr(layer, fam.block, None)
    if block is None or not hasattr(block, "experts") or not hasattr(block, fam.router):
        return None
    return block


def router_weight(router: nn.Module, fam: Family) -> torch.Tensor:
    w = router.get_parameter(fam.router_weight)
    return w


def router_bias(router: nn.Module, fam: Family) -> torch.Tensor | None:
    """The router's own bias (gpt-oss), or None."""
    return None if fam.router_bias is None else router.get_parameter(fam.router_bias)


def correction_bias(block: nn.Module, fam: Family) -> torch.Tensor | None:
    import torch

    if fam.bias is None:
        return None
    owner, _, name = fam.bias.rpartition(".")
    mod = block.get_submodule(owner) if owner else block
    t = getattr(mod, name)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fam.model_type}: {fam.bias} is not a tensor")
    return t.view(-1)  # ERNIE keeps it as [1, E]


def gpt_oss_expert(
    gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One gpt-oss expert as psr keeps it: `gate [F, H]`, `up [F, H]`, `down [H, F]` and its
    biases `[2F + H]` (gate, up, down), from transformers' `gate_up_proj [H, 2F]` (gate and
    up columns interleaved), `gate_up_proj_bias [2F]`, `down_proj [F, H]`, `down_proj_bias
    [H]`."""
    gate, up, down = gpt_oss_matrices(gate_up, down)
    return gate, up, down, gpt_oss_bias_table(gate_up_bias, down_bias)


def gpt_oss_bias_table(gate_up_bias: torch.Tensor, down_bias: torch.Tensor) -> torch.Tensor:
    """psr's biases `[..., 2F + H]` fp32 (gate, up, down) from gpt-oss's interleaved
    `gate_up_proj_bias [..., 2F]` and `down_proj_bias [..., H]` (one expert or all)."""
    import torch

    gub = gate_up_bias
    return torch.cat([gub[..., 0::2], gub[..., 1::2], down_bias], dim=-1).float()


def gpt_oss_matrices(
    gate_up: torch.Tensor, down: torch.Tensor, interleaved: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gpt_oss_expert`'s matrices alone: gate, up `[F, H]` and down `[H, F]` from
    `gate_up [H, 2F]` (columns interleaved; `interleaved=False`: Llama 4's, gate columns
    first) and `down [F, H]`."""
    if interleaved:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    return gate.t().contiguous(), up.t().contiguous(), down.t().contiguous()


def transposed_module_tensors(
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    bias: torch.Tensor | None,
    interleaved: bool,
) -> dict[str, torch.Tensor]:
    """gpt-oss's (`interleaved`, with `bias`) or Llama 4's experts parameters from psr's
    matrices (`gate`, `up` `[E, F, H]`, `down` `[E, H, F]`)."""
    import torch

    if bias is not None:
        return gpt_oss_module_tensors(gate, up, down, bias)
    if interleaved:
        raise ValueError("gpt-oss experts need their biases")
    return {
        "gate_up_proj": torch.cat([gate.mT, up.mT], dim=-1),
        "down_proj": down.mT.contiguous(),
    }


def gpt_oss_module_tensors(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The inverse of `gpt_oss_expert` over a batch of experts (`gate`, `up` `[E, F, H]`,
    `down` `[E, H, F]`, `bias` `[E, 2F + H]`): GptOssExperts' four parameters."""
    import torch

    E, F, H = gate.shape
    gate_up = torch.stack([gate.mT, up.mT], dim=-1).reshape(E, H, 2 * F)
    gate_up_bias = torch.stack([bias[:, :F], bias[:, F : 2 * F]], dim=-1).reshape(E, 2 * F)
    return {
        "gate_up_proj": gate_up,
        "gate_up_proj_bias": gate_up_bias,
        "down_proj": down.mT.contiguous(),
        "down_proj_bias": bias[:, 2 * F :].contiguous(),
    }


def expert_parts(experts: nn.Module, e: int, fam: Family | None = None) -> list[torch.Tensor]:
    """Expert `e`'s weights from a built experts module, in packing order: fused
    `[gate_up, down]`, Mixtral `[w1, w3, w2]`, gpt-oss's de-interleaved and Llama 4's
    `[gate, up, down]` (gpt-oss's biases: `module_bias_table`), else `[gate, up, down]`."""
    if fam is not None and fam.expert_layout in ("gpt_oss", "llama4"):
        p = experts.get_parameter
        inter = fam.expert_layout == "gpt_oss"
        return list(gpt_oss_matrices(p("gate_up_proj")[e], p("down_proj")[e], inter))
    if hasattr(experts, "gate_up_proj"):
        return [experts.gate_up_proj[e], experts.down_proj[e]]
    ex = experts[e]
    if hasattr(ex, "w1"):
        return [ex.w1.weight, ex.w3.weight, ex.w2.weight]
    return [ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight]


def module_bias_table(experts: nn.Module) -> torch.Tensor | None:
    """A built gpt-oss experts module's biases `[E, 2F + H]` fp32 (gate, up, down), or None
    for experts without biases."""
    if not hasattr(experts, "gate_up_proj_bias"):
        return None
    p = experts.get_parameter
    return gpt_oss_bias_table(p("gate_up_proj_bias").detach(), p("down_proj_bias").detach())


# --- multi-token-prediction (MTP) layers ---------------------------------------------------
# Where a family's checkpoint keeps its first MTP layer (psr.models.mtp reads it; names as
# vLLM's deepseek_mtp / glm4_moe_mtp / qwen3_next_mtp / mimo_mtp model files load them).


@dataclass(frozen=True)
class MTPScheme:
    """How one family names its (first) MTP layer on disk; `{L}` is the layer's index
    (`num_hidden_layers` for DeepSeek-style layers numbered after the trunk)."""

    prefix: str  # the layer's own tensors
    enorm: str  # RMSNorm_e over the token's embedding
    hnorm: str  # RMSNorm_h over the target's hidden state
    proj: str  # M [d, 2d]
    norm: str  # the final norm before the head
    block: str  # prefix of the decoder block's tensors
    count_keys: tuple[str, ...]  # config keys with the number of MTP layers
    head: str | None = None  # the layer's own LM head (else the target's)
    embed: str | None = None  # the layer's own embedding (else the target's)
    hidden_first: bool = False  # [RMSNorm_h(h); RMSNorm_e(e)] (MiMo)
    feeds_normed: bool = False  # the next depth reads h'' after the final norm

    def names(self, layer: int) -> dict[str, str]:
        """role -> the layer's own tensor on disk (`layer`: num_hidden_layers)."""
        roles = ("enorm", "hnorm", "proj", "norm", "head", "embed")
        p = self.prefix.format(L=layer)
        return {r: p + getattr(self, r) for r in roles if getattr(self, r) is not None}


_DEEPSEEK = MTPScheme(
    prefix="model.layers.{L}.",
    enorm="enorm.weight",
    hnorm="hnorm.weight",
    proj="eh_proj.weight",
    norm="shared_head.norm.weight",
    block="model.layers.{L}.",
    count_keys=("num_nextn_predict_layers",),
    head="shared_head.head.weight",
    embed="embed_tokens.weight",
)
_QWEN3_NEXT = MTPScheme(
    prefix="mtp.",
    enorm="pre_fc_norm_embedding.weight",
    hnorm="pre_fc_norm_hidden.weight",
    proj="fc.weight",
    norm="norm.weight",
    block="mtp.layers.0.",
    count_keys=("mtp_num_hidden_layers", "num_nextn_predict_layers"),
    feeds_normed=True,
)
# model_type -> its MTP layer's names (transformers' model types; MiMo is Qwen2-based)
MTP_SCHEMES: dict[str, MTPScheme] = {
    "deepseek_v3": _DEEPSEEK,
    "glm4_moe": _DEEPSEEK,
    "qwen3_next": _QWEN3_NEXT,
    "qwen3_5_moe_text": _QWEN3_NEXT,
    "mimo": MTPScheme(
        prefix="model.mtp_layers.0.",
        enorm="token_layernorm.weight",
        hnorm="hidden_layernorm.weight",
        proj="input_proj.weight",
        norm="final_layernorm.weight",
        block="model.mtp_layers.0.",
        count_keys=("num_nextn_predict_layers",),
        hidden_first=True,
        feeds_normed=True,
    ),
}
