"""`psr.load` (a checkpoint folder or a GGUF file), `psr.offload` (a built transformers
model) and `psr.restore` (back to the plain transformers model).

    model = psr.load("path/to/checkpoint", policy="psr", residency=0.5, lam=0.2, n=1)
    psr.offload(hf_model, policy="psr", residency=0.5)   # swap MoE blocks in place
    psr.restore(hf_model)                                # and back

Their options are `psr.LoadConfig`'s fields. The model's routers and experts modules are
replaced by psr modules; attention, norms, KV cache and generation stay transformers' own.
Expert rows come from one pipeline (psr.models.rows) whatever the source: a safetensors
checkpoint's matrices (memory-mapped), a GGUF or pre-quantized checkpoint's blocks, or a
built model's experts; everything else goes to the device.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import psr.vocab as vocab
import psr_kernels as pk  # tests count quantize_expert calls through it
from psr.load_config import LoadConfig
from psr.machine import resolve_threads
from psr.models.checkpoint import CheckpointError
from psr.models.dense_weights import keep_blocks, quantize_dense
from psr.models.families import (
    disk_names,
    expert_parts,
    module_bias_table,
    moe_spec,
    router_weight,
)
from psr.models.gguf_load import gguf_source
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
from psr.models.prequant import prequant_source
from psr.models.quant_cache import QuantCache
from psr.models.resolve import Resolved, open_checkpoint, resolve
from psr.models.rows import (
    GROUP_SIZE,
    RowSource,
    fill_cached,
    fill_store,
    make_store,
    matrix_source,
    tiled_source,
)
from psr.models.safetensors_experts import bias_tables, module_reader, on_device, safetensors_source
from psr.models.sources import TOKENIZER_FILES
from psr.models.tiers import TierPlan, default_budget, load_profile, plan_tiers
from psr.policy import DEFAULT_POLICY, Policy
from psr.runtime.chunked import DEFAULT_PREFILL_CHUNK
from psr.runtime.expert_placement import placement_class
from psr.runtime.kv import check_kv_format
from psr.runtime.kv_quant import set_kv_format
from psr.runtime.model import OffloadedModel, rows_forward
from psr.runtime.norms import row_norms
from psr.runtime.spec import resolve_capacity, resolve_slab_slots
from psr.runtime.verify import verify_class
from psr.store import set_cpu_dot
from psr.store.cpu_kernels import cpu_tiles_on

# Whether a load makes the CPU forward row-invariant wherever it can be (unless graphs are
# asked for). Off: it decodes at 0.90-0.95x and prefills long prompts at ~0.8x of the
# chunked forward (bench/results/prefill/); `psr serve` turns it on for its prompt cache,
# `model.set_row_invariant()` anywhere.
ROW_INVARIANT_DEFAULT = False


@torch.no_grad()
def load(
    path: str | Path,
    policy: str | Policy = DEFAULT_POLICY,
    residency: float | None = None,
    **options: Any,
) -> OffloadedModel:
    """Load a checkpoint with its experts offloaded to a psr store: a local folder, a GGUF
    file, or a Hugging Face repo id (`org/name`, `org/name:FILE.gguf`) from the local Hub
    cache (never downloaded; psr.models.names). `policy`, `residency` and `options`:
    `psr.LoadConfig`'s fields (its docstring says what each does); an unknown keyword is a
    TypeError."""
    cfg = LoadConfig.of("load", policy=policy, residency=residency, **options)
    path = resolve_model(path)
    threads = _set_threads(cfg.threads)  # before the experts are read and quantized
    set_cpu_dot(cfg.cpu_dot)
    ckpt = open_checkpoint(path)
    try:
        r = resolve(path, ckpt, cfg)
        context = _context(cfg.context, r.config)
        if cfg.kv_format != "fit":  # "fit": the plan tries only the formats every kind takes
            check_kv_format(r.config, cfg.kv_format)  # a kind without it: before any weight
        spec, E = r.spec, r.spec.num_experts
        meta = _meta_model(r)
        moe_idx = meta[1]
        _check_speculative(path, r)
        mtp = _plan_mtp(path, ckpt, r, meta[0])  # its tensors checked before any is read
        source = _row_source(path, ckpt, r, moe_idx)  # every expert tensor checked first
        r = _planned(path, ckpt, r, meta[0], source)  # gpu_memory: before any weight is copied
        cfg = r.cfg  # the plan's slots and kv_format ("fit")
        model = _build_model(ckpt, r, meta)
        drafter, C = _load_drafter(path, r, model, source, mtp)
        # batches' slots: C each
        slab = resolve_slab_slots(spec, C, cfg.batch_slab(C, E, r.device.type == "cuda"))
        plan = _tier_plan(r, model, slab, source.row_bytes, source.why_not)
        source = _cpu_tiles(source, r, plan)
        store = make_store(source, E, slab, r.device, cfg.copy_retries, plan.num_held())
        cache = _quant_cache(path, ckpt, r, moe_idx, source)
        fill_cached(store, source, E, cfg.show_progress, source.tiers(plan), cache)
        biases = bias_tables(ckpt, spec, moe_idx, r.device, r.blocks) if spec.expert_bias else None
        tokenizer = _tokenizer(path, ckpt if r.gguf else None)  # a GGUF's: from its metadata
    finally:
        ckpt.close()
    # CUDA's device step gathers from pinned rows only: pageable experts take the host step.
    mode = "host" if plan.pageable_bytes and r.device.type == "cuda" else cfg.decode
    runtime = install(
        model, spec, store, r.policy, C, cfg.compute, moe_idx, source.formats, mode, biases
    )
    _check_all_loaded(model)
    om = OffloadedModel(model, runtime, tokenizer, str(path), restorer=restore)
    om.policy_source, om.host_budget = r.policy_source, plan.budget
    om.threads, om.context_limit = threads, context
    _place(om, cfg)
    if drafter is not None:  # after the placement: verify='cpu' takes experts_on's caps
        om.set_speculative(drafter, cfg.block_k, cfg.verify)
    return om


@torch.no_grad()
def offload(
    hf_model: nn.Module,
    policy: str | Policy = DEFAULT_POLICY,
    residency: float | None = None,
    **options: Any,
) -> OffloadedModel:
    """Move an already-built transformers MoE model's experts into a psr store, in place.

    The model's router and experts modules are swapped for psr's; `hf_model.generate`
    and other transformers tooling keep working (batch 1), and `save_pretrained` writes
    the experts under their original names. The experts' weights move into the store:
    the replaced experts module is kept with its parameters on the meta device (no
    memory), and `psr.restore` rebuilds it from the store. Returns an OffloadedModel
    wrapping the same model (for `.stats`, `.generate`, ...). `options`: the fields of
    `psr.LoadConfig` marked for offload (as `load`).
    """
    cfg = LoadConfig.of("offload", policy=policy, residency=residency, **options)
    if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
        raise TypeError(
            f"psr.offload needs a transformers causal LM (an nn.Module with .config), "
            f"got {type(hf_model).__name__}"
        )
    if hasattr(hf_model, "psr_runtime"):
        raise RuntimeError(f"{type(hf_model).__name__} is already offloaded by psr")
    spec = moe_spec(hf_model.config)
    check_kv_format(hf_model.config, cfg.kv_format)
    pol = cfg.make_policy()
    C = resolve_capacity(spec, pol, cfg.slot_residency, cfg.slots, experts_on=cfg.placement[0])
    moe_idx, fam = moe_layer_indices(hf_model), model_family(hf_model)
    modules = [block_of(hf_model, d).get_submodule("experts") for d in moe_idx]
    dtype = expert_parts(modules[0], 0, fam)[0].dtype
    if not dtype.is_floating_point:
        raise TypeError(f"expert weights must be floating point, got {dtype}")
    device = router_weight(getattr(block_of(hf_model, moe_idx[0]), fam.router), fam).device
    fmt = pk.RowFormat.parse(cfg.store_format)
    readers = [module_reader(m, fam) for m in modules]
    source = matrix_source(readers, spec, dtype, fmt, fmt.name)
    cuda = torch.device(device).type == "cuda"
    # batches' slots: C each
    slab = resolve_slab_slots(spec, C, cfg.batch_slab(C, spec.num_experts, cuda))
    store = make_store(source, spec.num_experts, slab, device, cfg.copy_retries)
    fill_store(store, source, spec.num_experts, cfg.show_progress)
    biases = None
    if spec.expert_bias:
        biases = on_device(device, [module_bias_table(m) for m in modules])
    runtime = install(
        hf_model, spec, store, pol, C, cfg.compute, moe_idx, source.formats, cfg.decode, biases
    )
    return _place(OffloadedModel(hf_model, runtime, restorer=restore), cfg)


def _set_threads(threads: int | None) -> int:
    """Resolve `threads` (psr.machine.resolve_threads) and give torch's intra-op pool that
    many; psr's CPU expert kernels run on torch.get_num_threads() threads."""
    n = resolve_threads(threads)
    torch.set_num_threads(n)
    return n


def _context(context: int | None, config: Any) -> int | None:
    """`context` checked against the checkpoint's max_position_embeddings (None: that)."""
    trained = getattr(config, "max_position_embeddings", None)
    if context is not None and trained is not None and context > int(trained):
        raise ValueError(
            f"context={context} exceeds the model's context of {trained} tokens "
            "(max_position_embeddings)"
        )
    return context


def _place(om: OffloadedModel, cfg: LoadConfig) -> OffloadedModel:
    """The options that apply to the built model: decode graphs, the KV format, the CPU
    RMS norms, where misses are computed, the row-invariant CPU forward
    (ROW_INVARIANT_DEFAULT)."""
    om.graphs = cfg.graphs
    set_kv_format(om.hf, cfg.kv_format, om.context)
    if om.device.type == "cpu":  # RMS norms by psr's row kernel (runtime/norms.py)
        row_norms(om.hf)
    rows = ROW_INVARIANT_DEFAULT and cfg.graphs is not True
    if rows and om.row_invariant_blocker() is None:
        om.set_row_invariant(True)
    if cfg.prefill_chunk is not None:
        om.set_prefill_chunk(cfg.prefill_chunk)
    where, hybrid_m = cfg.placement
    if placement_class(where).capped:  # else the default: every miss copied
        om.set_experts_on(where, hybrid_m)
    if om.runtime.store.backend == "cuda":  # prefill's CPU-vs-copy split from the profile
        om.set_prefill_split()
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
    rows_forward(hf, False)
    row_norms(hf, False)
    uninstall(hf)
    return hf


def _meta_model(r: Resolved) -> tuple[nn.Module, list[int]]:
    """The transformers model built on the meta device (no memory), and its MoE layers."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(r.config, dtype=r.dtype)
    model.eval()
    return model, moe_layer_indices(model)


def _build_model(ckpt: Any, r: Resolved, meta: tuple[nn.Module, list[int]]) -> nn.Module:
    """The meta model `meta` (`_meta_model`) with every tensor but the MoE experts read from
    the checkpoint onto the compute device; and its MoE layers' indices."""
    dt, dev = r.dtype, r.device
    model: Any = meta[0]  # transformers' model class (untyped)
    moe_idx = meta[1]
    block = model_family(model).block
    expert_prefixes = tuple(f"model.layers.{d}.{block}.experts." for d in moe_idx)
    state_names = [k for k in model.state_dict() if not k.startswith(expert_prefixes)]
    tied = bool(getattr(r.config, "tie_word_embeddings", False))
    kept: set[str] = set()  # dense_format native: a GGUF file's dense matrices stay in their blocks
    if r.gguf and r.cfg.dense_format == "native":
        kept = keep_blocks(model, ckpt, state_names, dt, dev, r.cfg.compute, tied)
    for name in (n for n in state_names if n not in kept):
        src = next((c for c in disk_names(r.spec.family, name) if c in ckpt), None)
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
    if tied and "lm_head.weight" not in kept:
        model.lm_head.weight = model.get_input_embeddings().weight
    if r.cfg.dense_format in vocab.QUANT_FORMATS:  # a float checkpoint's, quantized now
        quantize_dense(model, r.cfg.dense_format, moe_idx, r.cfg.compute)
    materialize_rotary(model, dev)
    built: nn.Module = model
    return built


def _row_source(path: str | Path, ckpt: Any, r: Resolved, moe_idx: list[int]) -> RowSource:
    """Where this checkpoint's expert rows come from: a GGUF file's or a pre-quantized
    checkpoint's blocks, or a float checkpoint's matrices (in `r.dtype` or the asked format)."""
    if r.gguf:
        if r.cfg.speculative in ("block", "ar"):
            raise ValueError(
                f"{path}: speculative decoding reads psr's drafter files beside a "
                "safetensors checkpoint; a GGUF file has none"
            )
        return gguf_source(ckpt, r.spec, moe_idx)
    if r.prequant is not None:
        return prequant_source(r.prequant, ckpt, r.spec, moe_idx)
    return safetensors_source(ckpt, r.spec, moe_idx, r.dtype, r.row_format)


def _planned(
    path: str | Path, ckpt: Any, r: Resolved, meta: nn.Module, source: RowSource
) -> Resolved:
    """With `gpu_memory`: the memory plan's check (MemoryPlanError, naming the part over and
    by how much) and, when neither `residency` nor `slots` is given, `r` resolved again at
    the plan's slots. The dense part as `dense_format` keeps it (int8 / fp8 counted as
    float, on the safe side)."""
    from psr.models.inspect import gguf_dense_bytes, meta_dense_bytes
    from psr.models.memory_plan import Budget, ModelMemory, plan_memory

    cfg = r.cfg
    if cfg.gpu_memory is None:
        return r
    dense = meta_dense_bytes(meta)
    native = gguf_dense_bytes(ckpt)["native"] if r.gguf else dense
    rows, E = source.row_bytes, r.spec.num_experts
    facts = ModelMemory(
        r.config, {"native": native, "float": dense}, rows, E, r.spec.top_k,
        r.dtype.itemsize, source.why_not,
    )  # fmt: skip
    host = cfg.host_memory
    cuda = r.device.type == "cuda"
    batch = cfg.batch_slab(r.capacity, E, cuda)
    budget = Budget(
        gpu_memory=vocab.parse_bytes(cfg.gpu_memory, "gpu_memory"),
        host_memory=None if host in (None, "unlimited") else vocab.parse_bytes(host),
        context=_context(cfg.context, r.config),
        experts_on=cfg.experts_on,
        # int8 / fp8 (a float checkpoint's dense part quantized at load) counted as float:
        # the plan errs on the safe side there.
        dense_format="native" if cfg.dense_format == "native" else "float",
        kv_format=cfg.kv_format,
        kv_fit=("auto",) if cfg.graphs is True else vocab.KV_FIT_ORDER,  # graphs: no packed KV
        slots=None if cfg.plans_slots else resolve_slab_slots(r.spec, r.capacity, batch),
        prefill_chunk=cfg.prefill_chunk or DEFAULT_PREFILL_CHUNK,
        cuda=cuda,
    )
    plan = plan_memory(facts, budget).check(f"{path} with gpu_memory={cfg.gpu_memory!r}")
    if cfg.kv_format == "fit":  # the plan's pick, for the rest of the load
        cfg = cfg.replace(kv_format=plan.kv_format)
        r = replace(r, cfg=cfg)
    return resolve(path, ckpt, cfg.replace(slots=plan.slots)) if cfg.plans_slots else r


def _check_speculative(path: str | Path, r: Resolved) -> None:
    """Speculative decoding cuts the KV cache back after each verify block: refused, before
    any weight is read, for layers whose recurrent state transformers cannot cut back."""
    from psr.runtime.kv import layer_kinds

    if r.cfg.speculative is not None and "linear_attention" in layer_kinds(r.config):
        raise ValueError(
            f"{path}: speculative decoding cuts the KV cache back after each verify block, "
            f"and {r.config.model_type}'s linear-attention layers keep a recurrent state "
            "transformers cannot cut back"
        )


def _plan_mtp(path: str | Path, ckpt: Any, r: Resolved, meta_model: nn.Module) -> Any:
    """With speculative='mtp', before any weight is read: `block` checked against the
    head's depth, and without a psr head beside the checkpoint its own MTP layer, every
    tensor checked present (psr.models.mtp.plan_mtp); else None."""
    from psr.models.mtp import CHECKPOINT_MAX_DRAFT, PSR_FILE, check_block, plan_mtp, psr_head_depth

    if r.cfg.speculative != "mtp":
        return None
    own = Path(path) / PSR_FILE
    check_block(r.cfg.block, psr_head_depth(own) if own.is_file() else CHECKPOINT_MAX_DRAFT)
    return None if own.is_file() else plan_mtp(ckpt, meta_model)


def _load_drafter(
    path: str | Path, r: Resolved, model: nn.Module, source: RowSource, mtp: Any
) -> tuple[Any, int]:
    """The checkpoint's resident drafter (None without `speculative`), and the expert slots
    per layer left beside it (its memory comes out of the slots: whole slots, in every
    MoE layer)."""
    kind, C = r.cfg.speculative, r.capacity
    if kind is None:
        return None, C
    from psr.models.drafters import load_drafter

    drafter = load_drafter(path, kind, r.cfg.block, model, r.device, r.dtype, mtp)
    lost = -(-drafter.memory_bytes // sum(source.row_bytes))  # ceil: whole slots
    # experts_on cpu / hybrid run with fewer slots than top_k (down to none).
    least = 0 if placement_class(r.cfg.placement[0]).capped else r.spec.top_k
    if C - lost < least:
        raise ValueError(
            f"the {kind} drafter ({drafter.memory_bytes / 2**20:.1f} MiB) takes "
            f"{lost} of the {C} expert slots per layer, leaving fewer than {least}: raise "
            "the residency"
        )
    return drafter, C - lost


def _cpu_tiles(source: RowSource, r: Resolved, plan: TierPlan) -> RowSource:
    """The expert rows in the CPU kernels' tiles (rows.tiled_source) where only they read
    them and their kernel runs: the CPU backend on the torch compute path (the CPU kernels)
    with an integer dot (the fp32 dot untiles a tile at every call), every row held (a
    pageable row is read from the file as it is), tiles on (PSR_CPU_TILES), no quantized-
    expert cache (its rows are the untiled format's)."""
    if (
        r.device.type != "cpu"
        or pk.resolve_compute(r.cfg.compute, r.device) != "torch"
        or r.cfg.cpu_dot == "f32"
        or plan.pageable_bytes
        or r.cache_root is not None
        or not cpu_tiles_on()
    ):
        return source
    return tiled_source(source, r.spec)


def _quant_cache(
    path: str | Path, ckpt: Any, r: Resolved, moe_idx: list[int], source: RowSource
) -> QuantCache | None:
    """The quantized-expert cache of this checkpoint, format and shape, if one was asked for."""
    fmt = r.row_format
    if r.cache_root is None or not fmt.is_quant:  # a cache implies a quantized format: checked
        return None
    index = "model.safetensors.index.json"
    files = ckpt.files + ([index] if (Path(path) / index).is_file() else [])
    spec = r.spec
    shape = {"num_experts": spec.num_experts, "hidden": spec.hidden_size, "ffn": spec.ffn_size}
    return QuantCache(
        r.cache_root, path, files, fmt.name, GROUP_SIZE, shape, moe_idx, source.row_bytes[0]
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
    r: Resolved, model: nn.Module, slab_slots: int, row_bytes: list[int], why_not: str | None
) -> TierPlan:
    """The held experts under `host_memory` (None: the default, `tiers.default_budget`;
    'unlimited': all). On the CPU backend the dense weights and the slab count against it."""
    host_memory, E = r.cfg.host_memory, r.spec.num_experts
    cuda = r.device.type == "cuda"
    fixed = 0 if cuda else dense_bytes(model) + slab_slots * sum(row_bytes)
    if host_memory is None:
        budget = default_budget(fixed, E * sum(row_bytes))
    elif host_memory == "unlimited":
        budget = None
    else:
        budget = vocab.parse_bytes(host_memory)
    profile = None
    if r.cfg.host_profile is not None:
        profile = load_profile(r.cfg.host_profile, (len(row_bytes), E))
    plan = plan_tiers(budget, fixed, row_bytes, E, why_not, profile, cuda)
    where = r.cfg.placement[0]
    what = f"experts_on={where!r}" if placement_class(where).capped else None
    if r.cfg.speculative is not None and verify_class(r.cfg.verify).reads_host_rows:
        what = what or f"verify={r.cfg.verify!r}"
    if plan.pageable_bytes and what is not None:
        raise ValueError(
            f"{what} computes misses from the host rows in place, but "
            f"host_memory leaves {plan.pageable_bytes / 2**30:.2f} GiB of experts in the "
            "checkpoint file: use experts_on='gpu', or a budget that holds every expert"
        )
    return plan


def _check_all_loaded(model: nn.Module) -> None:
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"tensors not loaded: {leftover[:5]}")


def _tokenizer(path: str | Path, ckpt: Any = None) -> Any:
    """The folder's tokenizer (a GGUF file's, from its metadata), or None when it ships
    none."""
    if ckpt is not None:  # GGUF: when its metadata has one
        return ckpt.tokenizer() if ckpt.metadata("tokenizer.ggml.model") else None
    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path))
