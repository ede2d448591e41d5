"""Wiring psr into a transformers causal LM: find its MoE layers, swap their router and
experts modules for psr's, and hook sequence starts, residual capture and timing; and the
way back (`uninstall`), and checkpoints that name the experts as the model does."""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import psr_kernels as pk
from psr.models.families import (
    Family,
    correction_bias,
    family_of,
    moe_block,
    router_bias,
    router_weight,
    transposed_module_tensors,
)
from psr.runtime.engine import OffloadRuntime
from psr.runtime.kv import cache_kwarg
from psr.runtime.layer import MoELayer, Wiring
from psr.runtime.modules import OffloadedExperts, PSRRouter
from psr.runtime.spec import MoESpec
from psr.store import ExpertStore


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: expected model.model.layers (a causal LM)")
    return layers


def model_family(model: nn.Module) -> Family:
    """The family entry of a transformers model (its config's model_type)."""
    return family_of(getattr(getattr(model, "config", None), "model_type", None))


def moe_layer_indices(model: nn.Module) -> list[int]:
    """Decoder indices of the layers with a routed MoE block (the family's block with its
    router and experts; dense layers have none)."""
    fam = model_family(model)
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        if moe_block(layer, fam) is not None:
            if not hasattr(layer, "post_attention_layernorm"):
                raise TypeError(f"decoder layer {i} has no post_attention_layernorm")
            out.append(i)
    if not out:
        raise TypeError(
            f"{type(model).__name__} has no MoE layers ({fam.block}.{fam.router} + "
            f"{fam.block}.experts)"
        )
    return out


def block_of(model: nn.Module, decoder_index: int) -> nn.Module:
    """Decoder layer `decoder_index`'s MoE block."""
    fam = model_family(model)
    block = moe_block(decoder_layers(model)[decoder_index], fam)
    if block is None:
        raise TypeError(f"decoder layer {decoder_index} has no MoE block")
    return block


@dataclass
class _Swap:
    """One MoE layer as psr found it: what `uninstall` puts back."""

    decoder_index: int
    router: nn.Module  # the model's router (also PSRRouter.inner)
    experts: nn.Module  # the model's experts module, its packed parameters on the meta device
    device: torch.device  # where its parameters go back to
    hook: RemovableHandle  # the residual-capturing pre-hook on post_attention_layernorm
    own_forward: bool = False  # psr set the block's forward (Family.own_forward)


@dataclass
class Installation:
    """What `install` changed in a model (kept as `model.psr_installation`). No reference to
    the model itself: dropping the model frees its store at once (no cycle)."""

    swaps: list[_Swap]
    forward: Callable[..., Any]  # the wrapper installed as the model's `forward`


def install(
    model: nn.Module,
    spec: MoESpec,
    store: ExpertStore,
    policy: Any,
    capacity: int,
    compute: str,
    moe_idx: list[int],
    expert_format: pk.FormatLike | Sequence[pk.FormatLike] = None,
    decode: str = "device",
    expert_biases: list[torch.Tensor] | None = None,
) -> OffloadRuntime:
    """Swap each MoE layer's router and experts for psr's and hook the model's forward.
    `expert_biases`: per MoE layer, its experts' biases `[E, 2F + H]` on the compute
    device, for expert kinds with biases (gpt-oss).

    The replaced experts module is kept, outside the module tree, with its packed
    parameters moved to the meta device (no memory; `store` now holds the weights), so
    `uninstall` can rebuild it from the store. Its state dict (`save_pretrained`) names the
    router and the experts as the original modules do."""
    layers = decoder_layers(model)
    fam = model_family(model)
    runtime = OffloadRuntime(
        spec,
        _wiring(model, spec, moe_idx, expert_biases),
        store,
        policy,
        capacity,
        compute,
        num_decoder_layers=len(layers),
        expert_format=expert_format,
        decode=decode,
    )
    quantized = not runtime.row_format.is_float
    found = []  # checked for every layer before any is changed
    for L in runtime.layers:
        experts = block_of(model, L.decoder_index).experts
        names = packed_names(experts, spec.num_experts)
        if not quantized:  # shapes only: no layer's rows are read (pageable ones stay put)
            rows = torch.empty(
                (spec.num_experts, store.layers[L.index].expert_numel),
                dtype=store.dtype,
                device="meta",
            )
            _check_layout(experts, rows, spec, L.expert_bias)
        real = [experts.get_parameter(n) for n in names if not experts.get_parameter(n).is_meta]
        # psr.load builds the model on the meta device and never materialises its experts.
        found.append((experts, names, real[0].device if real else L.gate_weight.device))
    swaps = []
    for L, (experts, names, device) in zip(runtime.layers, found, strict=True):
        layer, block = layers[L.decoder_index], block_of(model, L.decoder_index)
        for name in names:  # the store holds the weights now: free them
            p = experts.get_parameter(name)
            _set_parameter(experts, name, torch.empty_like(p, device="meta"), p.requires_grad)
        router = PSRRouter(runtime, L)
        router.register_state_dict_post_hook(_unwrap_router_state)
        offloaded = OffloadedExperts(runtime, L)
        offloaded.register_state_dict_post_hook(_experts_state_hook(store, L, spec, experts))
        setattr(block, fam.router, router)
        block.experts = offloaded
        if fam.own_forward:
            block.forward = functools.partial(_scaled_block_forward, weakref.ref(block))
        hook = layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, args, L=L: runtime.capture_residual(L, args[0])
        )
        swaps.append(_Swap(L.decoder_index, L.router, experts, device, hook, fam.own_forward))
    forward = _wrap_forward(model, runtime)
    model.psr_runtime = runtime
    model.psr_installation = Installation(swaps, forward)
    return runtime


def _wiring(
    model: nn.Module,
    spec: MoESpec,
    moe_idx: list[int],
    expert_biases: list[torch.Tensor] | None,
) -> list[Wiring]:
    """Per MoE layer, where the runtime finds its router, norm and biases in the model."""
    layers, fam = decoder_layers(model), model_family(model)
    if spec.expert_bias and (expert_biases is None or len(expert_biases) != len(moe_idx)):
        raise ValueError(f"{fam.model_type}: its experts have biases; pass one table per layer")
    wiring = []
    for i, d in enumerate(moe_idx):
        block = block_of(model, d)
        router = getattr(block, fam.router)
        wiring.append(
            Wiring(
                d,
                router,
                layers[d].post_attention_layernorm,
                router_weight(router, fam),
                correction_bias(block, fam),
                router_bias(router, fam),
                expert_biases[i] if spec.expert_bias and expert_biases else None,
            )
        )
    return wiring


def _scaled_block_forward(
    ref: weakref.ReferenceType[nn.Module], hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's MoE block with psr's router and experts (Family.own_forward): the shared
    expert plus the routed experts, each on its input scaled by the router's weight (the
    experts kind computes that), returning `(out, router logits)` as the block does."""
    block = ref()
    if block is None:
        raise RuntimeError("psr: the MoE block behind this forward was freed")
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits, w, ids = block.router(x)
    out = block.shared_expert(x)
    out.add_(block.experts(x, ids, w).to(out.dtype))
    return out, logits


def uninstall(model: nn.Module) -> None:
    """Undo `install`: the original router and experts modules back in place, the experts'
    weights copied from the host store onto their device in their dtype, the hooks and
    the forward wrapper removed, and the store closed. All or nothing: if materialising
    fails (out of memory) the model stays offloaded and working."""
    runtime = getattr(model, "psr_runtime", None)
    inst = getattr(model, "psr_installation", None)
    if runtime is None or inst is None:
        raise RuntimeError(f"{type(model).__name__} is not offloaded by psr (already restored?)")
    with runtime.lock:
        if runtime.store.closed:
            raise RuntimeError(
                "psr.restore: the expert store is closed (close() freed the experts), so the "
                "model's experts cannot be rebuilt; reload the model instead"
            )
        fam = model_family(model)
        for sw in inst.swaps:
            mlp = block_of(model, sw.decoder_index)
            ok = isinstance(getattr(mlp, fam.router), PSRRouter)
            if not (ok and isinstance(mlp.experts, OffloadedExperts)):
                raise RuntimeError(
                    f"psr.restore: decoder layer {sw.decoder_index}'s router or experts module "
                    "was replaced after offloading; cannot restore"
                )
        if model.__dict__.get("forward") is not inst.forward:
            raise RuntimeError("psr.restore: model.forward was replaced after offloading")
        # Materialise every layer before changing anything.
        weights = []
        for sw, L in zip(inst.swaps, runtime.layers, strict=True):
            host = runtime.store.host(L.index)
            views = expert_tensors(sw.experts, host, runtime.spec, L.expert_bias)
            out = {}
            for name, view in views.items():
                meta = sw.experts.get_parameter(name)
                out[name] = torch.empty(meta.shape, dtype=meta.dtype, device=sw.device)
                out[name].copy_(view)
            weights.append(out)
        for sw, out in zip(inst.swaps, weights, strict=True):
            for name, t in out.items():
                _set_parameter(sw.experts, name, t, sw.experts.get_parameter(name).requires_grad)
            mlp = block_of(model, sw.decoder_index)
            setattr(mlp, fam.router, sw.router)
            mlp.experts = sw.experts
            if sw.own_forward:
                del mlp.forward  # the class's forward again
            sw.hook.remove()
        del model.forward  # the class's forward again
        del model.psr_runtime, model.psr_installation
        for name in ("psr_kv_cache", "psr_kv_format"):  # a kv_format's (runtime/kv_quant.py)
            model.__dict__.pop(name, None)
        runtime.store.close()


# --- expert tensors: the original module's names over the host store ----------------------


def packed_names(experts: nn.Module, num_experts: int) -> list[str]:
    """Parameters of an experts module that psr packs into the store, in packing order:
    fused `gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`, or per expert Mixtral's
    `{e}.w1/w3/w2.weight`, others' `{e}.gate_proj/up_proj/down_proj.weight` (families.py's
    `expert_parts` reads them in the same order); gpt-oss's four (with its biases), Llama
    4's two (transposed)."""
    if hasattr(experts, "gate_up_proj_bias"):
        return ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]
    if hasattr(experts, "gate_up_proj"):
        return ["gate_up_proj", "down_proj"]
    mixtral = hasattr(experts[0], "w1")
    mats = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    return [f"{e}.{m}.weight" for e in range(num_experts) for m in mats]


def expert_tensors(
    experts: nn.Module,
    host: torch.Tensor,
    spec: MoESpec,
    bias_table: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """`experts`' packed parameters as views of its layer's host rows `[E, 3HF]` (no copy),
    or, for gpt-oss's interleaved layout, rebuilt from them and the layer's `bias_table`
    (a copy)."""
    if host.dtype == torch.uint8:
        raise RuntimeError(
            "psr: the host store holds quantized experts (an expert_format, or a GGUF "
            "file's blocks); restoring or saving them as a transformers model would write "
            "dequantized, lossy weights: load the original safetensors checkpoint without "
            "expert_format instead"
        )
    H, F = spec.hidden_size, spec.ffn_size
    gate, up, down = pk.unpack_expert(host, H, F)  # [E, F, H], [E, F, H], [E, H, F]
    names = packed_names(experts, spec.num_experts)
    layout = family_of(spec.family).expert_layout
    if layout in ("gpt_oss", "llama4"):  # transposed layouts: rebuilt (a copy)
        if layout == "gpt_oss" and bias_table is None:
            raise RuntimeError(f"{spec.family}: its experts' biases are missing")
        bias = None if bias_table is None else bias_table.to(host.device)
        return transposed_module_tensors(gate, up, down, bias, layout == "gpt_oss")
    if names[0] == "gate_up_proj":
        # A row packs gate, up, down back to back (docs/design.md), so gate_up [2F, H] is
        # the row's first 2FH elements: gate rows first, as the fused layout has them.
        gate_up = host[:, : 2 * F * H].view(spec.num_experts, 2 * F, H)
        return {"gate_up_proj": gate_up, "down_proj": down}
    mats = [t[e] for e in range(spec.num_experts) for t in (gate, up, down)]
    return dict(zip(names, mats, strict=True))


def _check_layout(
    experts: nn.Module, host: torch.Tensor, spec: MoESpec, bias_table: torch.Tensor | None
) -> None:
    for name, view in expert_tensors(experts, host, spec, bias_table).items():
        want = experts.get_parameter(name).shape
        if view.shape != want:
            raise TypeError(
                f"{type(experts).__name__}.{name} has shape {list(want)}, expected "
                f"{list(view.shape)} for {spec.num_experts} experts of H={spec.hidden_size}, "
                f"F={spec.ffn_size}"
            )


def _set_parameter(module: nn.Module, name: str, t: torch.Tensor, requires_grad: bool) -> None:
    owner, _, attr = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    mod._parameters[attr] = nn.Parameter(t, requires_grad=requires_grad)


def _unwrap_router_state(
    module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """PSRRouter keeps the model's router as `.inner`; the checkpoint names its tensors
    as the router module does (`mlp.gate.weight`, not `mlp.gate.inner.weight`)."""
    inner = prefix + "inner."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner) :]] = state.pop(key)


def _experts_state_hook(
    store: ExpertStore, L: MoELayer, spec: MoESpec, experts: nn.Module
) -> Callable[[nn.Module, dict[str, Any], str, Any], None]:
    """A state-dict hook giving OffloadedExperts the original experts module's tensors,
    read from the host store. No copy: each is a view with a storage of its own
    (`torch.from_dlpack` over the same memory). As views of one buffer, transformers'
    `save_pretrained` would take them for tied weights and clone all of them at once
    (or refuse the interleaved fused ones); they are disjoint, so this is safe."""

    def hook(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if store.closed:
            raise RuntimeError(
                "psr: the expert store is closed (close() freed the experts); the model's "
                "state dict cannot include them"
            )
        tensors = expert_tensors(experts, store.host(L.index), spec, L.expert_bias)
        for name, view in tensors.items():
            state[prefix + name] = torch.from_dlpack(view)

    return hook


def _wrap_forward(model: nn.Module, runtime: OffloadRuntime) -> Callable[..., Any]:
    """Every forward of the model runs under the runtime's lock (concurrent callers wait;
    a sequence interleaved with another is refused, never mixed) and is timed. A wrapper,
    not hooks, so the lock is released when a forward raises. It holds the model weakly:
    no reference cycle keeps a dropped model (and its store) alive."""
    fwd = type(model).forward
    ref = weakref.ref(model)
    kv_name = cache_kwarg(model)

    @functools.wraps(fwd)
    def forward(*args: Any, **kwargs: Any) -> Any:
        self = ref()
        if self is None:
            raise RuntimeError("psr: the model behind this forward was freed")
        kv = kwargs.get("cache", kwargs.get("past_key_values"))
        packed = getattr(self, "psr_kv_cache", None)  # a kv_format's (runtime/kv_quant.py)
        if packed is not None and kwargs.get("use_cache", self.config.use_cache):
            if kv is None:
                kv = kwargs[kv_name] = packed(None)
            else:
                packed(kv)  # an empty transformers cache: its layers packed in place
        ids = kwargs.get("input_ids", args[0] if args else None)
        with runtime.lock:
            runtime.enter_forward(kv)
            t0 = time.perf_counter()
            output = fwd(self, *args, **kwargs)
            runtime.exit_forward(
                output, time.perf_counter() - t0, 0 if ids is None else ids.shape[-1]
            )
            return output

    # The bound signature (no `self`), for callers that inspect accepted arguments.
    forward.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]
    model.forward = forward
    return forward


def materialize_rotary(model: nn.Module, device: torch.device | str) -> None:
    """Rebuild rotary-embedding modules on `device`: their frequencies are non-persistent
    buffers, never materialised when a model is built on the meta device."""
    for name, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, type(mod)(config=model.config).to(device))


def set_tensor(model: nn.Module, name: str, t: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(t, requires_grad=False)
    else:
        mod._buffers[attr] = t


def keep_fp32(model: nn.Module, name: str) -> bool:
    """transformers' `_keep_in_fp32_modules`: parameters that stay fp32 in any dtype."""
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return any(k in name.split(".") or name.endswith(k) for k in keep)
