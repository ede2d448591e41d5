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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import psr.vocab as vocab
from psr.load_config import LoadConfig
from psr.models.families import (
    EXPERT_KINDS,
    FAMILIES,
    ROUTER_KINDS,
    check_config,
    moe_sizes,
)
from psr.models.formats import rowformat

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


def inspect(path: str | Path) -> Inspection:
    """What psr would load from `path` (a checkpoint folder or a GGUF file; no weight is
    read)."""
    from psr.models.files import is_gguf

    if not is_gguf(path):
        return _inspect_folder(path)
    from psr.models.gguf import GGUFCheckpoint

    ck = GGUFCheckpoint(path)  # its header is read once, here (metadata and tensor table)
    try:
        return _inspect_gguf(path, ck)
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


def _inspect_folder(path: str | Path) -> Inspection:
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
    return _inspection(path, config, facts, per, rows, {}, _graphs(config))


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
    expert_ids = {
        id(p) for b in blocks if b is not None for p in b.get_submodule("experts").parameters()
    }
    params = (p for p in model.parameters() if id(p) not in expert_ids)
    return _Model(
        num_layers=len(blocks),
        sparse=[i for i, b in enumerate(blocks) if b is not None],
        dense=sum(p.numel() * p.dtype.itemsize for p in params),
        shared=any(
            hasattr(b, name)
            for b in blocks
            if b is not None
            for name in ("shared_expert", "shared_experts", "shared_mlp")
        ),
        itemsize=dtype.itemsize,
        dtype=str(dtype).removeprefix("torch."),
    ), dtype


# GGUF tensors transformers' model holds as no parameter: the router's correction bias (a
# buffer), llama.cpp's rope frequencies (computed), the MTP layers' tensors (no layer)
_NOT_PARAMETERS = re.compile(r"\.exp_probs_b\.|^rope_freqs\.|\.nextn\.")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def _header_model(ck: Any, raw: dict[str, Any]) -> _Model:
    """The model's facts from a GGUF header: the tensor table in place of the meta model
    (the routed experts are the `*_exps` tensors; shared experts `*_shexp`)."""
    L = int(raw["num_hidden_layers"])

    def counted(name: str) -> bool:
        m = _LAYER.match(name)
        in_model = m is None or int(m[1]) < L  # llama.cpp's MTP layers come after the last
        return in_model and "_exps." not in name and not _NOT_PARAMETERS.search(name)

    table = ck.tensor_elements()
    names = [n for n in table if counted(n)]
    itemsize = rowformat().FLOAT_ITEMSIZE[str(raw["dtype"])]
    return _Model(
        num_layers=L,
        sparse=ck.moe_layers(),
        dense=sum(table[n] for n in names) * itemsize,
        shared=any("_shexp." in n for n in names),
        itemsize=itemsize,
        dtype=str(raw["dtype"]),
    )


def _inspect_gguf(path: str | Path, ck: Any, reference: bool = False) -> Inspection:
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
    return _inspection(path, config, facts, per, {"gguf": rows}, types, graphs)


def _inspection(
    path: str | Path,
    config: Any,
    m: _Model,
    per: dict[str, int],
    rows: dict[str, list[int]],
    types: dict[str, int],
    graphs: str,
) -> Inspection:
    """The Inspection from the model's facts and its expert rows per format (`per`: one
    expert; `rows`: one expert of each sparse layer)."""
    from psr.runtime.kv import CACHE_KINDS, kv_bytes, layer_kinds

    E, k, H, F = moe_sizes(config)
    host = {fmt: sum(r) * E for fmt, r in rows.items()}
    device = {
        fmt: {f"{res:g}": m.dense + sum(r) * math.floor(res * E + 0.5) for res in RESIDENCIES}
        for fmt, r in rows.items()
    }
    fmt0 = next(iter(per))  # the file's own rows: what can stay in it (pageable)
    n = len(m.sparse)
    budget, note = _host_memory(m.dense, host[fmt0], per[fmt0] * n * _slots(E), fmt0)
    fam = FAMILIES[str(config.model_type)]
    kinds = layer_kinds(config)
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
        device_bytes=device,
        graphs=graphs,
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
    out: dict[str, str] = {}
    for fam in ("cache-prior", "psr"):
        if fam in found:
            pol, file = found[fam]
            out[fam] = f"{pol.describe()}: tuned ({file})"
        else:
            cmd = tune_command(path, DEFAULT_RESIDENCY)
            out[fam] = f"{make_policy(fam).describe()}: untuned default (measure it: {cmd})"
    return out
