"""A `LoadConfig` resolved against the checkpoint it loads: the checkpoint opened and its
config checked, then what depends on it (the MoE spec, slots per layer, the tuned
operating point, dtype, device, the quantized-expert cache), every error in the order a
user meets them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import psr.vocab as vocab
import psr_kernels as pk
from psr.load_config import LoadConfig
from psr.models import prequant
from psr.models.checkpoint import Checkpoint, CheckpointError, read_config
from psr.models.families import SUPPORTED, check_config, moe_spec
from psr.models.gguf_load import is_gguf, open_gguf
from psr.models.quant_cache import resolve_root
from psr.points import resolve_policy
from psr.policy import Policy
from psr.runtime.spec import MoESpec, resolve_capacity, resolve_slab_slots
from psr.store import current_backend

# The torch dtypes psr computes in (psr.vocab names them; aliases resolve to these).
_TORCH_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in vocab.DTYPE_NAMES)


@dataclass(frozen=True)
class Resolved:
    """A load's options (`cfg`) with what the checkpoint decides, every one checked."""

    cfg: LoadConfig
    config: Any  # the checkpoint's transformers config
    spec: MoESpec
    policy: Policy
    policy_source: str  # "tuned (<file>)", "untuned default", "given" (psr.points.resolve_policy)
    capacity: int  # expert slots per layer, before a drafter takes its share
    dtype: torch.dtype
    device: torch.device
    cache_root: Path | None  # the quantized-expert cache folder, or None: no cache
    gguf: bool  # a GGUF file
    prequant: str | None = None  # the checkpoint's own quantization (psr.models.prequant)
    row_format: pk.RowFormat = pk.NATIVE  # the asked `expert_format`, parsed

    @property
    def blocks(self) -> bool:
        """Experts stay in the file's blocks (GGUF, pre-quantized)."""
        return self.gguf or self.prequant is not None


def open_checkpoint(path: str | Path) -> Any:
    """The checkpoint at `path` (a GGUF file or a safetensors folder), its config checked."""
    if is_gguf(path):
        ckpt = open_gguf(path)
        check_checkpoint_config(path, ckpt.config_dict)
        return ckpt
    check_checkpoint_config(path)
    return Checkpoint(path)


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


def resolve_device(device: str | torch.device | None) -> torch.device:
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


def check_checkpoint_config(path: str | Path, raw: dict[str, Any] | None = None) -> None:
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


def _hf_config(path: str | Path, ckpt: Any, gguf: bool) -> tuple[Any, str | None]:
    """The transformers config and the checkpoint's pre-quantization (GGUF: its own)."""
    import transformers

    if gguf:
        return ckpt.config, None
    config = transformers.AutoConfig.from_pretrained(str(path))
    method = prequant.quant_method(ckpt.config_dict, str(path))
    if method is not None:
        # psr dequantizes dense weights itself and keeps experts in their blocks: the model
        # is built plain (transformers would swap in its own quantized modules).
        del config.quantization_config
    return config, method


def resolve(path: str | Path, ckpt: Any, cfg: LoadConfig) -> Resolved:
    """Check and resolve `cfg` against the checkpoint, in the order errors are reported."""
    gguf = is_gguf(path)
    config, method = _hf_config(path, ckpt, gguf)
    spec = moe_spec(config)
    on = cfg.placement[0]  # cpu / hybrid take a slab smaller than top_k
    rho = cfg.slot_residency
    C = resolve_capacity(spec, cfg.make_policy(), rho, cfg.slots, experts_on=on)
    resolve_slab_slots(spec, C, cfg.batch_slots)
    # cache-prior / psr without lam and n: the model's tuned operating point, if any (once
    # the memory plan has chosen the slots: psr.load resolves again at them).
    pol, pol_source = (
        (cfg.make_policy(), "planned")
        if cfg.plans_slots
        else resolve_policy(
            cfg.policy,
            cfg.lam,
            cfg.n,
            model_dir=path,
            residency=C / spec.num_experts,
            quality_budget=cfg.quality_budget,
        )
    )
    resolve_capacity(spec, pol, rho, cfg.slots, experts_on=on)  # the tuned n too
    dt = resolve_dtype(cfg.dtype, _config_dtype(config))
    dev = resolve_device(cfg.device)
    fmt, quant_cache = pk.RowFormat.parse(cfg.store_format), cfg.quant_cache
    if (gguf or method) and (fmt is not pk.NATIVE or quant_cache not in (None, False)):
        what = "a GGUF file's" if gguf else f"this {method} checkpoint's"
        raise ValueError(
            f"{path}: {what} experts stay in their own blocks (the types the file has); "
            f"expert_format must be 'native' (got {cfg.expert_format!r}) and quant_cache off"
        )
    if (gguf or method) and cfg.dense_format in vocab.QUANT_FORMATS:
        what = "a GGUF file's" if gguf else f"this {method} checkpoint's"
        raise ValueError(
            f"{path}: {what} dense weights are stored quantized already; dense_format="
            f"{cfg.dense_format!r} quantizes a float checkpoint's (use 'native' or 'float')"
        )
    cache_root = resolve_root(quant_cache, path)
    if cache_root is not None and not fmt.is_quant:
        raise ValueError(
            f"quant_cache keeps quantized experts; expert_format={cfg.expert_format!r} is not "
            f"quantized (choose one of {', '.join(vocab.QUANT_FORMATS)})"
        )
    return Resolved(cfg, config, spec, pol, pol_source, C, dt, dev, cache_root, gguf, method, fmt)
