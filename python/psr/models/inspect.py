"""`psr.inspect(path)`: what psr would do with a checkpoint, before loading it.

A checkpoint folder: reads config.json and builds the transformers model on the meta
device (no weight is read, no memory is taken). A GGUF file: reads its header (metadata
and tensor table, over a read-only map) and nothing else, without importing torch or
transformers (`psr inspect` of a 400 GB file in a second). Either way it says the family
and its router and expert kinds, which layers are sparse, the expert shapes, the bytes of
one expert in each format, the host memory every format needs and the device memory per
residency, and whether decode graphs apply. For an
unsupported checkpoint, the one line that says which part psr lacks.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import psr.vocab as vocab
from psr.load_config import LoadConfig
from psr.models.families import (
    EXPERT_KINDS,
    FAMILIES,
    MTP_SCHEMES,
    ROUTER_KINDS,
    check_config,
    moe_sizes,
)
from psr.models.formats import rowformat
from psr.models.memory_plan import Budget, MemoryPlan, ModelMemory, plan_memory

if TYPE_CHECKING:
    import torch

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
    dense_bytes_native: int = 0  # the same in the file's own types (GGUF blocks)
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
    plan: MemoryPlan | None = None  # with a Budget: the memory plan (psr.models.memory_plan)
    # what the plan reads (more plans: memory_plan.plan_memory(found.memory, budget))
    memory: ModelMemory | None = field(default=None, repr=False)
    mtp: str = ""  # its multi-token-prediction head, if any (speculative='mtp')

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, plan=None, memory=None))
        del out["memory"]
        return out | {"plan": self.plan.to_dict() if self.plan else None}

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
        native = (
            f" ({_size(self.dense_bytes_native)} in the file's own types)"
            if self.dense_bytes_native != self.dense_bytes
            else ""
        )
        lines.append(f"  dense part {_size(self.dense_bytes)} on the device{native}")
        for fmt, n in self.expert_types.items():
            shown = rowformat().RowFormat.parse(fmt).shown
            lines.append(f"  experts    {shown} (gate, up, down) in {n} layers")
        kv = ", ".join(f"{n} {k}" for k, n in self.kv_kinds.items())
        lines.append(
            f"  KV cache   {_size(self.kv_bytes_per_1k_tokens)} per 1024 tokens"
            + (f" ({kv} layers)" if kv else "")
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
        if self.mtp:
            lines.append(f"  MTP head   {self.mtp}")
        if self.plan is not None:
            lines.append(self.plan.table())
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
    from psr.models.rows import GROUP_SIZE

    return int(rowformat().RowFormat.parse(fmt).row_bytes(H, F, GROUP_SIZE, dtype.itemsize))


GRAPHS_ON = "on for CUDA (graphs='auto'): one replay per decode token over a static cache"


def _graphs(config: Any) -> str:
    try:
        from transformers import StaticCache

        StaticCache(config=config, max_cache_len=16)
    except Exception as e:  # a cache transformers cannot make static: eager decode
        return f"off: no static KV cache for this model ({type(e).__name__}: {e})"
    return GRAPHS_ON


def inspect(path: str | Path, budget: Budget | None = None) -> Inspection:
    """What psr would load from `path` (a checkpoint folder or a GGUF file; no weight is
    read), and with a `budget` the memory plan under it (`Inspection.plan`)."""
    from psr.models.files import is_gguf

    if not is_gguf(path):
        return _inspect_folder(path, budget)
    from psr.models.gguf import GGUFCheckpoint

    ck = GGUFCheckpoint(path)  # its header is read once, here (metadata and tensor table)
    try:
        return _inspect_gguf(path, ck, budget=budget)
    finally:
        ck.close()


@dataclass
class _Model:
    """What both paths find before the bytes per format: the facts of the model."""

    num_layers: int
    sparse: list[int]
    dense: int  # bytes of everything but the routed experts, in the model dtype
    shared: bool
    itemsize: int
    dtype: str
    dense_native: int = -1  # the same in the file's own types (-1: as `dense`)


def _unsupported(
    path: str | Path, raw: dict[str, Any], aliases: Any, where: str
) -> Inspection | None:
    """The Inspection of a checkpoint psr cannot load, or None."""
    mt = str(raw.get("model_type"))
    try:
        check_config(raw, aliases, where)
    except ValueError as e:
        return Inspection(str(path), mt, supported=False, missing=str(e))
    return None


def _inspect_folder(path: str | Path, budget: Budget | None = None) -> Inspection:
    """`inspect` of a checkpoint folder: the transformers model built on the meta device."""
    import transformers

    from psr.models.sources import model_config

    raw = model_config(path)
    mt = str(raw.get("model_type"))
    cls = transformers.CONFIG_MAPPING[mt] if mt in FAMILIES else None
    bad = _unsupported(path, raw, getattr(cls, "attribute_map", None), f"{path}/config.json")
    if bad is not None:
        return bad
    config = transformers.AutoConfig.from_pretrained(str(path))
    config.__dict__.pop("quantization_config", None)  # built plain, as psr.load does
    facts, dtype = _meta_model(config)
    _, _, H, F = moe_sizes(config)
    n = len(facts.sparse)
    per = {fmt: _expert_bytes(fmt, dtype, H, F) for fmt in FORMATS}
    rows = {fmt: [per[fmt]] * n for fmt in FORMATS}
    out = _inspection(path, config, facts, per, rows, {}, _graphs(config), budget)
    out.mtp = _mtp_folder(path, config)
    return out


def _mtp_folder(path: str | Path, config: Any) -> str:
    """Whether speculative='mtp' finds a head: psr's file beside it, else the family's
    MTP layer in the checkpoint's tensor table (headers only)."""
    from psr.models.checkpoint import Checkpoint, CheckpointError
    from psr.models.mtp import PSR_FILE

    if (Path(path) / PSR_FILE).is_file():
        return f"psr's {PSR_FILE} (speculative='mtp')"
    try:
        ck = Checkpoint(path)
    except CheckpointError:  # a config without weights: no tensor table to read
        return ""
    try:
        return _mtp_line(str(config.model_type), int(config.num_hidden_layers), ck)
    finally:
        ck.close()


def _mtp_line(model_type: str, layers: int, names: Any) -> str:
    scheme = MTP_SCHEMES.get(model_type)
    if scheme is None:
        return "none"
    proj = scheme.names(layers)["proj"]
    return f"{proj.rsplit('.', 2)[0]}.* (speculative='mtp')" if proj in names else "none"


def _meta_model(config: Any) -> tuple[_Model, torch.dtype]:
    """The model's facts from transformers' model of `config` built on the meta device."""
    import torch
    import transformers

    from psr.models.families import moe_block

    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = dt if isinstance(dt, torch.dtype) else getattr(torch, str(dt or "float32"), None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    fam = FAMILIES[str(config.model_type)]
    blocks = [moe_block(layer, fam) for layer in model.model.layers]
    return _Model(
        num_layers=len(blocks),
        sparse=[i for i, b in enumerate(blocks) if b is not None],
        dense=meta_dense_bytes(model),
        shared=any(
            hasattr(b, name)
            for b in blocks
            if b is not None
            for name in ("shared_expert", "shared_experts", "shared_mlp")
        ),
        itemsize=dtype.itemsize,
        dtype=str(dtype).removeprefix("torch."),
    ), dtype


def meta_dense_bytes(model: Any) -> int:
    """Bytes of a (meta) transformers model's parameters but its routed experts, in their
    dtypes: the dense part psr.load puts on the device."""
    from psr.models.families import moe_block

    fam = FAMILIES[str(model.config.model_type)]
    blocks = [moe_block(layer, fam) for layer in model.model.layers]
    expert_ids = {
        id(p) for b in blocks if b is not None for p in b.get_submodule("experts").parameters()
    }
    params = (p for p in model.parameters() if id(p) not in expert_ids)
    return sum(p.numel() * p.dtype.itemsize for p in params)


# GGUF tensors transformers' model holds as no parameter: the router's correction bias (a
# buffer), llama.cpp's rope frequencies (computed), the MTP layers' tensors (no layer)
_NOT_PARAMETERS = re.compile(r"\.exp_probs_b\.|^rope_freqs\.|\.nextn\.")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def _dense_names(ck: Any, raw: dict[str, Any]) -> list[str]:
    """The GGUF tensors of the dense part (the routed experts are the `*_exps` tensors)."""
    L = int(raw["num_hidden_layers"])

    def counted(name: str) -> bool:
        m = _LAYER.match(name)
        in_model = m is None or int(m[1]) < L  # llama.cpp's MTP layers come after the last
        return in_model and "_exps." not in name and not _NOT_PARAMETERS.search(name)

    return [n for n in ck.tensor_elements() if counted(n)]


def gguf_dense_bytes(ck: Any) -> dict[str, int]:
    """A GGUF file's dense part per dense format (memory_plan.DENSE_FORMATS): "native", its
    matrices in their own block types; "float", dequantized to the model dtype. Counted by
    psr.models.dense_bytes, the rule the loader keeps blocks by."""
    from psr.models.dense_bytes import gguf_dense_bytes as counted

    itemsize = rowformat().FLOAT_ITEMSIZE[str(ck.config_dict["dtype"])]
    return {fmt: counted(ck, fmt, itemsize) for fmt in ("native", "float")}


def _header_model(ck: Any, raw: dict[str, Any]) -> _Model:
    """The model's facts from a GGUF header: the tensor table in place of the meta model
    (shared experts are the `*_shexp` tensors)."""
    dense = gguf_dense_bytes(ck)
    return _Model(
        num_layers=int(raw["num_hidden_layers"]),
        sparse=ck.moe_layers(),
        dense=dense["float"],
        shared=any("_shexp." in n for n in _dense_names(ck, raw)),
        itemsize=rowformat().FLOAT_ITEMSIZE[str(raw["dtype"])],
        dtype=str(raw["dtype"]),
        dense_native=dense["native"],
    )


def _inspect_gguf(
    path: str | Path, ck: Any, reference: bool = False, budget: Budget | None = None
) -> Inspection:
    """`inspect` of the opened GGUF checkpoint `ck` from its header alone (no torch, no
    transformers); `reference`: from transformers' config and meta model instead, as
    `inspect` of a folder does (what tests check the header's answer against)."""
    from psr.models.gguf import layer_formats

    raw = dict(ck.config_dict)
    bad = _unsupported(path, raw, None, f"{path} (its GGUF metadata)")
    if bad is not None:
        return bad
    if reference:
        config = ck.config
        facts, graphs = _meta_model(config)[0], _graphs(config)
        facts.dense_native = gguf_dense_bytes(ck)["native"]
    else:
        config = SimpleNamespace(**raw)
        if FAMILIES[raw["model_type"]].layer_types:
            config.layer_types = raw.get("layer_types") or ["full_attention"] * int(
                raw["num_hidden_layers"]
            )
        # every GGUF architecture psr reads has a cache transformers makes static (the
        # tests check each against the reference)
        facts, graphs = _header_model(ck, raw), GRAPHS_ON
    E, _, H, F = moe_sizes(config)
    fmts = layer_formats(ck, E, H, F, facts.sparse)  # the file's own blocks, checked
    rows = [rowformat().GGMLLayout.of(f, H, F).nbytes for f in fmts]
    types = {f.name: fmts.count(f) for f in dict.fromkeys(fmts)}
    per = {"gguf": round(sum(rows) / len(rows))}
    out = _inspection(path, config, facts, per, {"gguf": rows}, types, graphs, budget)
    L = int(raw["num_hidden_layers"])
    if f"blk.{L}.nextn.eh_proj.weight" in ck.tensor_elements():  # llama.cpp kept the layer
        out.mtp = f"blk.{L}.* (speculative='mtp')"
    return out


def _inspection(
    path: str | Path,
    config: Any,
    m: _Model,
    per: dict[str, int],
    rows: dict[str, list[int]],
    types: dict[str, int],
    graphs: str,
    budget: Budget | None = None,
) -> Inspection:
    """The Inspection from the model's facts and its expert rows per format (`per`: one
    expert; `rows`: one expert of each sparse layer), with the plan under `budget`."""
    from psr.runtime.kv import CACHE_KINDS, kv_bytes, layer_kinds

    E, k, H, F = moe_sizes(config)
    host = {fmt: sum(r) * E for fmt, r in rows.items()}
    device = {
        fmt: {f"{res:g}": m.dense + sum(r) * math.floor(res * E + 0.5) for res in RESIDENCIES}
        for fmt, r in rows.items()
    }
    fmt0 = next(iter(per))  # the file's own rows: what can stay in it (pageable)
    n = len(m.sparse)
    host_budget, note = _host_memory(m.dense, host[fmt0], per[fmt0] * n * _slots(E), fmt0)
    fam = FAMILIES[str(config.model_type)]
    kinds = layer_kinds(config)
    native = m.dense if m.dense_native < 0 else m.dense_native
    # the file's own rows (pageable: they can stay in the file)
    memory = ModelMemory(config, {"native": native, "float": m.dense}, rows[fmt0], E, k, m.itemsize)
    return Inspection(
        path=str(path),
        model_type=str(config.model_type),
        supported=True,
        family=fam.model_type,
        router_kind=fam.router_kind,
        expert_kind=fam.expert_kind,
        dtype=m.dtype,
        num_layers=m.num_layers,
        sparse_layers=m.sparse,
        dense_layers=[i for i in range(m.num_layers) if i not in m.sparse],
        num_experts=E,
        top_k=k,
        hidden_size=H,
        ffn_size=F,
        shared_experts=m.shared,
        attention=list(getattr(config, "layer_types", None) or []),
        expert_bytes=per,
        host_bytes=host,
        expert_types=types,
        kv_bytes_per_1k_tokens=kv_bytes(config, m.itemsize, 1024),
        kv_kinds={kind: c for kind in CACHE_KINDS if (c := kinds.count(kind))},
        dense_bytes=m.dense,
        dense_bytes_native=native,
        device_bytes=device,
        graphs=graphs,
        operating_points=_operating_points(path),
        default_host_memory=host_budget,
        host_memory=note,
        plan=None if budget is None else plan_memory(memory, budget),
        memory=memory,
    )


def _slots(E: int) -> int:
    """Slots per layer at psr.load's default residency."""
    residency = LoadConfig().slot_residency
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
    out: dict[str, str] = {}
    for fam in ("cache-prior", "psr"):
        if fam in found:
            pol, file = found[fam]
            out[fam] = f"{pol.describe()}: tuned ({file})"
        else:
            cmd = tune_command(path, DEFAULT_RESIDENCY)
            out[fam] = f"{make_policy(fam).describe()}: untuned default (measure it: {cmd})"
    return out
