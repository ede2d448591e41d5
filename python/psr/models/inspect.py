"""`psr.inspect(path)`: what psr would do with a checkpoint, before loading it.

Reads config.json and builds the transformers model on the meta device (no weight is
read, no memory is taken): the family and its router and expert kinds, which layers are
sparse, the expert shapes, the bytes of one expert in each format, the host memory every
format needs and the device memory per residency, and whether decode graphs apply. For an
unsupported checkpoint, the one line that says which part psr lacks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import psr.vocab as vocab
import psr_kernels as pk
from psr.load_config import LoadConfig
from psr.models.families import (
    EXPERT_KINDS,
    FAMILIES,
    ROUTER_KINDS,
    check_config,
    moe_block,
    moe_spec,
)
from psr.models.rows import GROUP_SIZE

RESIDENCIES = (0.25, 0.5, 1.0)
FORMATS = vocab.EXPERT_FORMATS


@dataclass
class Inspection:
    """What `psr.inspect` found (`to_dict` for JSON, `table` for people)."""

    path: str
    model_type: str
    supported: bool
    missing: str | None = None  # for an unsupported checkpoint: what psr lacks
    family: str | None = None
    router_kind: str | None = None
    expert_kind: str | None = None
    dtype: str | None = None
    num_layers: int = 0
    sparse_layers: list[int] = field(default_factory=list)
    dense_layers: list[int] = field(default_factory=list)
    num_experts: int = 0
    top_k: int = 0
    hidden_size: int = 0
    ffn_size: int = 0
    shared_experts: bool = False
    attention: list[str] = field(default_factory=list)  # layer kinds, where the config says
    expert_bytes: dict[str, int] = field(default_factory=dict)  # one expert, per format
    host_bytes: dict[str, int] = field(default_factory=dict)  # every expert, per format
    dense_bytes: int = 0  # everything but the routed experts, in the model dtype
    device_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # format -> res
    graphs: str = ""
    expert_types: dict[str, int] = field(default_factory=dict)  # GGUF: row format -> layers
    kv_bytes_per_1k_tokens: int = 0  # the KV cache of 1024 tokens in the model dtype
    # its layers per attention kind (psr.runtime.kv.CACHE_KINDS: what each really caches)
    kv_kinds: dict[str, int] = field(default_factory=dict)
    # what psr.load(path, policy) uses at the default residency, per biased policy: the
    # tuned point and its file, or the untuned default and the command that measures it
    operating_points: dict[str, str] = field(default_factory=dict)
    # host_memory= (psr.models.tiers): the default budget on this machine for the file's
    # own format (None: every expert held), and what a budget does
    default_host_memory: int | None = None
    host_memory: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        if not self.supported:
            return f"{self.path}: {self.missing}"
        lines = [
            f"{self.path}: {self.family} ({self.dtype})",
            f"  router      {self.router_kind}: {ROUTER_KINDS[str(self.router_kind)]}",
            f"  experts    {self.expert_kind}: {EXPERT_KINDS[str(self.expert_kind)]}"
            + ("; shared experts on the device" if self.shared_experts else ""),
            f"  layers     {self.num_layers}: {len(self.sparse_layers)} sparse "
            f"{_ranges(self.sparse_layers)}, {len(self.dense_layers)} dense "
            f"{_ranges(self.dense_layers)}",
            f"  MoE        {self.num_experts} experts, top-{self.top_k}, hidden "
            f"{self.hidden_size}, expert FFN {self.ffn_size}",
        ]
        if self.attention:
            kinds = sorted(set(self.attention))
            lines.append(
                "  attention  " + ", ".join(f"{self.attention.count(k)} {k}" for k in kinds)
            )
        lines.append(f"  dense part {_size(self.dense_bytes)} on the device")
        for fmt, n in self.expert_types.items():
            shown = pk.RowFormat.parse(fmt).shown
            lines.append(f"  experts    {shown} (gate, up, down) in {n} layers")
        kinds = ", ".join(f"{n} {k}" for k, n in self.kv_kinds.items())
        lines.append(
            f"  KV cache   {_size(self.kv_bytes_per_1k_tokens)} per 1024 tokens"
            + (f" ({kinds} layers)" if kinds else "")
        )
        cols = ["format", "one expert", "host (all experts)"]
        cols += [f"device @ residency {r:g}" for r in RESIDENCIES]
        rows = [
            [fmt, _size(self.expert_bytes[fmt]), _size(self.host_bytes[fmt])]
            + [_size(self.device_bytes[fmt][f"{r:g}"]) for r in RESIDENCIES]
            for fmt in self.expert_bytes
        ]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        for r in [cols, *rows]:
            lines.append("  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
        lines.append("  (device: the dense part + the expert slab; the KV cache comes on top)")
        lines.append(f"  graphs     {self.graphs}")
        if self.host_memory:
            lines.append(f"  host mem   {self.host_memory}")
        for name, point in self.operating_points.items():
            lines.append(f"  {name:<11} {point}")
        return "\n".join(lines)


def _size(n: int) -> str:
    """Bytes in the unit that reads best (KiB to TiB)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> "[0-2, 5]"."""
    out, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return "[" + ", ".join(out) + "]"


def _expert_bytes(fmt: str, dtype: torch.dtype, H: int, F: int) -> int:
    return pk.RowFormat.parse(fmt).row_bytes(H, F, GROUP_SIZE, dtype.itemsize)


def _graphs(config: Any) -> str:
    try:
        from transformers import StaticCache

        StaticCache(config=config, max_cache_len=16)
    except Exception as e:  # a cache transformers cannot make static: eager decode
        return f"off: no static KV cache for this model ({type(e).__name__}: {e})"
    return "on for CUDA (graphs='auto'): one replay per decode token over a static cache"


def inspect(path: str | Path) -> Inspection:
    """What psr would load from `path` (a checkpoint folder or a GGUF file; no weight is
    read)."""
    from psr.models.gguf_load import is_gguf, open_gguf

    if not is_gguf(path):
        return _inspect(path, None)
    ck = open_gguf(path)  # its header is read once, here (metadata and tensor table)
    try:
        return _inspect(path, ck)
    finally:
        ck.close()


def _inspect(path: str | Path, ck: Any) -> Inspection:
    """`inspect` of a checkpoint folder (`ck` None) or of the opened GGUF checkpoint `ck`."""
    import transformers

    from psr.models.gguf_load import layer_formats
    from psr.models.sources import model_config
    from psr.runtime.kv import CACHE_KINDS, kv_bytes, layer_kinds

    gguf = ck is not None
    raw = dict(ck.config_dict) if gguf else model_config(path)
    mt = str(raw.get("model_type"))
    try:
        cls = transformers.CONFIG_MAPPING[mt] if mt in FAMILIES else None
        where = f"{path} (its GGUF metadata)" if gguf else f"{path}/config.json"
        check_config(raw, getattr(cls, "attribute_map", None), where)
    except ValueError as e:
        return Inspection(str(path), mt, supported=False, missing=str(e))
    if gguf:
        config = transformers.AutoConfig.for_model(**raw)
    else:
        config = transformers.AutoConfig.from_pretrained(str(path))
        config.__dict__.pop("quantization_config", None)  # built plain, as psr.load does
    spec = moe_spec(config)
    fam = FAMILIES[mt]
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = dt if isinstance(dt, torch.dtype) else getattr(torch, str(dt or "float32"), None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = model.model.layers
    blocks = [moe_block(layer, fam) for layer in layers]
    sparse = [i for i, b in enumerate(blocks) if b is not None]
    expert_ids = {id(p) for b in blocks if b is not None for p in b.experts.parameters()}
    dense = sum(p.numel() * p.dtype.itemsize for p in model.parameters() if id(p) not in expert_ids)
    H, F, E = spec.hidden_size, spec.ffn_size, spec.num_experts
    n = len(sparse)
    types: dict[str, int] = {}
    if gguf:  # the file's own blocks: one format per layer
        fmts = layer_formats(ck, spec, sparse)  # checked as psr.load checks them
        rows = [pk.GGMLLayout.of(f, H, F).nbytes for f in fmts]
        types = {f.name: fmts.count(f) for f in dict.fromkeys(fmts)}
        per = {"gguf": round(sum(rows) / len(rows))}
        host = {"gguf": sum(rows) * E}
        device = {
            "gguf": {f"{r:g}": dense + sum(rows) * math.floor(r * E + 0.5) for r in RESIDENCIES}
        }
    else:
        per = {fmt: _expert_bytes(fmt, dtype, H, F) for fmt in FORMATS}
        host = {fmt: per[fmt] * E * n for fmt in FORMATS}
        device = {
            fmt: {f"{r:g}": dense + n * math.floor(r * E + 0.5) * per[fmt] for r in RESIDENCIES}
            for fmt in FORMATS
        }
    fmt0 = next(iter(per))  # the file's own rows: what can stay in it (pageable)
    budget, note = _host_memory(dense, host[fmt0], per[fmt0] * n * _slots(E), fmt0)
    shared = any(
        hasattr(b, name)
        for b in blocks
        if b is not None
        for name in ("shared_expert", "shared_experts", "shared_mlp")
    )
    return Inspection(
        path=str(path),
        model_type=mt,
        supported=True,
        family=fam.model_type,
        router_kind=fam.router_kind,
        expert_kind=fam.expert_kind,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=len(layers),
        sparse_layers=sparse,
        dense_layers=[i for i, b in enumerate(blocks) if b is None],
        num_experts=E,
        top_k=spec.top_k,
        hidden_size=H,
        ffn_size=F,
        shared_experts=shared,
        attention=list(getattr(config, "layer_types", None) or []),
        expert_bytes=per,
        host_bytes=host,
        expert_types=types,
        kv_bytes_per_1k_tokens=kv_bytes(config, dtype.itemsize, 1024),
        kv_kinds={k: n for k in CACHE_KINDS if (n := layer_kinds(config).count(k))},
        dense_bytes=dense,
        device_bytes=device,
        graphs=_graphs(config),
        operating_points=_operating_points(path),
        default_host_memory=budget,
        host_memory=note,
    )


def _slots(E: int) -> int:
    """Slots per layer at psr.load's default residency."""
    residency = LoadConfig().residency
    assert residency is not None  # the default is a fraction, not slots
    return math.floor(residency * E + 0.5)


def _host_memory(dense: int, rows: int, slab: int, fmt: str) -> tuple[int | None, str]:
    """The default host_memory on this machine (CPU backend: the dense part and the slab at
    the default residency count against it) and a line saying what a budget means."""
    from psr.models.tiers import SAFE_FRACTION, default_budget, fmt_bytes, meminfo

    budget = default_budget(dense + slab, rows)
    avail = meminfo().get("MemAvailable", 0)
    head = (
        f"default: every expert held ({fmt_bytes(dense + slab + rows)} with the dense part "
        f"and slab, within {SAFE_FRACTION:.0%} of MemAvailable {fmt_bytes(avail)})"
        if budget is None
        else f"default: {fmt_bytes(budget)} ({SAFE_FRACTION:.0%} of MemAvailable): "
        f"{fmt_bytes(max(budget - dense - slab, 0))} of the {fmt_bytes(rows)} of {fmt} "
        "experts held, the rest read from the file"
    )
    return budget, (
        f"{head}; host_memory=SIZE holds experts up to SIZE (CPU: minus the dense part and "
        "the slab) and leaves the rest pageable in the checkpoint file (its own dtype or "
        "GGUF blocks only)"
    )


def _operating_points(path: str | Path) -> dict[str, str]:
    """Per biased policy, the point `psr.load(path, policy)` takes at the default
    residency, and where it comes from."""
    from psr.points import tune_command, tuned_points
    from psr.policy import DEFAULT_RESIDENCY, make_policy

    try:
        found = tuned_points(path, DEFAULT_RESIDENCY)
    except ValueError as e:  # a corrupt file, or one tuned for another checkpoint
        return {"points": str(e)}
    out = {}
    for fam in ("cache-prior", "psr"):
        if fam in found:
            pol, file = found[fam]
            out[fam] = f"{pol.describe()}: tuned ({file})"
        else:
            cmd = tune_command(path, DEFAULT_RESIDENCY)
            out[fam] = f"{make_policy(fam).describe()}: untuned default (measure it: {cmd})"
    return out
