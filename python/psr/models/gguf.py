"""Read llama.cpp's GGUF files as a psr checkpoint, under Hugging Face tensor names.

`GGUFCheckpoint` offers `Checkpoint`'s dense-tensor interface (names of the family's
transformers model; every tensor dequantized to float32 in HF layout) plus the routed
experts as raw GGUF blocks (`expert_tensors`: zero-copy views of the memory-mapped file,
never dequantized here). The config comes from psr's own per-architecture metadata table
(`ARCHS`), not transformers' GGUF loader, which gets qwen3moe wrong (it ignores
`expert_feed_forward_length`). Every tensor's type, shape, offset and extent is checked
against the file when it is opened, so a corrupt file is a one-line error naming the file,
the tensor and the problem before any tensor is read.
"""

from __future__ import annotations

import mmap
import re
import struct
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from psr.models.dense_bytes import TensorEntry, keeps_blocks
from psr.models.families import FAMILIES
from psr.models.files import CheckpointError
from psr.models.formats import rowformat

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is made: the header, the config and the tensor table
# are read without it (`psr inspect`)
BLOCK_TYPE_TRAITS, GGML_TYPES = rowformat().BLOCK_TYPE_TRAITS, rowformat().GGML_TYPES

# The GGML types psr's expert kernels compute, and the float ones (the format table's).
EXPERT_TYPES = GGML_TYPES
_FLOAT_TYPES = tuple(t for t in GGML_TYPES if BLOCK_TYPE_TRAITS[t].is_float)
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_EXPERT_PARTS = ("gate", "up", "down")


class GGUFError(CheckpointError):
    """A GGUF file, split set, tensor or metadata key is missing, corrupt or unsupported."""


@dataclass(frozen=True)
class ExpertTensor:
    """One layer's stacked routed-expert tensor (`blk.N.ffn_{gate,up,down}_exps.weight`) as the
    file holds it: `shape` is (E, out, in) logical, `row_bytes` the bytes of one expert."""

    name: str
    ggml_type: str
    shape: tuple[int, int, int]
    row_bytes: int
    data: np.ndarray = field(repr=False, compare=False)  # [E, row_bytes] uint8 memmap view
    file: str = ""  # the file holding it, and its first byte there (pageable rows)
    offset: int = 0

    def expert(self, e: int) -> torch.Tensor:
        """Expert `e`'s raw bytes, uint8 1-D, a view of the read-only map (no copy: the
        store copies them in, the kernels read them; nothing may write to it)."""
        if not 0 <= e < self.shape[0]:
            raise IndexError(f"expert {e} out of range for {self.name} ({self.shape[0]} experts)")
        return readonly_tensor(self.data[e])

    def dequantize(self, e: int) -> torch.Tensor:
        """Expert `e` as float32 [out, in] by gguf-py's dequantization (a reference)."""
        import torch

        qt = QT[self.ggml_type]
        raw = self.expert(e).numpy().reshape(self.shape[1], -1)
        return torch.from_numpy(_dequantize(raw, qt, self.shape[1:]))


def readonly_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only numpy view of a file's map, without a copy. torch has no
    read-only tensors and warns on each; psr only reads these views (a write would fault:
    the map is PROT_READ), so the warning is silenced here, and only here."""
    import torch

    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


# --- architectures ----------------------------------------------------------------------

# (GGUF key suffix after "{arch}.", HF config key, required) read for every architecture
_COMMON_KEYS: tuple[tuple[str, str, bool], ...] = (
    ("block_count", "num_hidden_layers", True),
    ("embedding_length", "hidden_size", True),
    ("attention.head_count", "num_attention_heads", True),
    ("attention.head_count_kv", "num_key_value_heads", False),
    ("attention.key_length", "head_dim", False),
    ("context_length", "max_position_embeddings", False),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps", True),
    ("expert_used_count", "num_experts_per_tok", True),
)


@dataclass(frozen=True)
class Arch:
    """How one GGUF `general.architecture` maps onto a psr family's transformers config."""

    gguf_arch: str
    model_type: str
    experts_key: str  # the HF key of `{arch}.expert_count`
    keys: tuple[tuple[str, str, bool], ...]  # arch-specific (suffix, HF key, required)
    fixed: Mapping[str, Any]  # what llama.cpp's graph hard-codes (GGUF stores no key)
    permute_qk: bool = False  # llama.cpp's converter permuted q/k rows (llama)
    # HF-name regex -> GGUF name (with {bid}) where gguf-py's name map has no entry
    renames: tuple[tuple[str, str], ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)  # llama.cpp's, key absent
    # config entries that depend on several keys or on which tensors exist
    derive: Callable[[Callable[[str], Any], dict[str, Any], Mapping[str, Any]], None] | None = None
    notes: str = ""


def _glm4moe(value: Callable[[str], Any], cfg: dict[str, Any], tensors: Mapping[str, Any]) -> None:
    """GLM-4.5: block_count counts the MTP (nextn) layers psr skips; partial rotary from
    rope.dimension_count; q/k/v biases and q/k norms where the file has them."""
    nextn = int(value("glm4moe.nextn_predict_layers") or 0)
    cfg["num_hidden_layers"] -= nextn
    cfg["num_mtp_layers"] = nextn
    dim = value("glm4moe.rope.dimension_count")
    cfg["rope_parameters"]["partial_rotary_factor"] = (
        1.0 if dim is None else int(dim) / int(cfg["head_dim"])  # llama.cpp: whole head
    )
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    cfg["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    gating = value("glm4moe.expert_gating_func")
    if gating is not None and int(gating) != int(gguf.ExpertGatingFuncType.SIGMOID):
        raise GGUFError(
            f"glm4moe.expert_gating_func={gating}: psr's glm4_moe routes by sigmoid "
            f"({int(gguf.ExpertGatingFuncType.SIGMOID)})"
        )


def _gpt_oss(value: Callable[[str], Any], cfg: dict[str, Any], tensors: Mapping[str, Any]) -> None:
    """gpt-oss: llama.cpp's swa pattern 2 (even layers sliding, as HF's default), yarn
    without truncation (HF's gpt-oss setting)."""
    n = int(cfg["num_hidden_layers"])
    cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if cfg["rope_parameters"]["rope_type"] == "yarn":
        cfg["rope_parameters"]["truncate"] = False


ARCHS: dict[str, Arch] = {
    a.gguf_arch: a
    for a in (
        Arch(
            "qwen3moe",
            "qwen3_moe",
            "num_experts",
            (
                ("expert_feed_forward_length", "moe_intermediate_size", True),
                ("feed_forward_length", "intermediate_size", False),
            ),
            # llama.cpp's qwen3moe graph always renormalises the top-k weights
            {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1},
        ),
        Arch(
            "qwen2moe",
            "qwen2_moe",
            "num_experts",
            (
                ("expert_feed_forward_length", "moe_intermediate_size", True),
                ("expert_shared_feed_forward_length", "shared_expert_intermediate_size", True),
                ("feed_forward_length", "intermediate_size", False),
            ),
            # llama.cpp's qwen2moe graph never renormalises; q/k/v have biases
            {
                "norm_topk_prob": False,
                "mlp_only_layers": [],
                "decoder_sparse_step": 1,
                "qkv_bias": True,
            },
        ),
        Arch(
            "olmoe",
            "olmoe",
            "num_experts",
            (("feed_forward_length", "intermediate_size", True),),
            {"norm_topk_prob": False},
        ),
        Arch(
            "llama",
            "mixtral",
            "num_local_experts",
            (("feed_forward_length", "intermediate_size", True),),
            {},
            permute_qk=True,
            notes="llama with expert_count > 0 (Mixtral)",
        ),
        Arch(
            "glm4moe",
            "glm4_moe",
            "n_routed_experts",
            (
                ("expert_feed_forward_length", "moe_intermediate_size", True),
                ("feed_forward_length", "intermediate_size", True),
                ("leading_dense_block_count", "first_k_dense_replace", False),
                ("expert_shared_count", "n_shared_experts", False),
                ("expert_weights_scale", "routed_scaling_factor", False),
                ("expert_weights_norm", "norm_topk_prob", False),
                ("expert_group_count", "n_group", False),
                ("expert_group_used_count", "topk_group", False),
            ),
            {},
            renames=(
                (
                    r"model\.layers\.(?P<bid>\d+)\.mlp\.gate\.e_score_correction_bias",
                    "blk.{bid}.exp_probs_b.bias",
                ),
            ),
            defaults={
                "first_k_dense_replace": 0,
                "n_shared_experts": 0,
                "routed_scaling_factor": 1.0,
                "norm_topk_prob": False,
                "n_group": 1,
                "topk_group": 1,
            },
            derive=_glm4moe,
            notes="MTP (nextn) layers skipped",
        ),
        Arch(
            "gpt-oss",
            "gpt_oss",
            "num_local_experts",
            (
                ("expert_feed_forward_length", "intermediate_size", True),
                ("attention.sliding_window", "sliding_window", True),
            ),
            # llama.cpp's graph: swiglu_oai(alpha 1.702, limit 7.0), q/k/v/o biases
            {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True},
            renames=(
                (r"model\.layers\.(?P<bid>\d+)\.self_attn\.sinks", "blk.{bid}.attn_sinks.weight"),
            ),
            derive=_gpt_oss,
            notes="expert biases as dense gate_up_proj_bias / down_proj_bias",
        ),
    )
}


_DEEPSEEK_KEYS: tuple[tuple[str, str, bool], ...] = (
    ("expert_feed_forward_length", "moe_intermediate_size", True),
    ("feed_forward_length", "intermediate_size", True),
    ("leading_dense_block_count", "first_k_dense_replace", False),
    ("expert_shared_count", "n_shared_experts", False),
    ("expert_weights_scale", "routed_scaling_factor", False),
    ("expert_weights_norm", "norm_topk_prob", False),
    ("expert_group_count", "n_group", False),
    ("expert_group_used_count", "topk_group", False),
    ("attention.q_lora_rank", "q_lora_rank", False),
    ("attention.kv_lora_rank", "kv_lora_rank", True),
    ("rope.dimension_count", "qk_rope_head_dim", True),
)
_DEEPSEEK_DEFAULTS: dict[str, Any] = {  # llama.cpp's when the key is absent
    "first_k_dense_replace": 0,
    "n_shared_experts": 0,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": None,
}


def _deepseek2(
    value: Callable[[str], Any], cfg: dict[str, Any], tensors: Mapping[str, Any]
) -> None:
    """llama.cpp's deepseek2 (DeepSeek-V2 and -V3/R1): MLA head sizes from the `_mla` keys
    (newer converters, whose key_length / value_length describe the compressed cache) or
    key_length / value_length; every query head has its own key head in HF; rope on
    interleaved pairs (llama.cpp's NORM rope, HF's rope_interleave); MTP layers skipped."""
    rope = int(cfg["qk_rope_head_dim"])
    k = value("deepseek2.attention.key_length_mla") or value("deepseek2.attention.key_length")
    v = value("deepseek2.attention.value_length_mla") or value("deepseek2.attention.value_length")
    if k is None or v is None:
        raise GGUFError("lacks metadata key 'deepseek2.attention.key_length' / 'value_length'")
    cfg["qk_nope_head_dim"] = int(k) - rope
    cfg["v_head_dim"] = int(v)
    cfg["head_dim"] = rope
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg["num_hidden_layers"] -= int(value("deepseek2.nextn_predict_layers") or 0)
    if cfg["model_type"] == "deepseek_v3":
        cfg["topk_method"] = "noaux_tc"
        cfg["rope_interleave"] = True
    else:
        cfg["topk_method"] = "group_limited_greedy" if cfg["n_group"] > 1 else "greedy"
    yarn_mul = value("deepseek2.rope.scaling.yarn_log_multiplier")
    if yarn_mul is not None and cfg["rope_parameters"]["rope_type"] == "yarn":
        # the converter writes 0.1 * mscale_all_dim
        m = round(float(yarn_mul) / 0.1, 6)
        cfg["rope_parameters"] |= {"mscale": m, "mscale_all_dim": m}


_DEEPSEEK = {
    gating: Arch(
        "deepseek2",
        model_type,
        "n_routed_experts",
        _DEEPSEEK_KEYS,
        {},
        renames=(
            (
                r"model\.layers\.(?P<bid>\d+)\.mlp\.gate\.e_score_correction_bias",
                "blk.{bid}.exp_probs_b.bias",
            ),
        ),
        defaults=_DEEPSEEK_DEFAULTS,
        derive=_deepseek2,
        notes=f"{name} gating",
    )
    for gating, model_type, name in ((1, "deepseek_v2", "softmax"), (2, "deepseek_v3", "sigmoid"))
}


def supported_archs() -> str:
    names = [f"{a} ({ARCHS[a].model_type})" for a in ARCHS]
    return ", ".join([*names, "deepseek2 (deepseek_v2 / deepseek_v3 by expert_gating_func)"])


# --- reading one file -------------------------------------------------------------------

# GGUF value types (gguf-py's GGUFValueType): scalar struct formats, little-endian
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class _TensorInfo:
    """One entry of a file's tensor table (`dims` in GGML order, innermost first)."""

    name: str
    tensor_type: QT
    dims: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int  # in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (outermost first)."""
        return self.dims[::-1]


class _Reader:
    """One GGUF file mapped read-only and shared (`mmap.ACCESS_READ`: PROT_READ, MAP_SHARED;
    a copy-on-write map of a file larger than the memory the kernel can commit fails with
    ENOMEM, as a 63 GB file does). psr parses the header itself (gguf-py's reader builds a
    numpy view per string: ~35 s for a 150k-token vocabulary): scalar values as they come,
    arrays only where they lie, parsed on first use (the tokenizer's, when a tokenizer is
    built). Each tensor's type, shape, offset and extent is checked against the file."""

    def __init__(self, path: Path) -> None:
        self.psr_path = path
        self.psr_size = path.stat().st_size
        with path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # uint8 view of the whole file (read-only: numpy refuses writes, the map faults them)
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        self._fields: dict[str, tuple[int, int, int]] = {}  # key -> (type, offset, count)
        self._cache: dict[str, Any] = {}
        self.tensors: list[_TensorInfo] = []
        self._parse()

    # the header: magic, version, tensor count, kv count; the kv pairs; the tensor table

    def _u(self, fmt: str, at: int) -> Any:
        return struct.unpack_from(fmt, self._map, at)[0]

    def _str(self, at: int) -> tuple[str, int]:
        n = self._u("<Q", at)
        end = at + 8 + n
        if end > self.psr_size:
            raise ValueError(f"a string of {n} bytes at byte {at} runs past the end")
        return self._map[at + 8 : end].decode("utf-8"), end

    def _skip(self, vtype: int, at: int) -> tuple[int, int]:
        """Where a value of `vtype` at `at` ends, and its element count (arrays)."""
        if vtype in _SCALAR:
            return at + struct.calcsize(_SCALAR[vtype]), 1
        if vtype == _STRING:
            return at + 8 + self._u("<Q", at), 1
        if vtype != _ARRAY:
            raise ValueError(f"unknown value type {vtype} at byte {at}")
        sub, count = self._u("<I", at), self._u("<Q", at + 4)
        at += 12
        if sub in _SCALAR:
            end = at + count * struct.calcsize(_SCALAR[sub])
        elif sub == _STRING:  # only the lengths are read; the strings when first asked
            m, size, end = self._map, self.psr_size, at
            for _ in range(count):
                if end + 8 > size:
                    break
                end += 8 + int.from_bytes(m[end : end + 8], "little")
        elif sub == _ARRAY:
            end = at
            for _ in range(count):
                end = self._skip(_ARRAY, end)[0]
        else:
            raise ValueError(f"array of unknown value type {sub} at byte {at}")
        if end > self.psr_size:
            raise ValueError(f"an array of {count} values at byte {at} runs past the end")
        return end, count

    def _parse(self) -> None:
        if self._map[:4] != b"GGUF":
            raise ValueError("bad magic")
        version = self._u("<I", 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (psr reads 2 and 3, little-endian)")
        n_tensors, n_kv = self._u("<Q", 8), self._u("<Q", 16)
        at = 24
        for _ in range(n_kv):
            key, at = self._str(at)
            vtype = self._u("<I", at)
            end, count = self._skip(vtype, at + 4)
            self._fields[key] = (vtype, at + 4, count)
            at = end
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name, at = self._str(at)
            n_dims = self._u("<I", at)
            if n_dims > _MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, at + 4)
            at += 4 + 8 * n_dims
            raw.append((name, dims, self._u("<I", at), self._u("<Q", at + 4)))
            at += 12
        align = self.value("general.alignment")
        self.alignment = 32 if align is None else int(align)
        start = _pad(at, self.alignment)
        self.tensors = _check_tensor_table(self.psr_path, self.psr_size, start, self.alignment, raw)

    def value(self, key: str) -> Any:
        """A metadata value as gguf-py's `ReaderField.contents()` gives it (None: absent);
        arrays are parsed on first use and kept."""
        if key in self._cache:
            return self._cache[key]
        f = self._fields.get(key)
        if f is None:
            return None
        vtype, at, _ = f
        try:
            if vtype in _SCALAR:
                out: Any = self._u(_SCALAR[vtype], at)
            elif vtype == _STRING:
                out = self._str(at)[0]
            else:
                out = self._array(at)[0]
        except (ValueError, struct.error) as e:  # UnicodeDecodeError is a ValueError
            raise GGUFError(
                f"corrupt GGUF file {self.psr_path}: metadata key {key!r} does not parse ({e})"
            ) from None
        self._cache[key] = out
        return out

    def _array(self, at: int) -> tuple[list[Any], int]:
        """The array at `at` (its element type, count, elements) and where it ends."""
        sub, count = self._u("<I", at), self._u("<Q", at + 4)
        at += 12
        if sub in _SCALAR:
            vals = np.frombuffer(self._map, _NUMPY[sub], count, at).tolist()
            return vals, at + count * struct.calcsize(_SCALAR[sub])
        m, out = self._map, list[Any]()
        for _ in range(count):
            if sub == _STRING:  # inline: the tokenizer's 150k strings are the hot path
                n = int.from_bytes(m[at : at + 8], "little")
                out.append(m[at + 8 : at + 8 + n].decode("utf-8"))
                at += 8 + n
            else:
                v, at = self._array(at)
                out.append(v)
        return out, at


def _check_tensor_table(
    path: Path, size: int, start: int, align: int, raw: list[tuple[str, tuple[int, ...], int, int]]
) -> list[_TensorInfo]:
    """Each tensor's type known to gguf-py, its rows whole blocks, its offset where the
    tensors before it end (as llama.cpp requires) and its data inside the file."""
    expected, prev, out = 0, "", []
    for name, dims, raw_type, off in raw:
        shape = list(reversed(dims))
        qt = _known_type(path, name, raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        if shape and shape[-1] % block:
            raise GGUFError(
                f"GGUF file {path}: tensor {name!r} ({qt.name}, shape {shape}) has rows of "
                f"{shape[-1]} values, not a multiple of its {block}-value blocks"
            )
        n_el = int(np.prod(shape, dtype=np.int64))
        n_bytes = n_el // block * type_size
        if off != expected:
            culprit = f"tensor {prev}" if prev else f"tensor {name!r} (the first)"
            raise GGUFError(
                f"GGUF file {path}: {culprit} has a byte size that disagrees with its type "
                f"and shape: they make the next tensor start at data byte {expected}, the "
                f"file puts {name!r} at {off}"
            )
        if start + off + n_bytes > size:
            raise GGUFError(
                f"truncated GGUF file {path}: tensor {name!r} ({qt.name}, shape {shape}) needs "
                f"bytes up to {start + off + n_bytes}, the file has {size}"
            )
        out.append(_TensorInfo(name, qt, tuple(int(d) for d in dims), n_el, n_bytes, start + off))
        expected = off + _pad(n_bytes, align)
        prev = f"{name!r} ({qt.name}, shape {shape}, {n_bytes} bytes)"
    return out


def _known_type(path: Path, name: str, raw: int) -> QT:
    try:
        return QT(raw)
    except ValueError:
        raise GGUFError(
            f"GGUF file {path}: tensor {name!r} has GGML type {raw}, which gguf-py "
            f"{_gguf_version()} does not know"
        ) from None


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _open(path: Path) -> _Reader:
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (bad magic {magic!r})")
    try:
        return _Reader(path)
    except GGUFError:
        raise
    except (ValueError, IndexError, OverflowError, struct.error, KeyError) as e:
        raise GGUFError(
            f"truncated or corrupt GGUF file {path}: its header (metadata and tensor table) "
            f"does not parse ({e})"
        ) from None


def _value(reader: _Reader, key: str) -> Any:
    return reader.value(key)


# --- files of one model ---------------------------------------------------------------


def _split_parts(first: Path) -> list[Path]:
    m = _SPLIT.match(first.name)
    if m is None:
        return [first]
    n = int(m["count"])
    return [first.with_name(f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _model_file(path: Path) -> Path:
    """The file (or the first split part) of `path`: a .gguf file or a folder of one model."""
    if not path.exists():
        raise GGUFError(f"GGUF path {path} does not exist")
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf"))
    if not found:
        raise GGUFError(f"no .gguf file in {path}")
    sets = {m["prefix"] if (m := _SPLIT.match(p.name)) else p.name for p in found}
    if len(sets) != 1:
        raise GGUFError(
            f"{path} holds more than one GGUF model ({', '.join(sorted(sets))}): name the file"
        )
    return found[0]


def _open_set(path: Path) -> list[_Reader]:
    """Every part of the model at `path`, checked against llama.cpp's split metadata."""
    first = _model_file(path)
    m = _SPLIT.match(first.name)
    if m is not None and int(m["no"]) != 1:
        first = first.with_name(f"{m['prefix']}-00001-of-{m['count']}.gguf")
    parts = _split_parts(first)
    for i, p in enumerate(parts):
        if not p.is_file():
            raise GGUFError(
                f"GGUF split set {first}: part {i + 1} of {len(parts)} ({p.name}) is missing"
            )
    readers = [_open(p) for p in parts]
    count = _value(readers[0], gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
    if count is not None and int(count) != len(parts):
        raise GGUFError(
            f"GGUF file {first}: split.count says {count} parts, the file names say {len(parts)}"
        )
    for i, r in enumerate(readers):
        no = _value(r, gguf.Keys.Split.LLM_KV_SPLIT_NO)
        if len(parts) > 1 and (no is None or int(no) != i):
            raise GGUFError(f"GGUF file {r.psr_path}: split.no is {no}, expected {i}")
    total = _value(readers[0], gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    have = sum(len(r.tensors) for r in readers)
    if total is not None and int(total) != have:
        raise GGUFError(
            f"GGUF split set {first}: split.tensors.count says {total} tensors, "
            f"the parts hold {have}"
        )
    return readers


# --- config -------------------------------------------------------------------------------


def _arch_of(reader: _Reader) -> Arch:
    name = _value(reader, "general.architecture")
    if name is None:
        raise GGUFError(f"GGUF file {reader.psr_path} lacks metadata key 'general.architecture'")
    arch = ARCHS.get(str(name))
    if name == "deepseek2":
        gating = _value(reader, "deepseek2.expert_gating_func")
        arch = _DEEPSEEK.get(1 if gating is None else int(gating))  # llama.cpp: softmax
    experts = _value(reader, f"{name}.expert_count")
    if arch is not None and arch.gguf_arch == "llama" and not experts:
        arch = None  # a dense llama: nothing to offload
    if arch is None:
        what = "llama without experts" if name == "llama" else repr(str(name))
        raise GGUFError(
            f"GGUF file {reader.psr_path}: architecture {what} is not supported by psr; "
            f"supported: {supported_archs()}"
        )
    return arch


def _one_value(v: Any) -> Any:
    """A per-layer list whose entries agree (llama.cpp writes some keys per layer)."""
    if isinstance(v, list) and v and all(x == v[0] for x in v):
        return v[0]
    return v


def _f32(v: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def _rope(value: Callable[[str], Any], where: str) -> dict[str, Any]:
    """HF rope_parameters from `rope.freq_base` (llama.cpp's default 10000 when absent) and
    `rope.scaling.*` (none, linear or yarn)."""
    theta = value("rope.freq_base")
    out: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": _f32(theta) if theta is not None else 10000.0,
    }
    kind = value("rope.scaling.type")
    if kind in (None, "none"):
        return out
    factor = value("rope.scaling.factor")
    if kind not in ("linear", "yarn") or factor is None:
        raise GGUFError(
            f"GGUF file {where}: rope.scaling.type={kind!r} (factor {factor}) is not read by psr "
            "(none, linear, yarn with a factor)"
        )
    out |= {"rope_type": kind, "factor": _f32(factor)}
    if kind == "yarn":
        orig = value("rope.scaling.original_context_length")
        if orig is None:
            raise GGUFError(f"GGUF file {where}: yarn rope scaling lacks original_context_length")
        out["original_max_position_embeddings"] = int(orig)
        for key, hf, default in (("fast", "beta_fast", 32.0), ("slow", "beta_slow", 1.0)):
            v = value(f"rope.scaling.yarn_beta_{key}")
            out[hf] = _f32(v) if v is not None else default  # llama.cpp's defaults
    return out


def build_config(
    reader: _Reader, arch: Arch, tensors: Mapping[str, Any], dtype: str
) -> dict[str, Any]:
    """A transformers config.json-like dict from the GGUF metadata, by `arch`'s table."""
    a = arch.gguf_arch
    cfg: dict[str, Any] = {"model_type": arch.model_type, "hidden_act": "silu"}
    cfg.update(arch.defaults)
    keys = (*_COMMON_KEYS, ("expert_count", arch.experts_key, True), *arch.keys)
    for suffix, hf, required in keys:
        v = _value(reader, f"{a}.{suffix}")
        if v is None:
            if required:
                raise GGUFError(f"GGUF file {reader.psr_path} lacks metadata key '{a}.{suffix}'")
            continue
        v = _one_value(v)
        cfg[hf] = _f32(v) if isinstance(v, float) else v
    vlen = _value(reader, f"{a}.attention.value_length")
    if a != "deepseek2" and vlen is not None and vlen != cfg.get("head_dim", vlen):
        raise GGUFError(
            f"GGUF file {reader.psr_path}: {a}.attention.value_length={vlen} differs from "
            f"key_length={cfg['head_dim']}; transformers' {arch.model_type} has one head_dim"
        )
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["rope_parameters"] = _rope(lambda k: _value(reader, f"{a}.{k}"), str(reader.psr_path))
    cfg.update(arch.fixed)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"GGUF file {reader.psr_path} lacks tensor 'token_embd.weight'")
    cfg["vocab_size"] = int(embd[1].shape[0])  # the embedding's rows
    cfg["tie_word_embeddings"] = "output.weight" not in tensors
    for key in ("bos", "eos", "padding"):
        v = _value(reader, f"tokenizer.ggml.{key}_token_id")
        cfg[f"{'pad' if key == 'padding' else key}_token_id"] = None if v is None else int(v)
    cfg["dtype"] = dtype
    if arch.derive is not None:
        try:
            arch.derive(lambda k: _value(reader, k), cfg, tensors)
        except GGUFError as e:
            raise GGUFError(f"GGUF file {reader.psr_path}: {e}") from None
    return cfg


# --- tensors ------------------------------------------------------------------------------


@cache
def _dequantizable(qt: QT) -> bool:
    if qt.name in _FLOAT_TYPES:
        return True
    size = gguf.GGML_QUANT_SIZES[qt][1]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), qt)
    except NotImplementedError:
        return False
    return True


def _raw(reader: _Reader, t: Any) -> np.ndarray:
    """A tensor's bytes as the file holds them (uint8 memmap view)."""
    data: np.ndarray = reader.data[t.data_offset : t.data_offset + t.n_bytes]
    return data


def _dequantize(raw: np.ndarray, qt: QT, shape: tuple[int, ...]) -> np.ndarray:
    """`raw` bytes of type `qt` as float32 of `shape` (GGUF numpy order)."""
    if qt == QT.F32:
        out = raw.view(np.float32).copy()  # the map is read-only: the caller gets its own
    elif qt == QT.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif qt == QT.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        out = gguf.quants.dequantize(raw.reshape(-1, raw.shape[-1]), qt)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of q/k rows (HF's rotate_half layout
    -> GGML's interleaved rope pairs): rows (head, pair, 2) back to (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _Dense:
    gguf_name: str
    part: int  # index of the reader holding it
    shape: tuple[int, ...]  # HF shape
    heads: int = 0  # > 0: un-permute llama q/k rows over this many heads
    other: str | None = None  # a second GGUF tensor composed with the first by `join`
    # "interleave": gpt-oss's gate/up bias columns alternate; "kv_b": DeepSeek's kv_b_proj
    # from llama.cpp's attn_k_b [heads, rank, nope] and attn_v_b [heads, v, rank]; "rows":
    # an MTP layer's fused experts, gate [E, F, H] rows then up's
    join: str = ""


class GGUFCheckpoint:
    """A GGUF model (one file, a folder holding one, or split parts) as a psr checkpoint."""

    def __init__(self, path: str | Path, dtype: str = "float32") -> None:
        self.path = Path(path)
        self._readers = _open_set(self.path)
        self.files = [r.psr_path.name for r in self._readers]
        head = self._readers[0]
        self.arch_spec = _arch_of(head)
        self.arch = self.arch_spec.gguf_arch
        self._tensors: dict[str, tuple[int, Any]] = {}
        for i, r in enumerate(self._readers):
            for t in r.tensors:
                if t.name in self._tensors:
                    raise GGUFError(f"GGUF split set {self.path}: tensor {t.name!r} in two parts")
                self._tensors[t.name] = (i, t)
        self.config_dict = build_config(head, self.arch_spec, self._tensors, dtype)
        self._check_types()
        self._experts = self._find_experts()
        self._dense_map: dict[str, _Dense] | None = None

    @property
    def _dense(self) -> dict[str, _Dense]:
        """HF name -> GGUF tensor(s), built on first use: it builds the transformers model
        on the meta device, which `psr inspect` (experts and config only) never needs."""
        if self._dense_map is None:
            self._dense_map = self._map_dense()
        return self._dense_map

    @property
    def unmapped(self) -> list[str]:
        """GGUF tensors psr reads nowhere (MTP layers, llama.cpp's rope_freqs, ...)."""
        used = {n for d in self._dense.values() for n in (d.gguf_name, d.other) if n}
        used |= {t.name for layer in self._experts.values() for t in layer.values()}
        return [n for n in self._tensors if n not in used]

    def tensor_table(self) -> dict[str, TensorEntry]:
        """Every GGUF tensor of the set -> its type, shape and bytes (the header's table,
        read without torch: psr.models.dense_bytes counts from it)."""
        return {
            name: TensorEntry(t.tensor_type.name, tuple(t.shape), int(t.n_bytes))
            for name, (_, t) in self._tensors.items()
        }

    @property
    def config(self) -> Any:
        import transformers

        cfg = dict(self.config_dict)
        return transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)

    def _where(self, gname: str) -> str:
        part = self._tensors[gname][0]
        return str(self._readers[part].psr_path)

    def _check_types(self) -> None:
        for name, (_, t) in self._tensors.items():
            qt = t.tensor_type
            if "_exps." in name and name.endswith(".weight") and qt.name not in EXPERT_TYPES:
                raise GGUFError(
                    f"GGUF file {self._where(name)}: expert tensor {name!r} has type {qt.name}; "
                    f"psr's expert kernels compute {', '.join(EXPERT_TYPES)}"
                )
            if not _dequantizable(qt):
                raise GGUFError(
                    f"GGUF file {self._where(name)}: tensor {name!r} has type {qt.name}, which "
                    f"gguf-py {_gguf_version()} cannot dequantize"
                )

    # --- experts ---

    def _find_experts(self) -> dict[int, dict[str, ExpertTensor]]:
        cfg = self.config_dict
        E, H = int(cfg[self.arch_spec.experts_key]), int(cfg["hidden_size"])
        ffn_key = FAMILIES[self.arch_spec.model_type].keys[3]
        F = int(cfg[ffn_key])  # the metadata's expert FFN size: the tensors must agree
        out: dict[int, dict[str, ExpertTensor]] = {}
        for layer in range(int(cfg["num_hidden_layers"])):
            names = {p: f"blk.{layer}.ffn_{p}_exps.weight" for p in _EXPERT_PARTS}
            have = [n for n in names.values() if n in self._tensors]
            if not have:
                continue
            if len(have) != 3:
                missing = next(n for n in names.values() if n not in self._tensors)
                raise GGUFError(f"GGUF file {self.path}: tensor {missing!r} is missing")
            out[layer] = {p: self._expert_tensor(n, E) for p, n in names.items()}
            want = {"gate": (E, F, H), "up": (E, F, H), "down": (E, H, F)}
            for p, et in out[layer].items():
                if et.shape != want[p]:
                    raise GGUFError(
                        f"GGUF file {self._where(et.name)}: tensor {et.name!r} has shape "
                        f"{list(et.shape)}, expected {list(want[p])} (experts, out, in; "
                        f"{ffn_key}={F} from the metadata)"
                    )
        return out

    def _expert_tensor(self, gname: str, E: int) -> ExpertTensor:
        part, t = self._tensors[gname]
        shape = t.shape
        if len(shape) != 3 or shape[0] != E:
            raise GGUFError(
                f"GGUF file {self._where(gname)}: expert tensor {gname!r} has shape "
                f"{list(shape)}, expected [{E}, out, in] ({E} experts)"
            )
        raw = _raw(self._readers[part], t).reshape(E, -1)
        r = self._readers[part]
        return ExpertTensor(
            gname,
            t.tensor_type.name,
            (shape[0], shape[1], shape[2]),
            raw.shape[1],
            raw,
            str(r.psr_path),
            int(t.data_offset),
        )

    def moe_layers(self) -> list[int]:
        """Decoder layers holding routed experts."""
        return sorted(self._experts)

    def expert_tensors(self, decoder_layer: int) -> dict[str, ExpertTensor]:
        """The routed experts of `decoder_layer`: "gate", "up" ([E, F, H]), "down" ([E, H, F])."""
        if decoder_layer not in self._experts:
            raise GGUFError(
                f"GGUF model {self.path}: decoder layer {decoder_layer} has no routed experts "
                f"(layers with experts: {self.moe_layers()})"
            )
        return dict(self._experts[decoder_layer])

    # --- dense tensors ---

    def _gguf_name(self, hf: str, tmap: gguf.TensorNameMap) -> str | None:
        for pattern, target in self.arch_spec.renames:
            m = re.fullmatch(pattern, hf)
            if m is not None:
                return target.format(**m.groupdict())
        name = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        return None if name is None else str(name)

    def _mtp_layers(self) -> int:
        """1 when the file keeps an MTP (nextn) layer as blk.L, L the trunk's layers (the
        first one, which psr.models.mtp reads), else 0."""
        L = int(self.config_dict["num_hidden_layers"])
        return int(f"blk.{L}.nextn.eh_proj.weight" in self._tensors)

    def _hf_state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The transformers model's non-expert tensors and their shapes (built on meta),
        with the MTP layer as one more decoder layer where the file has one."""
        import torch
        import transformers

        config = self.config
        config.num_hidden_layers += self._mtp_layers()
        if self._mtp_layers() and getattr(config, "layer_types", None):
            config.layer_types = [*config.layer_types, "full_attention"]
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(config)
        block = FAMILIES[self.arch_spec.model_type].block
        mtp = range(config.num_hidden_layers - self._mtp_layers(), config.num_hidden_layers)
        prefixes = tuple(f"model.layers.{d}.{block}.experts." for d in [*self._experts, *mtp])
        return {
            k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(prefixes)
        }

    def _map_dense(self) -> dict[str, _Dense]:
        cfg = self.config_dict
        arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch)
        tmap = gguf.get_tensor_name_map(
            arch_enum, int(cfg["num_hidden_layers"]) + self._mtp_layers()
        )
        out: dict[str, _Dense] = {}
        for hf, shape in self._hf_state_shapes().items():
            gname = self._gguf_name(hf, tmap)
            if gname is None or gname not in self._tensors:
                kv_b = self._kv_b(hf, shape)
                if kv_b is not None:
                    out[hf] = kv_b
                continue  # absent: the loader names it (or ties lm_head)
            part, t = self._tensors[gname]
            if int(t.n_elements) != int(np.prod(shape, dtype=np.int64)):
                if hf.startswith(f"model.layers.{cfg['num_hidden_layers']}."):
                    continue  # the MTP layer's: speculative='mtp' names it missing
                gshape = list(t.shape)
                raise GGUFError(
                    f"GGUF file {self._where(gname)}: tensor {gname!r} has shape {gshape}, but "
                    f"the config makes {hf!r} {list(shape)}"
                )
            heads = 0
            if self.arch_spec.permute_qk and re.search(r"\.attn_[qk]\.weight$", gname):
                q = ".attn_q." in gname
                heads = int(cfg["num_attention_heads" if q else "num_key_value_heads"])
            out[hf] = _Dense(gname, part, shape, heads)
        out.update(self._expert_biases())
        out.update(self._mtp_own())
        return out

    def _mtp_own(self) -> dict[str, _Dense]:
        """The MTP layer's own tensors as llama.cpp's converter writes them
        (`blk.L.nextn.*`, its routed experts `blk.L.ffn_*_exps`) under DeepSeek-V3's HF
        names (`model.layers.L.enorm`, ..., `mlp.experts.gate_up_proj` fused)."""
        if not self._mtp_layers():
            return {}
        cfg = self.config_dict
        L, d, V = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"])
        hf, g = f"model.layers.{L}.", f"blk.{L}."
        roles = {
            "enorm.weight": ("nextn.enorm.weight", (d,)),
            "hnorm.weight": ("nextn.hnorm.weight", (d,)),
            "eh_proj.weight": ("nextn.eh_proj.weight", (d, 2 * d)),
            "shared_head.norm.weight": ("nextn.shared_head_norm.weight", (d,)),
            "shared_head.head.weight": ("nextn.shared_head_head.weight", (V, d)),
            "embed_tokens.weight": ("nextn.embed_tokens.weight", (V, d)),
        }
        out = {
            hf + name: _Dense(g + gname, self._tensors[g + gname][0], shape)
            for name, (gname, shape) in roles.items()
            if g + gname in self._tensors
        }
        gate, up, down = (f"{g}ffn_{p}_exps.weight" for p in _EXPERT_PARTS)
        if all(n in self._tensors for n in (gate, up, down)):
            E = int(cfg[self.arch_spec.experts_key])
            F = int(cfg[FAMILIES[self.arch_spec.model_type].keys[3]])
            block = FAMILIES[self.arch_spec.model_type].block
            part = self._tensors[gate][0]
            H = d
            out[f"{hf}{block}.experts.gate_up_proj"] = _Dense(
                gate, part, (E, 2 * F, H), other=up, join="rows"
            )
            out[f"{hf}{block}.experts.down_proj"] = _Dense(down, self._tensors[down][0], (E, H, F))
        return out

    def _kv_b(self, hf: str, shape: tuple[int, ...]) -> _Dense | None:
        """DeepSeek's kv_b_proj where the file holds llama.cpp's split attn_k_b / attn_v_b."""
        m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight", hf)
        if m is None:
            return None
        k, v = (f"blk.{m[1]}.attn_{p}_b.weight" for p in ("k", "v"))
        if k not in self._tensors or v not in self._tensors:
            return None
        cfg = self.config_dict
        heads, rank = int(cfg["num_attention_heads"]), int(cfg["kv_lora_rank"])
        nope, vd = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        for n, want in ((k, [heads, rank, nope]), (v, [heads, vd, rank])):
            got = list(self._tensors[n][1].shape)
            if got != want:
                raise GGUFError(
                    f"GGUF file {self._where(n)}: tensor {n!r} has shape {got}, expected {want}"
                )
        return _Dense(k, self._tensors[k][0], shape, other=v, join="kv_b")

    def _expert_biases(self) -> dict[str, _Dense]:
        """gpt-oss's expert biases under their HF names: `experts.gate_up_proj_bias
        [E, 2F]` (gate and up columns interleaved, as HF holds them) and
        `experts.down_proj_bias [E, H]`."""
        block = FAMILIES[self.arch_spec.model_type].block
        out: dict[str, _Dense] = {}
        for d in self._experts:
            gate, up, down = (f"blk.{d}.ffn_{p}_exps.bias" for p in _EXPERT_PARTS)
            have = [n in self._tensors for n in (gate, up, down)]
            if not any(have):
                continue
            if not all(have):
                missing = next(n for n, h in zip((gate, up, down), have, strict=True) if not h)
                raise GGUFError(f"GGUF file {self.path}: tensor {missing!r} is missing")
            E, F, H = (self._experts[d]["gate"].shape[0], *self._experts[d]["gate"].shape[1:])
            want = {gate: [E, F], up: [E, F], down: [E, H]}
            for n, shape in want.items():
                gshape = list(self._tensors[n][1].shape)
                if gshape != shape:
                    raise GGUFError(
                        f"GGUF file {self._where(n)}: tensor {n!r} has shape {gshape}, "
                        f"expected {shape}"
                    )
            prefix = f"model.layers.{d}.{block}.experts."
            out[prefix + "gate_up_proj_bias"] = _Dense(
                gate, self._tensors[gate][0], (E, 2 * F), other=up, join="interleave"
            )
            out[prefix + "down_proj_bias"] = _Dense(down, self._tensors[down][0], (E, H))
        return out

    def __contains__(self, name: str) -> bool:
        return name in self._dense

    def names(self) -> list[str]:
        """The trunk's dense tensors (an MTP layer's are readable by name, not listed)."""
        mtp = f"model.layers.{int(self.config_dict['num_hidden_layers'])}."
        return [n for n in self._dense if not n.startswith(mtp)]

    def tensor_elements(self) -> dict[str, int]:
        """Every GGUF tensor of the set (its own name) -> its element count: the header's
        tensor table, read without building the model (`psr inspect`)."""
        return {name: int(t.n_elements) for name, (_, t) in self._tensors.items()}

    def tensor_bytes(self) -> dict[str, int]:
        """Every GGUF tensor of the set -> its bytes in the file (its own block type)."""
        return {name: int(t.n_bytes) for name, (_, t) in self._tensors.items()}

    def _require(self, name: str) -> _Dense:
        d = self._dense.get(name)
        if d is None:
            raise GGUFError(f"tensor {name!r} not found in GGUF model {self.path}")
        return d

    def gguf_name(self, name: str) -> str:
        """The GGUF tensor an HF name reads."""
        return self._require(name).gguf_name

    def shape(self, name: str) -> list[int]:
        return list(self._require(name).shape)

    def dtype(self, name: str) -> str:
        """'F32' / 'F16' / 'BF16', or the GGML type name of a quantized tensor ('Q8_0')."""
        d = self._require(name)
        name_: str = self._tensors[d.gguf_name][1].tensor_type.name
        return name_

    def require_float(self, name: str, what: str = "weight") -> None:
        """Every GGUF type psr accepts is floating point or dequantizes to it (checked when
        the file was opened), so this only checks the tensor exists."""
        self._require(name)

    def _read(self, gname: str) -> torch.Tensor:
        import torch

        part, t = self._tensors[gname]
        gshape = t.shape
        return torch.from_numpy(_dequantize(_raw(self._readers[part], t), t.tensor_type, gshape))

    def get(self, name: str) -> torch.Tensor:
        """The tensor in HF layout, float32 (quantized ones dequantized by gguf-py)."""
        import torch

        d = self._require(name)
        out = self._read(d.gguf_name)
        if d.other is not None and d.join == "interleave":
            out = torch.stack([out, self._read(d.other)], dim=-1)
        elif d.other is not None and d.join == "rows":
            E, F2, H = d.shape
            half = (E, F2 // 2, H)
            out = torch.cat([out.reshape(half), self._read(d.other).reshape(half)], dim=1)
        elif d.other is not None:  # kv_b: per head, the k rows (nope) then the v rows
            out = torch.cat([out.transpose(1, 2), self._read(d.other)], dim=1)
        out = out.reshape(d.shape)
        return _unpermute(out, d.heads) if d.heads else out

    def get_blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """A dense tensor in HF layout as the file's blocks, for `dense_format="native"`:
        (its GGML type, uint8 `[rows, row bytes]`, llama's q/k rows un-permuted as `get`
        does; a view of the map), or None where it stays float (psr.models.dense_bytes)."""
        d = self._require(name)
        part, t = self._tensors[d.gguf_name]
        qt = t.tensor_type.name
        if d.other is not None or len(d.shape) != 2 or not keeps_blocks(d.gguf_name, qt, 2):
            return None
        if len(t.shape) != 2 or tuple(t.shape) != tuple(d.shape):
            return None
        raw = readonly_tensor(_raw(self._readers[part], t).reshape(d.shape[0], -1))
        return qt, (_unpermute(raw, d.heads) if d.heads else raw)

    def get_split_kv_b(
        self, name: str
    ) -> tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor], int] | None:
        """DeepSeek's kv_b_proj `name` where the file holds llama.cpp's split attn_k_b /
        attn_v_b, as their blocks: ((k type, uint8 [heads * rank, row bytes of nope]), (v type,
        uint8 [heads * v, row bytes of rank]), heads), views of the map; else None."""
        d = self._require(name)
        if d.join != "kv_b" or d.other is None:
            return None
        parts = []
        for g in (d.gguf_name, d.other):
            part, t = self._tensors[g]
            rows = int(np.prod(t.shape[:-1]))
            parts.append(
                (
                    t.tensor_type.name,
                    readonly_tensor(_raw(self._readers[part], t).reshape(rows, -1)),
                )
            )
        heads = int(self._tensors[d.gguf_name][1].shape[0])
        return parts[0], parts[1], heads

    def get_row(self, name: str, i: int) -> torch.Tensor:
        """`tensor[i]`; a quantized tensor's row alone where no permutation applies."""
        import torch

        d = self._require(name)
        part, t = self._tensors[d.gguf_name]
        gshape = t.shape
        if d.heads or d.other or len(d.shape) < 2 or gshape[0] != d.shape[0]:
            return self.get(name)[i]
        if not 0 <= i < d.shape[0]:
            raise IndexError(f"row {i} out of range for {name!r} ({d.shape[0]} rows)")
        raw = _raw(self._readers[part], t).reshape(gshape[0], -1)[i]
        arr = _dequantize(raw.reshape(1, -1), t.tensor_type, gshape[1:])
        return torch.from_numpy(arr).reshape(d.shape[1:])

    def first(self, *names: str) -> str | None:
        return next((n for n in names if n in self._dense), None)

    def metadata(self, key: str) -> Any:
        """A GGUF metadata value of the first part (None when absent)."""
        return _value(self._readers[0], key)

    @property
    def chat_template(self) -> str | None:
        v = self.metadata("tokenizer.chat_template")
        return None if v is None else str(v)

    def tokenizer(self) -> Any:
        """A transformers fast tokenizer from `tokenizer.ggml.*`, chat template set."""
        return build_tokenizer(self.metadata, self.arch, str(self.path))

    def close(self) -> None:
        """Drops psr's references to the mapped files (numpy unmaps when the last view goes)."""
        self._experts.clear()
        self._dense_map = {}
        self._tensors.clear()
        self._readers.clear()


# --- tokenizer ----------------------------------------------------------------------------

_TOKENIZER_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
}
_SPECIAL = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


# llama.cpp pre-tokenizer names whose split is GPT-2's (transformers' default)
_GPT2_SPLIT = ("gpt-2", "default", "olmo", "phi-2", "roberta-bpe", None)


def build_tokenizer(meta: Callable[[str], Any], arch: str, where: str) -> Any:
    """transformers' GGUF tokenizer builders on the file's `tokenizer.ggml.*` keys."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        convert_gguf_tokenizer,
    )

    d = {hf: meta(f"tokenizer.ggml.{k}") for k, hf in _TOKENIZER_KEYS.items()}
    d = {k: v for k, v in d.items() if v is not None}
    if "tokens" not in d or "tokenizer_type" not in d:
        raise GGUFError(
            f"GGUF model {where} lacks 'tokenizer.ggml.tokens' / 'tokenizer.ggml.model'"
        )
    pre = d.get("pre_tokenizer_type")
    if d["tokenizer_type"] == "gpt2" and pre not in (*GGUF_PRE_TOKENIZER_SPLITS, *_GPT2_SPLIT):
        warnings.warn(
            f"GGUF model {where}: tokenizer.ggml.pre={pre!r} is not known to transformers' "
            "GGUF tokenizer builder; text is split with GPT-2's regex, which may not be the "
            "model's",
            stacklevel=2,
        )
    backend, _ = convert_gguf_tokenizer(arch, d)
    kw: dict[str, Any] = {}
    for name, key in _SPECIAL.items():
        i = meta(f"tokenizer.ggml.{key}")
        if i is not None:
            if not 0 <= int(i) < len(d["tokens"]):
                raise GGUFError(f"GGUF model {where}: tokenizer.ggml.{key}={i} is not a token id")
            kw[name] = d["tokens"][int(i)]
    for flag in ("add_bos_token", "add_eos_token"):
        v = meta(f"tokenizer.ggml.{flag}")
        if v is not None:
            kw[flag] = bool(v)
    template = meta("tokenizer.chat_template")
    if template is not None:
        kw["chat_template"] = str(template)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kw)


def layer_formats(ckpt: Any, E: int, H: int, F: int, moe_idx: list[int]) -> list[Any]:
    """Each MoE layer's row format (a blocks RowFormat, `gguf:GATE,UP,DOWN`), after
    checking its expert tensors' shapes ([E, F, H] gate and up, [E, H, F] down) and types
    against the config."""
    want = {"gate": (E, F, H), "up": (E, F, H), "down": (E, H, F)}
    out = []
    for d in moe_idx:
        parts = ckpt.expert_tensors(d)
        missing = [p for p in _EXPERT_PARTS if p not in parts]
        if missing:
            raise CheckpointError(
                f"{ckpt.path}: decoder layer {d} has no routed-expert {missing[0]} tensor "
                f"(blk.{d}.ffn_{missing[0]}_exps.weight)"
            )
        for p in _EXPERT_PARTS:
            t = parts[p]
            if tuple(t.shape) != want[p]:
                raise CheckpointError(
                    f"{ckpt.path}: tensor {t.name!r} has shape {list(t.shape)} "
                    f"(experts, out, in), expected {list(want[p])}"
                )
            if t.ggml_type not in GGML_TYPES:
                raise CheckpointError(
                    f"{ckpt.path}: tensor {t.name!r} is {t.ggml_type}, a type psr's expert "
                    f"kernels do not compute (supported: {', '.join(GGML_TYPES)})"
                )
        fmt = rowformat().RowFormat.blocks(*(parts[p].ggml_type for p in _EXPERT_PARTS))
        try:
            rowformat().GGMLLayout.of(fmt, H, F)
        except ValueError as e:
            raise CheckpointError(f"{ckpt.path}: decoder layer {d}: {e}") from None
        out.append(fmt)
    return out
