"""`psr.load` (a checkpoint folder), `psr.offload` (a built transformers model) and
`psr.restore` (back to the plain transformers model).

    model = psr.load("path/to/checkpoint", policy="psr", residency=0.5, lam=0.2, n=1)
    psr.offload(hf_model, policy="psr", residency=0.5)   # swap MoE blocks in place
    psr.restore(hf_model)                                # and back

The model's routers and experts modules are replaced by psr modules; attention, norms,
KV cache and generation stay transformers' own. Expert weights stream from safetensors
(memory-mapped) into the store's host memory; everything else goes to the device.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn
from tqdm.auto import tqdm

import psr.vocab as vocab
import psr_kernels as pk
from psr.models import prequant
from psr.models.checkpoint import Checkpoint, CheckpointError, read_config
from psr.models.families import (
    SUPPORTED,
    Family,
    check_config,
    disk_names,
    expert_parts,
    expert_tensor_names,
    family_of,
    fused_expert_names,
    gpt_oss_bias_table,
    gpt_oss_matrices,
    module_bias_table,
    moe_spec,
    router_weight,
)
from psr.models.gguf_load import (
    PartsReader,
    fill_block_store,
    gguf_readers,
    gguf_release,
    is_gguf,
    layer_formats,
    make_block_store,
    open_gguf,
)
from psr.models.hf import (
    block_of,
    install,
    keep_fp32,
    materialize_rotary,
    model_family,
    moe_layer_indices,
    set_tensor,
    uninstall,
)
from psr.models.names import resolve_model
from psr.models.quant_cache import QuantCache, resolve_root
from psr.models.sources import TOKENIZER_FILES
from psr.models.tiers import (
    MemoryOptions,
    TierPlan,
    Tiers,
    default_budget,
    float_locators,
    gguf_locators,
    load_profile,
    memory_options,
    plan_tiers,
)
from psr.points import resolve_policy
from psr.policy import DEFAULT_POLICY, DEFAULT_RESIDENCY, Policy, make_policy
from psr.runtime.model import OffloadedModel
from psr.runtime.spec import MoESpec, resolve_capacity
from psr.store import ExpertStore, LayerSpec, current_backend

if TYPE_CHECKING:  # annotations only (typing.Unpack is Python 3.11+)
    from typing_extensions import Unpack

# int4's group along the input dimension: the rows, their byte size and the quantized-expert
# cache's key must agree on it.
GROUP_SIZE = 128

# The torch dtypes psr computes in (psr.vocab names them; aliases resolve to these).
_TORCH_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in vocab.DTYPE_NAMES)

# One expert's matrices by expert id, for one MoE layer (a checkpoint's or a module's).
ExpertReader = Callable[[int], list[torch.Tensor]]


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    """`dtype` as a torch dtype (any psr.vocab spelling, `torch.` prefix allowed), or
    `default` for None."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype) and dtype in _TORCH_DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in vocab.DTYPE_ALIASES:
        resolved: torch.dtype = getattr(torch, vocab.canonical_dtype(dtype))
        return resolved
    raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")


def _quantized(fmt: str | None) -> TypeGuard[str]:
    return fmt in vocab.QUANT_FORMATS


def make_store(
    spec: MoESpec,
    capacity: int,
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device,
    copy_retries: int | None = None,
    expert_format: str | None = None,
    group_size: int = GROUP_SIZE,
    held: list[int] | None = None,
) -> ExpertStore:
    """One store layer per MoE layer; its backend follows the compute device. Float rows
    hold `spec.expert_numel` elements of `dtype` (bf16 for expert_format='bf16');
    quantized rows are uint8, one contiguous copy with their scales."""
    cuda = device.type == "cuda"
    numel = spec.expert_numel
    if _quantized(expert_format):
        numel = pk.QuantLayout.of(expert_format, spec.hidden_size, spec.ffn_size, group_size).nbytes
        dtype = torch.uint8
    elif expert_format == "bf16":
        dtype = torch.bfloat16
    held = held or [spec.num_experts] * num_layers
    return ExpertStore(
        [LayerSpec(spec.num_experts, capacity, numel, h) for h in held],
        dtype,
        backend="cuda" if cuda else "cpu",
        device=device.index if cuda else None,
        copy_retries=copy_retries,
    )


def expert_row(
    parts: list[torch.Tensor],
    spec: MoESpec,
    store: ExpertStore,
    expert_format: str | None,
    group_size: int,
) -> list[torch.Tensor]:
    """One expert's weights as the store registers them: its float matrices in the
    store's dtype, or one quantized uint8 row (fused gate_up is split into gate, up)."""
    if not _quantized(expert_format):
        return [p.to(store.dtype).contiguous() for p in parts]
    if len(parts) == 2:  # fused: gate_up [2F, H], down [H, F]
        (gate, up), down = torch.split(parts[0], spec.ffn_size), parts[1]
    else:
        gate, up, down = parts
    return [pk.quantize_expert(gate, up, down, expert_format, group_size=group_size)]


def _fill_store(
    store: ExpertStore,
    spec: MoESpec,
    readers: Sequence[ExpertReader],
    expert_format: str | None,
    progress: bool,
    shown_format: str | None,
    tiers: Tiers | None = None,
) -> None:
    """Register every expert of every layer (`readers[i]`: store layer i's experts) in the
    host store as `expert_row` makes it, behind one progress bar (`shown_format` is named in
    its label); experts `tiers` does not hold are registered pageable (their file bytes,
    never read here). `psr.load` and `psr.offload` both fill their store here."""
    with tqdm(
        total=len(readers) * spec.num_experts,
        desc=f"experts -> host store{f' ({shown_format})' if shown_format else ''}",
        disable=not progress,
        unit="expert",
    ) as bar:
        for i, read in enumerate(readers):
            for e in range(spec.num_experts):
                segs = None if tiers is None else tiers.pageable(i, e)
                if segs is not None:
                    store.register_pageable(i, e, segs)
                else:
                    row = expert_row(read(e), spec, store, expert_format, GROUP_SIZE)
                    store.register(i, e, row)
                bar.update()


def _module_reader(experts: nn.Module, fam: Family) -> ExpertReader:
    """A built experts module's weights, expert by expert, as contiguous CPU tensors."""
    return lambda e: [t.detach().to("cpu").contiguous() for t in expert_parts(experts, e, fam)]


@torch.no_grad()
def offload(
    hf_model: nn.Module,
    policy: str | Policy = DEFAULT_POLICY,
    residency: float | None = DEFAULT_RESIDENCY,
    *,
    slots: int | None = None,
    lam: float | None = None,
    n: int | None = None,
    compute: str = "auto",
    copy_retries: int | None = None,
    expert_format: str | None = None,
    decode: str = "device",
    graphs: bool | str = "auto",
    progress: bool | None = None,
    experts_on: str = "gpu",
) -> OffloadedModel:
    """Move an already-built transformers MoE model's experts into a psr store, in place.

    The model's router and experts modules are swapped for psr's; `hf_model.generate`
    and other transformers tooling keep working (batch 1), and `save_pretrained` writes
    the experts under their original names. The experts' weights move into the store:
    the replaced experts module is kept with its parameters on the meta device (no
    memory), and `psr.restore` rebuilds it from the store. Returns an OffloadedModel
    wrapping the same model (for `.stats`, `.generate`, ...). `experts_on`: as `load`.
    """
    progress = on_terminal(progress)
    if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
        raise TypeError(
            f"psr.offload needs a transformers causal LM (an nn.Module with .config), "
            f"got {type(hf_model).__name__}"
        )
    if hasattr(hf_model, "psr_runtime"):
        raise RuntimeError(f"{type(hf_model).__name__} is already offloaded by psr")
    spec = moe_spec(hf_model.config)
    pol = make_policy(policy, lam, n)
    C = resolve_capacity(spec, pol, residency, slots)
    vocab.compute_choice(compute)
    vocab.decode_mode(decode)
    vocab.graphs_choice(graphs)
    where, hybrid_m = vocab.parse_experts_on(experts_on)
    fmt = vocab.expert_format(expert_format)
    moe_idx = moe_layer_indices(hf_model)
    fam = model_family(hf_model)
    first = expert_parts(block_of(hf_model, moe_idx[0]).get_submodule("experts"), 0, fam)
    dtype = first[0].dtype
    if not dtype.is_floating_point:
        raise TypeError(f"expert weights must be floating point, got {dtype}")
    device = router_weight(getattr(block_of(hf_model, moe_idx[0]), fam.router), fam).device
    store = make_store(spec, C, len(moe_idx), dtype, device, copy_retries, fmt)
    modules = [block_of(hf_model, d).get_submodule("experts") for d in moe_idx]
    readers = [_module_reader(m, fam) for m in modules]
    _fill_store(store, spec, readers, fmt, progress, shown_format=fmt)
    biases = _on(device, [module_bias_table(m) for m in modules]) if spec.expert_bias else None
    runtime = install(hf_model, spec, store, pol, C, compute, moe_idx, fmt, decode, biases)
    om = OffloadedModel(hf_model, runtime, restorer=restore)
    om.graphs = graphs
    if where != "gpu":
        om.set_experts_on(where, hybrid_m)
    return om


@torch.no_grad()
def restore(model: nn.Module) -> nn.Module:
    """Undo `offload` / `load`: the model's own router and experts modules back in place,
    their weights copied from the host store onto the model's device in its dtype, psr's
    hooks and forward wrapper removed, the store closed. Returns the transformers model,
    which may be offloaded again. `model`: the OffloadedModel or the transformers model.
    Needs the store open (after `close()` the experts are gone)."""
    hf = model.hf if isinstance(model, OffloadedModel) else model
    if not isinstance(hf, nn.Module):
        raise TypeError(f"psr.restore needs an offloaded model, got {type(model).__name__}")
    uninstall(hf)
    return hf


def _on(device: torch.device, tables: list[torch.Tensor | None]) -> list[torch.Tensor]:
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


def _transposed_reader(ckpt: Checkpoint, spec: MoESpec, d: int) -> ExpertReader:
    n = _check_transposed(ckpt, spec, d)
    interleaved = family_of(spec.family).expert_layout == "gpt_oss"

    def read(e: int) -> list[torch.Tensor]:
        gu, dn = ckpt.get_row(n["gate_up_proj"], e), ckpt.get_row(n["down_proj"], e)
        return list(gpt_oss_matrices(gu, dn, interleaved))

    return read


def _bias_tables(
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
    return _on(device, list(out))


def _expert_reader(ckpt: Checkpoint, spec: MoESpec, d: int) -> ExpertReader:
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


def _from_cache(
    cache: QuantCache,
    store: ExpertStore,
    spec: MoESpec,
    readers: list[ExpertReader],
    progress: bool,
) -> bool:
    """Fill the host store from the cache file, one layer at a time, after checking it:
    its header, then one expert per layer quantized afresh and compared byte for byte.
    False (with a warning) when it does not hold this checkpoint's rows."""
    if not cache.check():
        return False
    E = spec.num_experts
    try:
        bar = tqdm(
            cache.layers(),
            total=len(readers),
            desc="experts <- quantized cache",
            disable=not progress,
            unit="layer",
        )
        for i, rows in enumerate(bar):
            e = (7 * i + 3) % E  # a different expert per layer
            fresh = expert_row(readers[i](e), spec, store, cache.format, GROUP_SIZE)[0]
            if not torch.equal(rows[e], fresh):
                cache.reject(f"layer {i} expert {e} differs from this checkpoint's")
                return False
            for e in range(E):
                store.register(i, e, rows[e])
    except CheckpointError:
        raise  # the checkpoint itself is bad: say so, as a load without a cache would
    except Exception as err:  # an unreadable cache file is rebuilt, never trusted
        cache.reject(f"{type(err).__name__}: {err}")
        return False
    return True


def _load_experts(
    ckpt: Checkpoint,
    store: ExpertStore,
    spec: MoESpec,
    moe_idx: list[int],
    progress: bool,
    expert_format: str | None = None,
    cache: QuantCache | None = None,
    tiers: Tiers | None = None,
) -> None:
    """Stream every expert of every MoE layer from the checkpoint into the host store
    (quantized on the way when `expert_format` asks for it), or read the quantized rows
    from `cache` when it holds them (and write them there when it does not)."""
    fmt = expert_format
    readers = [_expert_reader(ckpt, spec, d) for d in moe_idx]
    if cache is not None and _from_cache(cache, store, spec, readers, progress):
        return
    shown = fmt if _quantized(fmt) else None
    _fill_store(store, spec, readers, fmt, progress, shown_format=shown, tiers=tiers)
    if cache is not None:
        try:
            cache.write([store.host(i) for i in range(len(moe_idx))])
        except Exception as err:  # a cache is an optimisation: the model loaded all the same
            warnings.warn(
                f"could not write the quantized-expert cache {cache.path}: "
                f"{type(err).__name__}: {err}",
                stacklevel=3,
            )


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if current_backend() == "cuda" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested, but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: psr runs on 'cpu' or 'cuda'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass(frozen=True)
class LoadOptions:
    """`psr.load`'s arguments resolved against the checkpoint's config, every one checked."""

    config: Any  # the checkpoint's transformers config
    spec: MoESpec
    policy: Policy
    policy_source: str  # "tuned (<file>)", "untuned default", "given" (psr.points.resolve_policy)
    capacity: int  # expert slots per layer, before a drafter takes its share
    dtype: torch.dtype
    device: torch.device
    compute: str
    decode: str  # "device" | "host" (psr.vocab.DECODE_MODES)
    expert_format: str | None  # None: the model's dtype
    cache_root: Path | None  # the quantized-expert cache folder, or None: no cache
    prequant: str | None = None  # the checkpoint's own quantization (psr.models.prequant)


def _check_checkpoint_config(path: str | Path, raw: dict[str, Any] | None = None) -> None:
    """The folder's config.json (or a GGUF file's config, `raw`) names a supported family
    with what psr needs; a config error is a checkpoint error, named as such."""
    import transformers

    where = f"{path}/config.json" if raw is None else f"{path} (its GGUF metadata)"
    raw = read_config(path) if raw is None else raw
    try:
        mt = raw.get("model_type")
        cls = transformers.CONFIG_MAPPING[mt] if mt in SUPPORTED else None
        check_config(raw, getattr(cls, "attribute_map", None), where)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _config_dtype(config: Any) -> torch.dtype:
    """The checkpoint's dtype when psr computes in it, else float32."""
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, vocab.DTYPE_ALIASES[dt]) if dt in vocab.DTYPE_ALIASES else None
    return dt if isinstance(dt, torch.dtype) and dt in _TORCH_DTYPES else torch.float32


def _resolve_options(
    path: str | Path,
    policy: str | Policy,
    residency: float | None,
    *,
    slots: int | None,
    lam: float | None,
    n: int | None,
    device: str | torch.device | None,
    dtype: str | torch.dtype | None,
    compute: str,
    decode: str,
    expert_format: str | None,
    quality_budget: float | None,
    quant_cache: bool | str | Path | None,
    raw: dict[str, Any],
    config: Any = None,
) -> LoadOptions:
    """Check and resolve `load`'s options, in the order their errors are reported (`raw`:
    the checkpoint's config dict; `config`: a GGUF file's config object, else transformers
    reads the folder's)."""
    import transformers

    gguf = config is not None
    if config is None:
        config = transformers.AutoConfig.from_pretrained(str(path))
    method = None if gguf else prequant.quant_method(raw, str(path))
    if method is not None:
        # psr dequantizes dense weights itself and keeps experts in their blocks: the model
        # is built plain (transformers would swap in its own quantized modules).
        del config.quantization_config
    spec = moe_spec(config)
    C = resolve_capacity(spec, make_policy(policy, lam, n), residency, slots)
    # cache-prior / psr without lam and n: the model's tuned operating point, if any.
    pol, pol_source = resolve_policy(
        policy,
        lam,
        n,
        model_dir=path,
        residency=C / spec.num_experts,
        quality_budget=quality_budget,
    )
    resolve_capacity(spec, pol, residency, slots)  # the tuned n must fit too
    dt = resolve_dtype(dtype, _config_dtype(config))
    dev = _resolve_device(device)
    vocab.compute_choice(compute)
    vocab.decode_mode(decode)
    fmt = vocab.expert_format(expert_format)
    if (gguf or method) and (fmt is not None or quant_cache not in (None, False)):
        what = "a GGUF file's" if gguf else f"this {method} checkpoint's"
        raise ValueError(
            f"{path}: {what} experts stay in their own blocks (the types the file has); "
            f"expert_format must be 'native' (got {expert_format!r}) and quant_cache off"
        )
    cache_root = resolve_root(quant_cache, path)
    if cache_root is not None and not _quantized(fmt):
        raise ValueError(
            f"quant_cache keeps quantized experts; expert_format={expert_format!r} is not "
            f"quantized (choose one of {', '.join(vocab.QUANT_FORMATS)})"
        )
    return LoadOptions(
        config, spec, pol, pol_source, C, dt, dev, compute, decode, fmt, cache_root, method
    )


def _meta_model(opts: LoadOptions) -> tuple[nn.Module, list[int]]:
    """The transformers model built on the meta device (no memory), and its MoE layers."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(opts.config, dtype=opts.dtype)
    model.eval()
    return model, moe_layer_indices(model)


def _build_model(
    ckpt: Checkpoint | Any, opts: LoadOptions, meta: tuple[nn.Module, list[int]]
) -> tuple[nn.Module, list[int]]:
    """The meta model `meta` (`_meta_model`) with every tensor but the MoE experts read from
    the checkpoint onto the compute device; and its MoE layers' indices."""
    dt, dev = opts.dtype, opts.device
    model: Any = meta[0]  # transformers' model class (untyped)
    moe_idx = meta[1]
    block = model_family(model).block
    expert_prefixes = tuple(f"model.layers.{d}.{block}.experts." for d in moe_idx)
    state_names = [k for k in model.state_dict() if not k.startswith(expert_prefixes)]
    tied = bool(getattr(opts.config, "tie_word_embeddings", False))
    for name in state_names:
        src = next((c for c in disk_names(opts.spec.family, name) if c in ckpt), None)
        if src is None:
            if name == "lm_head.weight" and tied:
                continue
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {ckpt.path}")
        is_param = name in dict(model.named_parameters())
        if is_param:
            ckpt.require_float(src)
        t = ckpt.get(src)
        want = list(model.get_parameter(name).shape if is_param else model.get_buffer(name).shape)
        if list(t.shape) != want:
            raise CheckpointError(f"tensor {src!r} has shape {list(t.shape)}, expected {want}")
        if t.is_floating_point():
            t = t.to(torch.float32 if keep_fp32(model, name) else dt)
        set_tensor(model, name, t.to(dev))
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    materialize_rotary(model, dev)
    return model, moe_idx


def _load_drafter(
    path: str | Path,
    speculative: str,
    block: int,
    model: nn.Module,
    num_layers: int,
    opts: LoadOptions,
) -> tuple[Any, int]:
    """The checkpoint's resident drafter, and the expert slots per layer left beside it (its
    memory comes out of the slots: whole slots, in every one of the `num_layers` layers)."""
    from psr.models.drafters import load_drafter

    drafter = load_drafter(path, speculative, block, model, opts.device, opts.dtype)
    spec, C = opts.spec, opts.capacity
    one = make_store(spec, 1, 1, opts.dtype, torch.device("cpu"), None, opts.expert_format)
    row = one.expert_bytes[0]
    lost = -(-drafter.memory_bytes // (num_layers * row))  # ceil: whole slots
    if C - lost < spec.top_k:
        raise ValueError(
            f"the {speculative} drafter ({drafter.memory_bytes / 2**20:.1f} MiB) takes "
            f"{lost} of the {C} expert slots per layer, leaving fewer than top_k="
            f"{spec.top_k}: raise the residency"
        )
    return drafter, C - lost


def _quant_cache(
    path: str | Path, ckpt: Checkpoint, opts: LoadOptions, moe_idx: list[int], row_bytes: int
) -> QuantCache | None:
    """The quantized-expert cache of this checkpoint, format and shape, if one was asked for."""
    if opts.cache_root is None:
        return None
    assert opts.expert_format is not None  # a cache implies a quantized format: checked
    index = "model.safetensors.index.json"
    files = ckpt.files + ([index] if (Path(path) / index).is_file() else [])
    spec = opts.spec
    shape = {"num_experts": spec.num_experts, "hidden": spec.hidden_size, "ffn": spec.ffn_size}
    return QuantCache(
        opts.cache_root, path, files, opts.expert_format, GROUP_SIZE, shape, moe_idx, row_bytes
    )


def dense_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights and buffers (tied ones once; the experts are meta)."""
    seen: set[int] = set()
    out = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out += t.numel() * t.element_size()
    return out


def _tier_plan(
    host_memory: str | int | None,
    host_profile: Any,
    model: nn.Module,
    opts: LoadOptions,
    capacity: int,
    row_bytes: list[int],
    why_not: str | None,
    where: str = "gpu",
) -> TierPlan:
    """The held experts under `host_memory` (None: the default, `tiers.default_budget`;
    'unlimited': all). On the CPU backend the dense weights and the slab count against it."""
    E = opts.spec.num_experts
    cuda = opts.device.type == "cuda"
    fixed = 0 if cuda else dense_bytes(model) + capacity * sum(row_bytes)
    if host_memory is None:
        budget = default_budget(fixed, E * sum(row_bytes))
    elif host_memory == "unlimited":
        budget = None
    else:
        budget = vocab.parse_bytes(host_memory)
    profile = None
    if host_profile is not None:
        profile = load_profile(host_profile, (len(row_bytes), E))
    plan = plan_tiers(budget, fixed, row_bytes, E, why_not, profile, cuda)
    if plan.pageable_bytes and where != "gpu":
        raise ValueError(
            f"experts_on={where!r} computes misses from the host rows in place, but "
            f"host_memory leaves {plan.pageable_bytes / 2**30:.2f} GiB of experts in the "
            "checkpoint file: use experts_on='gpu', or a budget that holds every expert"
        )
    return plan


def _check_all_loaded(model: nn.Module) -> None:
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"tensors not loaded: {leftover[:5]}")


def _block_readers(
    path: str | Path,
    ckpt: Any,
    opts: LoadOptions,
    moe_idx: list[int],
    gguf: bool,
    speculative: str | None,
) -> tuple[list[str], list[PartsReader], str] | None:
    """(per MoE layer its row format and its experts' block reader, the progress label)
    for a GGUF file or a pre-quantized checkpoint, every expert tensor checked; None for
    float checkpoints (their experts stream as matrices)."""
    spec = opts.spec
    if gguf:
        if speculative is not None:
            raise ValueError(
                f"{path}: speculative decoding reads psr's drafter files beside a "
                "safetensors checkpoint; a GGUF file has none"
            )
        return layer_formats(ckpt, spec, moe_idx), gguf_readers(ckpt, moe_idx), "gguf"
    method = opts.prequant
    if method is None:
        return None
    E, H, F = spec.num_experts, spec.hidden_size, spec.ffn_size
    readers = [prequant.parts_reader(method, ckpt, spec.family, d, E, H, F) for d in moe_idx]
    return [prequant.layer_format(method)] * len(moe_idx), readers, method


def _tokenizer(path: str | Path, ckpt: Any = None) -> Any:
    """The folder's tokenizer (a GGUF file's, from its metadata), or None when it ships
    none."""
    if ckpt is not None:  # GGUF: when its metadata has one
        return ckpt.tokenizer() if ckpt.metadata("tokenizer.ggml.model") else None
    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path))


# ------------------------------------------------------------------ threads and context
# (issue 42: load options of their own, for LoadConfig to take over)


def on_terminal(progress: bool | None) -> bool:
    """Progress bars: as asked, or (None) only when stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else bool(progress)


def _set_threads(threads: int | None) -> int:
    """Resolve `threads` (psr.machine.resolve_threads) and give torch's intra-op pool that
    many; psr's CPU expert kernels run on torch.get_num_threads() threads."""
    from psr.machine import resolve_threads

    n = resolve_threads(threads)
    torch.set_num_threads(n)
    return n


def _context(context: int | None, config: Any) -> int | None:
    """`context` checked against the checkpoint's max_position_embeddings (None: that)."""
    if context is None:
        return None
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be an int >= 1 (tokens), got {context!r}")
    trained = getattr(config, "max_position_embeddings", None)
    if trained is not None and context > int(trained):
        raise ValueError(
            f"context={context} exceeds the model's context of {trained} tokens "
            "(max_position_embeddings)"
        )
    return context


@torch.no_grad()
def load(  # noqa: PLR0913 (threads, context: LoadConfig's to take over, issue 40)
    path: str | Path,
    policy: str | Policy = DEFAULT_POLICY,
    residency: float | None = DEFAULT_RESIDENCY,
    *,
    slots: int | None = None,
    lam: float | None = None,
    n: int | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    compute: str = "auto",
    copy_retries: int | None = None,
    expert_format: str | None = None,
    decode: str = "device",
    graphs: bool | str = "auto",
    speculative: str | None = None,
    block: int = 4,
    block_k: int | None = None,
    quality_budget: float | None = None,
    quant_cache: bool | str | Path | None = False,
    progress: bool | None = None,
    experts_on: str = "gpu",
    threads: int | None = None,
    context: int | None = None,
    **memory: Unpack[MemoryOptions],
) -> OffloadedModel:
    """Load a checkpoint with its experts offloaded to a psr store: a local folder, a
    GGUF file, or a Hugging Face repo id (`org/name`, `org/name:FILE.gguf`) from the local
    Hub cache (never downloaded; psr.models.names).

    Args:
        policy: 'exact', 'exact-prefetch', 'cache-prior', 'psr' or 'cache-prior-async'.
        residency: fraction of each layer's experts with a device slot (or `slots`).
        lam, n: bias strength and predicted experts per layer and token (per policy;
            defaults in psr.policy).
        device: compute device (default: cuda if available); the store's backend follows.
        dtype: float32 / bfloat16 / float16 (default: the checkpoint's).
        compute: 'auto' (Triton on CUDA, torch otherwise), 'triton' or 'torch'.
        decode: 'device' (default): decode steps run on device-resident caches with no
            host read, wherever the policy allows (not cache-prior-async, steering
            variants or trace recording); 'host': the host-driven step throughout (the
            store's copies, with their retries). Both give the same tokens and counts.
        graphs: 'auto' (default: on for CUDA, off elsewhere), True or False: `generate`
            decodes each token as one replay of a captured forward over a static KV
            cache (CUDA: a CUDA graph; CPU: torch.compile fullgraph), where the device
            decode step runs; `model.graph_status` says whether it did, and why not.
        copy_retries: re-issues of a failed expert copy before CopyError (default 2,
            or $PSR_COPY_RETRIES).
        expert_format: how the host store keeps experts and copies move them: None or
            'native' (the model's dtype), 'bf16', or quantized while loading: 'int8'
            (per output channel), 'fp8' (e4m3, per channel), 'int4' (group 128); the
            kernels dequantize on the fly.
        progress: progress bars while experts load (None, the default: only when stderr
            is a terminal).
        quant_cache: with a quantized `expert_format`, keep the quantized rows on disk
            and read them on later loads of the same checkpoint: True (the user cache
            folder, or $PSR_CACHE/quantized) or a folder, never inside the model folder
            (psr.models.quant_cache). False (default): quantize on every load.
        speculative: None, 'block' (the checkpoint's drafter_block.safetensors: heads on
            the target's hidden state) or 'ar' (its drafter_ar/ dense model): greedy
            speculative decoding with `block` drafted tokens per verify block and one set of
            `block_k` experts per layer and block (default min(2 top_k, slots)). The
            drafter is resident: its memory comes out of the expert slots (equal device
            memory), so the store gets fewer slots than `residency` alone gives.
        quality_budget: nats/token (95% upper bound) the policy may cost: 'cache-prior' /
            'psr' then require the model's operating point tuned by `psr tune` for this
            budget or a tighter one (the embedded model ships points for 0.01); without
            it, such a policy without lam / n still takes the tuned point when one exists.
        experts_on: where decode steps compute misses: 'gpu' (default: every miss copied
            into the slab), 'cpu' (no miss copied: computed on the CPU from the host
            rows, with psr's CPU expert kernels) or 'hybrid' (at most m misses per MoE
            layer copied, the rest on the CPU; 'hybrid:M' or 'hybrid:M1,M2,...' gives m,
            one for every MoE layer or one per layer; plain 'hybrid' chooses it from this
            machine's profile, `psr bench machine`).
            CPU and GPU arithmetic round differently: the modes may give different
            tokens, each reproducible. `model.set_experts_on` switches later.
        threads: CPU threads for torch's intra-op pool and psr's CPU expert kernels (set
            process-wide with torch.set_num_threads); default $PSR_THREADS, else
            $OMP_NUM_THREADS, else the physical cores of the process's affinity mask
            (psr.machine.resolve_threads). More than the CPUs available is an error.
        context: the context in tokens (llama.cpp's --ctx-size): prompt + new tokens beyond
            it are refused, decode graphs' static KV caches are capped at it, `psr serve`
            reports it as max_model_len. Default: the checkpoint's max_position_embeddings;
            more than that is an error.
        **memory (psr.models.tiers.MemoryOptions):
        host_memory: the host-memory budget ('48GB', '48GiB', bytes, or 'unlimited';
            default: every expert when the model fits 80% of MemAvailable, else that):
            experts beyond it stay in the memory-mapped checkpoint and are read from it
            (page cache or disk) when copied (psr.models.tiers). CPU backend: the dense
            weights and the slab count against it. On CUDA a model with such experts
            decodes with decode='host' (the device step's gather kernel reads pinned rows).
        host_profile: which experts to hold: per MoE layer, per expert, how often it is
            routed to (nested lists or a JSON file); default layer-balanced.
    """
    vocab.graphs_choice(graphs)
    where, hybrid_m = vocab.parse_experts_on(experts_on)
    host_memory, host_profile = memory_options(memory)
    path = resolve_model(path)  # issue 42: a Hub repo id from the local cache
    n_threads = _set_threads(threads)  # issue 42: before the experts are read and quantized
    progress = on_terminal(progress)
    gguf = is_gguf(path)
    if gguf:
        ckpt: Any = open_gguf(path)
        _check_checkpoint_config(path, ckpt.config_dict)
    else:
        _check_checkpoint_config(path)
        ckpt = Checkpoint(path)
    try:
        opts = _resolve_options(
            path,
            policy,
            residency,
            slots=slots,
            lam=lam,
            n=n,
            device=device,
            dtype=dtype,
            compute=compute,
            decode=decode,
            expert_format=expert_format,
            quality_budget=quality_budget,
            quant_cache=quant_cache,
            raw=ckpt.config_dict,
            config=ckpt.config if gguf else None,
        )
        spec = opts.spec
        ctx = _context(context, opts.config)
        meta = _meta_model(opts)
        moe_idx = meta[1]
        # Experts read as blocks (GGUF, pre-quantized): checked before anything is loaded.
        blocks = _block_readers(path, ckpt, opts, moe_idx, gguf, speculative)
        model, moe_idx = _build_model(ckpt, opts, meta)
        drafter, C = None, opts.capacity
        if speculative is not None:
            drafter, C = _load_drafter(path, speculative, block, model, len(moe_idx), opts)
        fmt: str | list[str] | None = opts.expert_format
        if blocks is not None:
            fmt, readers, src = blocks
            H, F = spec.hidden_size, spec.ffn_size
            rows = [pk.GGMLLayout.of(f, H, F).nbytes for f in fmt]
            why = None if gguf else f"{src} blocks are rebuilt at load"
            plan = _tier_plan(host_memory, host_profile, model, opts, C, rows, why, where)
            tiers = None
            if plan.pageable_bytes:
                tiers = Tiers([set(h) for h in plan.held], gguf_locators(ckpt, moe_idx, fmt, H, F))
            store = make_block_store(spec, C, fmt, opts.device, copy_retries, plan.num_held())
            release = gguf_release(ckpt, moe_idx) if gguf else None
            desc = f"experts <- {src}"
            fill_block_store(store, spec, readers, fmt, progress, desc, release, tiers)
        else:
            one = make_store(spec, 1, 1, opts.dtype, torch.device("cpu"), None, opts.expert_format)
            rows = one.expert_bytes * len(moe_idx)
            sdt = str(one.dtype).removeprefix("torch.")
            locs, why = float_locators(ckpt, spec.family, moe_idx, spec.num_experts, sdt,
                                       opts.expert_format)  # fmt: skip
            plan = _tier_plan(host_memory, host_profile, model, opts, C, rows, why, where)
            held = [set(h) for h in plan.held]
            tiers = Tiers(held, locs) if plan.pageable_bytes and locs else None
            store = make_store(
                spec, C, len(moe_idx), opts.dtype, opts.device, copy_retries,
                opts.expert_format, held=plan.num_held(),
            )  # fmt: skip
            cache = _quant_cache(path, ckpt, opts, moe_idx, store.expert_bytes[0])
            _load_experts(ckpt, store, spec, moe_idx, progress, opts.expert_format, cache, tiers)
        biases = None
        if spec.expert_bias:
            biases = _bias_tables(ckpt, spec, moe_idx, opts.device, blocks is not None)
        tokenizer = _tokenizer(path, ckpt if gguf else None)  # a GGUF's: from its metadata
    finally:
        ckpt.close()
    # CUDA's device step gathers from pinned rows only: pageable experts take the host step.
    mode = "host" if plan.pageable_bytes and opts.device.type == "cuda" else opts.decode
    runtime = install(model, spec, store, opts.policy, C, opts.compute, moe_idx, fmt, mode, biases)
    _check_all_loaded(model)
    om = OffloadedModel(model, runtime, tokenizer, str(path), restorer=restore)
    om.policy_source = opts.policy_source
    om.graphs = graphs
    om.host_budget = plan.budget
    om.threads, om.context_limit = n_threads, ctx
    if drafter is not None:
        om.set_speculative(drafter, block_k if block_k is not None else min(2 * spec.top_k, C))
    if where != "gpu":
        om.set_experts_on(where, hybrid_m)
    return om
