"""Wiring psr into a transformers causal LM: find its MoE layers, swap their router and
experts modules for psr's, and hook sequence starts, residual capture and timing."""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from typing import Any

import torch
from torch import nn

from psr.runtime.engine import OffloadRuntime
from psr.runtime.modules import OffloadedExperts, PSRRouter
from psr.runtime.spec import MoESpec
from psr.store import ExpertStore


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: expected model.model.layers (a causal LM)")
    return layers


def moe_layer_indices(model: nn.Module) -> list[int]:
    """Decoder indices of the layers with a routed MoE block (`mlp.gate` + `mlp.experts`)."""
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            if not hasattr(layer, "post_attention_layernorm"):
                raise TypeError(f"decoder layer {i} has no post_attention_layernorm")
            out.append(i)
    if not out:
        raise TypeError(f"{type(model).__name__} has no MoE layers (mlp.gate + mlp.experts)")
    return out


def install(
    model: nn.Module,
    spec: MoESpec,
    store: ExpertStore,
    policy: Any,
    capacity: int,
    compute: str,
    moe_idx: list[int],
) -> OffloadRuntime:
    """Swap each MoE layer's router and experts for psr's and hook the model's forward."""
    layers = decoder_layers(model)
    runtime = OffloadRuntime(
        spec,
        [(d, layers[d].mlp.gate, layers[d].post_attention_layernorm) for d in moe_idx],
        store,
        policy,
        capacity,
        compute,
        num_decoder_layers=len(layers),
    )
    for L in runtime.layers:
        layer = layers[L.decoder_index]
        layer.mlp.gate = PSRRouter(runtime, L)
        layer.mlp.experts = OffloadedExperts(runtime, L)
        layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, args, L=L: runtime.capture_residual(L, args[0])
        )
    _wrap_forward(model, runtime)
    model.psr_runtime = runtime
    return runtime


def _wrap_forward(model: nn.Module, runtime: OffloadRuntime) -> None:
    """Every forward of the model runs under the runtime's lock (concurrent callers wait;
    a sequence interleaved with another is refused, never mixed) and is timed. A wrapper,
    not hooks, so the lock is released when a forward raises. It holds the model weakly:
    no reference cycle keeps a dropped model (and its store) alive."""
    fwd = type(model).forward
    ref = weakref.ref(model)

    @functools.wraps(fwd)
    def forward(*args: Any, **kwargs: Any) -> Any:
        self = ref()
        if self is None:
            raise RuntimeError("psr: the model behind this forward was freed")
        kv = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids", args[0] if args else None)
        with runtime.lock:
            runtime.enter_forward(kv)
            decoding = runtime.decoding
            t0 = time.perf_counter()
            output = fwd(self, *args, **kwargs)
            runtime.exit_forward(output)
            if decoding:
                if runtime.store.backend == "cuda":
                    torch.cuda.synchronize(runtime.store.device)
                runtime.end_step(time.perf_counter() - t0)
            else:
                runtime.count_prefill(0 if ids is None else ids.shape[-1])
            return output

    # The bound signature (no `self`), for callers that inspect accepted arguments.
    forward.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]
    model.forward = forward


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
