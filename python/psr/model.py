"""Load or adapt a transformers MoE model for offloaded decoding under a routing policy.

    model = psr.load("path/to/checkpoint", policy="psr", residency=0.5, lam=0.2, n=1)
    ids = model.generate(input_ids, max_new_tokens=64)
    print(model.stats.table())

    psr.offload(hf_model, policy="psr", residency=0.5)   # swap MoE blocks in place
    hf_model.generate(...)                               # transformers tooling keeps working

The model's routers and experts modules are replaced by psr modules; attention, norms,
KV cache and generation stay transformers' own. Expert weights stream from safetensors
(memory-mapped) into the store's host memory; everything else goes to the device.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from psr._backend import current_backend
from psr.checkpoint import Checkpoint, CheckpointError, read_config
from psr.families import (
    SUPPORTED,
    MoEConfig,
    disk_names,
    expert_tensor_names,
    fused_expert_names,
    moe_config,
    unsupported,
)
from psr.policy import Policy, make_policy
from psr.runtime import OffloadedExperts, OffloadRuntime, PSRRouter, Stats
from psr.store import ExpertStore, LayerSpec
from psr.trace import TraceRecorder

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")


def resolve_capacity(
    mcfg: MoEConfig, policy: Policy, residency: float | None, slots: int | None
) -> int:
    """Slots per layer: C = floor(residency * E + 0.5), or given; k <= C <= E and n <= C."""
    E, k = mcfg.num_experts, mcfg.top_k
    if slots is not None:
        C, how = int(slots), f"slots={slots}"
    else:
        if residency is None or not (0 < residency <= 1):
            raise ValueError(f"residency must be in (0, 1], got {residency!r}")
        C, how = math.floor(residency * E + 0.5), f"residency {residency:g} of {E} experts"
    if C < k:
        raise ValueError(
            f"{how} gives {C} expert slots per layer, fewer than top_k={k}: "
            f"need residency >= {k / E:.4g} (or slots >= {k})"
        )
    if C > E:
        raise ValueError(f"{how} gives {C} slots, more than the {E} experts per layer")
    if policy.n > C:
        raise ValueError(f"n={policy.n} prefetches exceed the {C} slots per layer")
    return C


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: expected model.model.layers (a causal LM)")
    return layers


def _moe_layer_indices(model: nn.Module) -> list[int]:
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            if not hasattr(layer, "post_attention_layernorm"):
                raise TypeError(f"decoder layer {i} has no post_attention_layernorm")
            out.append(i)
    if not out:
        raise TypeError(f"{type(model).__name__} has no MoE layers (mlp.gate + mlp.experts)")
    return out


def _cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.2x calls the KV cache argument `cache`, earlier `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _out_cache(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


class OffloadedModel(nn.Module):
    """A transformers causal LM whose MoE experts are offloaded under a routing policy."""

    def __init__(
        self,
        hf_model: nn.Module,
        runtime: OffloadRuntime,
        tokenizer: Any = None,
        path: str | None = None,
    ) -> None:
        super().__init__()
        self.hf = hf_model
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.path = path
        self._kv = _cache_kwarg(hf_model)

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def stats(self) -> Stats:
        return self.runtime.stats

    @property
    def policy(self) -> Policy:
        return self.runtime.policy

    def reset_stats(self) -> None:
        self.runtime.stats.reset()

    def configure(
        self,
        policy: str | Policy = "psr",
        residency: float | None = 0.5,
        *,
        slots: int | None = None,
        lam: float | None = None,
        n: int | None = None,
    ) -> None:
        """Switch policy and residency without reloading: slots per layer may not exceed
        what the store was built with. Stats are kept (call reset_stats())."""
        pol = make_policy(policy, lam, n)
        C = resolve_capacity(self.runtime.cfg, pol, residency, slots)
        self.runtime.configure(pol, C)

    def record_trace(self) -> TraceRecorder:
        """Start recording decode steps; the recorder's `.trace` feeds psr.latency."""
        rt = self.runtime
        rec = TraceRecorder(
            len(_decoder_layers(self.hf)),
            [L.decoder_index for L in rt.layers],
            rt.cfg.top_k,
            rt.expert_bytes,
            rt.policy.describe(),
        )
        rt.recorder = rec
        return rec

    def _ids(self, input_ids: torch.Tensor | Iterable[int], extra: int = 0) -> torch.Tensor:
        ids = torch.as_tensor(
            input_ids if isinstance(input_ids, torch.Tensor) else list(input_ids), dtype=torch.long
        )
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(
                f"psr decodes one sequence (batch 1); got input of shape {list(ids.shape)}"
            )
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and ids.shape[1] + extra > limit:
            raise ValueError(
                f"prompt of {ids.shape[1]} tokens + {extra} new exceeds the model's "
                f"context of {limit} tokens"
            )
        vocab = self.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids.to(self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[1, T, V]` of one prefill over `input_ids` (exact routing: all prefill)."""
        return self.hf(input_ids=self._ids(input_ids), use_cache=False).logits

    @torch.no_grad()
    def decode_logits(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Logits `[1, T, V]`: prefill the first `prompt_len` tokens, then feed the rest one
        decode step at a time (teacher forcing) under the policy."""
        ids = self._ids(input_ids)
        if not 1 <= prompt_len <= ids.shape[1]:
            raise ValueError(f"prompt_len must be in [1, {ids.shape[1]}], got {prompt_len}")
        out = self.hf(input_ids=ids[:, :prompt_len], use_cache=True)
        logits = [out.logits]
        for t in range(prompt_len, ids.shape[1]):
            kv = {self._kv: _out_cache(out)}
            out = self.hf(input_ids=ids[:, t : t + 1], use_cache=True, **kv)
            logits.append(out.logits)
        return torch.cat(logits, dim=1)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | Iterable[int],
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_id: int | None = None,
        progress: bool = False,
    ) -> torch.Tensor:
        """Greedy (default) or sampled decoding with a KV cache; returns `[1, T + new]` ids."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if do_sample and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0):
            raise ValueError("sampling needs temperature > 0, 0 < top_p <= 1, top_k >= 0")
        ids = self._ids(input_ids, max_new_tokens)
        if max_new_tokens == 0:
            return ids
        gen = torch.Generator().manual_seed(seed)
        out = self.hf(input_ids=ids, use_cache=True)
        for i in tqdm(range(max_new_tokens), disable=not progress, desc="decode", leave=False):
            logits = out.logits[0, -1].float()
            nxt = _sample(logits, gen, temperature, top_k, top_p) if do_sample else logits.argmax()
            ids = torch.cat([ids, nxt.view(1, 1).to(ids.device)], dim=1)
            if (eos_token_id is not None and int(nxt) == eos_token_id) or i == max_new_tokens - 1:
                break
            kv = {self._kv: _out_cache(out)}
            out = self.hf(input_ids=ids[:, -1:], use_cache=True, **kv)
        return ids


def _sample(
    logits: torch.Tensor, gen: torch.Generator, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    logits = (logits / temperature).cpu()
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1:
        sp, si = probs.sort(descending=True)
        drop = sp.cumsum(0) - sp > top_p
        probs[si[drop]] = 0
        probs /= probs.sum()
    return torch.multinomial(probs, 1, generator=gen)[0]


# --------------------------------------------------------------------------- wiring


def _install(
    model: nn.Module,
    mcfg: MoEConfig,
    store: ExpertStore,
    policy: Policy,
    capacity: int,
    compute: str,
    moe_idx: list[int],
) -> OffloadRuntime:
    layers = _decoder_layers(model)
    if compute == "auto":
        compute = "triton" if store.backend == "cuda" else "torch"
    runtime = OffloadRuntime(
        mcfg,
        [(d, layers[d].mlp.gate, layers[d].post_attention_layernorm) for d in moe_idx],
        store,
        policy,
        capacity,
        compute,
    )
    for L in runtime.layers:
        layer = layers[L.decoder_index]
        layer.mlp.gate = PSRRouter(runtime, L)
        layer.mlp.experts = OffloadedExperts(runtime, L)
        layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, args, L=L: runtime.capture_residual(L, args[0])
        )
    state: dict[str, Any] = {}

    def pre(mod, args, kwargs):
        pkv = kwargs.get("cache", kwargs.get("past_key_values"))
        if pkv is None or (hasattr(pkv, "get_seq_length") and pkv.get_seq_length() == 0):
            runtime.begin_sequence()
        ids = kwargs.get("input_ids", args[0] if args else None)
        state.update(
            decoding=runtime.decoding,
            t0=time.perf_counter(),
            tokens=0 if ids is None else ids.shape[-1],
        )

    def post(mod, args, kwargs, output):
        if state.get("decoding"):
            if store.backend == "cuda":
                torch.cuda.synchronize(store.device)
            runtime.end_step(time.perf_counter() - state["t0"])
        else:
            runtime.stats.totals["prefill_tokens"] += state.get("tokens", 0)

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)
    model.psr_runtime = runtime
    return runtime


def _make_store(
    mcfg: MoEConfig, capacity: int, num_layers: int, dtype: torch.dtype, device: torch.device
) -> ExpertStore:
    """One store layer per MoE layer; its backend follows the compute device."""
    cuda = device.type == "cuda"
    return ExpertStore(
        [LayerSpec(mcfg.num_experts, capacity, 3 * mcfg.hidden_size * mcfg.ffn_size)] * num_layers,
        dtype,
        backend="cuda" if cuda else "cpu",
        device=device.index if cuda else None,
    )


def _expert_parts_from_module(experts: nn.Module, e: int) -> list[torch.Tensor]:
    if hasattr(experts, "gate_up_proj"):
        return [experts.gate_up_proj[e], experts.down_proj[e]]
    ex = experts[e]
    if hasattr(ex, "w1"):
        return [ex.w1.weight, ex.w3.weight, ex.w2.weight]
    return [ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight]


@torch.no_grad()
def offload(
    hf_model: nn.Module,
    policy: str | Policy = "psr",
    residency: float | None = 0.5,
    *,
    slots: int | None = None,
    lam: float | None = None,
    n: int | None = None,
    compute: str = "auto",
    progress: bool = True,
) -> OffloadedModel:
    """Move an already-built transformers MoE model's experts into a psr store, in place.

    The model's router and experts modules are swapped for psr's; `hf_model.generate`
    and other transformers tooling keep working (batch 1). Returns an OffloadedModel
    wrapping the same model (for `.stats`, `.generate`, ...).
    """
    mcfg = moe_config(hf_model.config)
    pol = make_policy(policy, lam, n)
    C = resolve_capacity(mcfg, pol, residency, slots)
    moe_idx = _moe_layer_indices(hf_model)
    layers = _decoder_layers(hf_model)
    first = _expert_parts_from_module(layers[moe_idx[0]].mlp.experts, 0)
    dtype = first[0].dtype
    device = layers[moe_idx[0]].mlp.gate.weight.device
    store = _make_store(mcfg, C, len(moe_idx), dtype, device)
    bar = tqdm(
        total=len(moe_idx) * mcfg.num_experts,
        desc="experts -> host store",
        disable=not progress,
        unit="expert",
    )
    for i, d in enumerate(moe_idx):
        experts = layers[d].mlp.experts
        for e in range(mcfg.num_experts):
            store.register(
                i,
                e,
                [t.detach().to("cpu").contiguous() for t in _expert_parts_from_module(experts, e)],
            )
            bar.update()
    bar.close()
    runtime = _install(hf_model, mcfg, store, pol, C, compute, moe_idx)
    return OffloadedModel(hf_model, runtime)


def materialize_rotary(model: nn.Module, device: torch.device | str) -> None:
    """Rebuild rotary-embedding modules on `device`: their frequencies are non-persistent
    buffers, never materialised when a model is built on the meta device."""
    for name, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, type(mod)(config=model.config).to(device))


def _set_tensor(model: nn.Module, name: str, t: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(t, requires_grad=False)
    else:
        mod._buffers[attr] = t


def _keep_fp32(model: nn.Module, name: str) -> bool:
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return any(k in name.split(".") or name.endswith(k) for k in keep)


def _load_experts(
    ckpt: Checkpoint,
    store: ExpertStore,
    mcfg: MoEConfig,
    moe_idx: list[int],
    dtype: torch.dtype,
    progress: bool,
) -> None:
    E, H, Fd = mcfg.num_experts, mcfg.hidden_size, mcfg.ffn_size
    want = {"gate": [Fd, H], "up": [Fd, H], "down": [H, Fd]}
    bar = tqdm(
        total=len(moe_idx) * E, desc="experts -> host store", disable=not progress, unit="expert"
    )
    for i, d in enumerate(moe_idx):
        gu_name, dn_name = fused_expert_names(d)
        fused = gu_name in ckpt and dn_name in ckpt
        if fused:
            for name, shape in ((gu_name, [E, 2 * Fd, H]), (dn_name, [E, H, Fd])):
                if ckpt.shape(name) != shape:
                    raise CheckpointError(
                        f"tensor {name!r} has shape {ckpt.shape(name)}, expected {shape}"
                    )
        for e in range(E):
            if fused:
                parts = [ckpt.get_row(gu_name, e), ckpt.get_row(dn_name, e)]
            else:
                cands = expert_tensor_names(mcfg.family, d, e)
                names = next((c for c in cands if all(n in ckpt for n in c)), None)
                if names is None:
                    missing = next(n for n in cands[-1] if n not in ckpt)
                    raise CheckpointError(
                        f"tensor {missing!r} not found in checkpoint "
                        f"{ckpt.path} (nor the fused {gu_name!r})"
                    )
                for name, key in zip(names, ("gate", "up", "down"), strict=True):
                    if ckpt.shape(name) != want[key]:
                        raise CheckpointError(
                            f"tensor {name!r} has shape {ckpt.shape(name)}, expected {want[key]}"
                        )
                parts = [ckpt.get(n) for n in names]
            store.register(i, e, [p.to(dtype).contiguous() for p in parts])
            bar.update()
    bar.close()


@torch.no_grad()
def load(
    path: str | Path,
    policy: str | Policy = "psr",
    residency: float | None = 0.5,
    *,
    slots: int | None = None,
    lam: float | None = None,
    n: int | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    compute: str = "auto",
    progress: bool = True,
) -> OffloadedModel:
    """Load a local HF checkpoint folder with its experts offloaded to a psr store.

    Args:
        policy: 'exact', 'exact-prefetch', 'cache-prior', 'psr' or 'cache-prior-async'.
        residency: fraction of each layer's experts with a device slot (or `slots`).
        lam, n: bias strength and predicted experts per layer and token (per policy).
        device: compute device (default: cuda if available); the store's backend follows.
        dtype: float32 / bfloat16 / float16 (default: the checkpoint's).
        compute: 'auto' (Triton on CUDA, torch otherwise), 'triton' or 'torch'.
    """
    import transformers

    mt = read_config(path).get("model_type")
    if mt not in SUPPORTED:
        raise unsupported(str(mt))
    ckpt = Checkpoint(path)
    config = transformers.AutoConfig.from_pretrained(str(path))
    mcfg = moe_config(config)
    pol = make_policy(policy, lam, n)
    C = resolve_capacity(mcfg, pol, residency, slots)
    cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = DTYPES.get(cfg_dtype, torch.float32)
    dt = resolve_dtype(dtype, cfg_dtype if cfg_dtype in DTYPES.values() else torch.float32)
    if device is None:
        device = "cuda" if current_backend() == "cuda" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested, but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: psr runs on 'cpu' or 'cuda'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if compute not in ("auto", "triton", "torch"):
        raise ValueError(f"compute must be 'auto', 'triton' or 'torch', got {compute!r}")

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dt)
    model.eval()
    moe_idx = _moe_layer_indices(model)
    expert_prefixes = tuple(f"model.layers.{d}.mlp.experts." for d in moe_idx)
    state_names = [k for k in model.state_dict() if not k.startswith(expert_prefixes)]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name in state_names:
        src = next((c for c in disk_names(mcfg.family, name) if c in ckpt), None)
        if src is None:
            if name == "lm_head.weight" and tied:
                continue
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path}")
        t = ckpt.get(src)
        want = list(
            model.get_parameter(name).shape
            if name in dict(model.named_parameters())
            else model.get_buffer(name).shape
        )
        if list(t.shape) != want:
            raise CheckpointError(f"tensor {src!r} has shape {list(t.shape)}, expected {want}")
        if t.is_floating_point():
            t = t.to(torch.float32 if _keep_fp32(model, name) else dt)
        _set_tensor(model, name, t.to(dev))
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    materialize_rotary(model, dev)

    store = _make_store(mcfg, C, len(moe_idx), dt, dev)
    _load_experts(ckpt, store, mcfg, moe_idx, dt, progress)
    ckpt.close()
    runtime = _install(model, mcfg, store, pol, C, compute, moe_idx)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"tensors not loaded: {leftover[:5]}")
    tokenizer = None
    if any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return OffloadedModel(model, runtime, tokenizer, str(path))
