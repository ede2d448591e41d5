"""Expert row formats: one table, one record per format (llama.cpp's per-type traits).

A slab (or host) row holds one expert's gate, up and down matrices, in one of these formats:

    format          rows                          kernels (constexpr)   CPU kernels (Fmt)
    native          float, the model's dtype      float rows            f32 / bf16 / f16
    bf16            float, bfloat16               float rows            bf16
    int8 fp8 int4   codes + fp32 scales (uint8)   quant, FMT = 0, 1, 2  int8, fp8, int4
    gguf:G,U,D      GGML blocks per part (uint8)  GGML, T_* = type ids  ggml + type ids

`RowFormat.parse` reads a format word (an option, checkpoint metadata) once, at the
boundary; everything below takes the `RowFormat`: its layout (`layout(H, F, group)`: bytes
per row and where each part sits), the CPU kernels' layout (`CpuLayout`, field for field
csrc/cpu/expert_gemv.h's `Layout`), the Triton kernels' flags (`code`, the block types'
ids) and the reference dequantizer (`dequantize`). GGML's block types have their own
traits (`BlockType`, `BLOCK_TYPE_TRAITS`), mirrored by csrc/cpu/ggml_dot.h's table (a test
checks the two agree). Nothing here imports torch or triton at module level.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import astuple, dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ALIGN = 16  # every part of a packed row starts at a multiple of this; rows are too
GROUP_SIZES = (16, 32, 64, 128, 256)  # int4's scale groups
PSR_OWN_TYPES = 200  # block type ids from here on are psr's own (no GGML type)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --------------------------------------------------------------------------- block types


@dataclass(frozen=True)
class BlockType:
    """Traits of one GGML block type: a row of K inputs is K / block_len blocks of
    block_bytes bytes (float types: blocks of one element)."""

    name: str
    type_id: int  # GGML's id (ggml.h); psr's own types from PSR_OWN_TYPES on
    block_len: int  # elements per block (QK)
    block_bytes: int  # bytes per block (BS)
    # The activations' block type on the CPU kernels' integer-dot path (llama.cpp's
    # vec_dot_type): Q8_K (GGML id 15) / Q8_0 (8), or F32 (0) where psr has no integer dot.
    vec_dot: int = 0
    # Rows a tile holds (1: rows as GGUF holds them). A tiled type's matrix has a multiple
    # of tile_rows rows, each tile the bytes of its rows permuted (the same bytes a row).
    tile_rows: int = 1

    @property
    def is_float(self) -> bool:
        return self.block_len == 1

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` inputs; `k` must fill whole blocks."""
        if k < 1 or k % self.block_len:
            raise ValueError(
                f"a {self.name} row holds whole blocks of {self.block_len} values; "
                f"{k} inputs do not"
            )
        return k // self.block_len * self.block_bytes


_BLOCK_TYPES = (
    BlockType("F32", 0, 1, 4),
    BlockType("F16", 1, 1, 2),
    BlockType("Q4_0", 2, 32, 18),
    BlockType("Q4_1", 3, 32, 20),
    BlockType("Q5_0", 6, 32, 22),
    BlockType("Q5_1", 7, 32, 24),
    BlockType("Q8_0", 8, 32, 34, vec_dot=8),
    BlockType("Q2_K", 10, 256, 84),
    BlockType("Q3_K", 11, 256, 110),
    BlockType("Q4_K", 12, 256, 144, vec_dot=15),
    BlockType("Q5_K", 13, 256, 176, vec_dot=15),
    BlockType("Q6_K", 14, 256, 210, vec_dot=15),
    BlockType("IQ2_XXS", 16, 256, 66),
    BlockType("IQ2_XS", 17, 256, 74),
    BlockType("IQ3_XXS", 18, 256, 98),
    BlockType("IQ1_S", 19, 256, 50),
    BlockType("IQ4_NL", 20, 32, 18),
    BlockType("IQ3_S", 21, 256, 110),
    BlockType("IQ2_S", 22, 256, 82),
    BlockType("IQ4_XS", 23, 256, 136),
    BlockType("IQ1_M", 29, 256, 56),
    BlockType("BF16", 30, 1, 2),
    BlockType("MXFP4", 39, 32, 17),
    # psr's own block (no GGML type): a checkpoint's block-wise FP8 (DeepSeek-V3 / R1,
    # Qwen3-FP8: e4m3 codes, one fp32 scale per 128 x 128 tile) as a block of 128 codes
    # along the row behind their tile's scale, so each row holds its own scales.
    BlockType("FP8_B128", 200, 128, 132),
    # psr's own: Q4_K rows in tiles of 8 for the CPU kernels (csrc/cpu/expert_gemv.h's
    # tile_q4k: one row a vector lane). Only the CPU kernels and the reference read it.
    BlockType("Q4_K_X8", 201, 256, 144, vec_dot=15, tile_rows=8),
)
BLOCK_TYPE_TRAITS: Mapping[str, BlockType] = MappingProxyType({b.name: b for b in _BLOCK_TYPES})
BLOCK_TYPES: tuple[str, ...] = tuple(
    b.name for b in _BLOCK_TYPES if b.tile_rows == 1
)  # every block type the kernels (Triton and CPU) compute row by row
# A type's tiled twin (the CPU kernels' layout of the same blocks).
TILED_TYPES: Mapping[str, str] = MappingProxyType({"Q4_K": "Q4_K_X8"})
UNTILED_TYPES: Mapping[str, str] = MappingProxyType({v: k for k, v in TILED_TYPES.items()})
GGML_TYPES: tuple[str, ...] = tuple(
    b.name for b in _BLOCK_TYPES if b.type_id < PSR_OWN_TYPES
)  # GGUF's


def block_type(op: str, type_name: str) -> BlockType:
    """The traits of `type_name` (ValueError naming `op` for a type psr does not compute)."""
    if type_name not in BLOCK_TYPE_TRAITS:
        raise ValueError(
            f"{op}: GGML type {type_name!r} is not one psr's expert kernels compute "
            f"(supported: {', '.join(BLOCK_TYPES)})"
        )
    return BLOCK_TYPE_TRAITS[type_name]


# --------------------------------------------------------------------------- formats


class RowKind(enum.Enum):
    FLOAT = "float"  # gate, up, down back to back in a float dtype (any shape)
    QUANT = "quant"  # psr's codes with fp32 scales (int8, fp8, int4)
    BLOCKS = "blocks"  # GGML blocks as a GGUF file holds them, a type per part


# The CPU kernels' `Fmt` (csrc/cpu/expert_gemv.h) of float rows, by dtype name.
CPU_FLOAT_FMT: Mapping[str, int] = MappingProxyType({"float32": 0, "bfloat16": 1, "float16": 2})
FLOAT_ITEMSIZE: Mapping[str, int] = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2})
CPU_GGML_FMT = 6  # Fmt::ggml: a block type per part
GGML_PREFIX = "gguf:"


@dataclass(frozen=True)
class RowFormat:
    """One expert row format (see the module doc). Compare formats, never their names."""

    name: str  # the word options and metadata use ("native", "int4", "gguf:Q4_K,Q4_K,Q6_K")
    kind: RowKind
    dtype: str | None = None  # float rows: the store dtype (None: the model's own)
    code: int = -1  # quant: the Triton kernels' FMT constexpr
    cpu_code: int = -1  # quant / blocks: the CPU kernels' Fmt (float rows: CPU_FLOAT_FMT)
    qmax: float = 0.0  # quant: the largest code magnitude
    grouped: bool = False  # quant: scales per group along the input dim, two codes a byte
    types: tuple[BlockType, BlockType, BlockType] | None = None  # blocks: gate, up, down

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"RowFormat({self.name!r})"

    @property
    def is_float(self) -> bool:
        return self.kind is RowKind.FLOAT

    @property
    def is_quant(self) -> bool:
        return self.kind is RowKind.QUANT

    @property
    def is_blocks(self) -> bool:
        return self.kind is RowKind.BLOCKS

    @property
    def kernel_fmt(self) -> str | None:
        """The expert kernels' `fmt` word of these rows (None: float rows)."""
        return None if self.is_float else self.name

    @property
    def block_types(self) -> tuple[BlockType, BlockType, BlockType]:
        """Each part's block type (ValueError for rows that are not GGML blocks)."""
        if self.types is None:
            raise ValueError(
                f"{self.name!r} is not a GGML row format: expected 'gguf:GATE,UP,DOWN'"
            )
        return self.types

    @property
    def shown(self) -> str:
        """How reports name the format ("Q4_K,Q4_K,Q6_K" for GGUF's blocks)."""
        if self.types is None:
            return self.name
        return ",".join(t.name for t in self.types)

    @staticmethod
    def parse(value: RowFormat | str | None) -> RowFormat:
        """The format of an option or metadata word: None or "native", "bf16", one of
        QUANT_FORMATS, or "gguf:GATE,UP,DOWN" (a RowFormat is returned as it is)."""
        if isinstance(value, RowFormat):
            return value
        if value is None:
            return NATIVE
        if isinstance(value, str) and value in _FIXED:
            return _FIXED[value]
        if isinstance(value, str) and value.startswith(GGML_PREFIX):
            return _blocks_format(value)
        raise ValueError(
            f"expert_format must be one of {', '.join(_FIXED)} or 'gguf:GATE,UP,DOWN'; "
            f"got {value!r}"
        )

    @staticmethod
    def of_kernel(op: str, value: RowFormat | str | None) -> RowFormat:
        """The format of the expert kernels' `fmt` argument: None (float rows), a quantized
        format's name, a GGML row format, or a RowFormat."""
        if isinstance(value, RowFormat) or value is None:
            return RowFormat.parse(value)
        if isinstance(value, str) and value.startswith(GGML_PREFIX):
            return _blocks_format(value)
        if isinstance(value, str) and value in QUANT_FORMATS:
            return _FIXED[value]
        raise ValueError(
            f"{op}: fmt must be None (float slab rows), one of "
            f"{', '.join(map(repr, QUANT_FORMATS))} or a GGML row format 'gguf:GATE,UP,DOWN', "
            f"got {value!r}"
        )

    @staticmethod
    def blocks(gate: str, up: str, down: str) -> RowFormat:
        """The format of rows whose gate, up, down parts are in these block types."""
        for t in (gate, up, down):
            block_type("ggml_format", t)
        return _blocks_format(f"{GGML_PREFIX}{gate},{up},{down}")

    @property
    def has_tiles(self) -> bool:
        """Whether a part is in tiles of rows (the CPU kernels' layout only)."""
        return self.types is not None and any(t.tile_rows > 1 for t in self.types)

    def tiled(self, hidden_size: int, ffn_size: int) -> RowFormat:
        """These rows with each part that has a tiled twin (TILED_TYPES) in it, where the
        part's rows (gate / up: F, down: H) fill whole tiles; other formats unchanged."""
        if self.types is None:
            return self
        rows = (ffn_size, ffn_size, hidden_size)
        names: list[str] = []
        for t, n in zip(self.types, rows, strict=True):
            twin = TILED_TYPES.get(t.name)
            if twin is not None and n % BLOCK_TYPE_TRAITS[twin].tile_rows == 0:
                names.append(twin)
            else:
                names.append(t.name)
        return RowFormat.blocks(*names)

    def untiled(self) -> RowFormat:
        """These rows as GGUF holds them (each tiled part's own type)."""
        if not self.has_tiles:
            return self
        assert self.types is not None
        return RowFormat.blocks(*(UNTILED_TYPES.get(t.name, t.name) for t in self.types))

    def layout(self, hidden_size: int, ffn_size: int, group_size: int = 128) -> RowLayout:
        """Where each part of an expert of hidden size H and ffn size F sits in a row
        (`group_size`: int4's scale group; unused otherwise)."""
        return _layout(self, int(hidden_size), int(ffn_size), int(group_size))

    def row_bytes(
        self, hidden_size: int, ffn_size: int, group_size: int = 128, itemsize: int = 2
    ) -> int:
        """Bytes of one expert row (`itemsize`: the model dtype's, for native float rows)."""
        lay = self.layout(hidden_size, ffn_size, group_size)
        if not isinstance(lay, FloatLayout):
            return lay.nbytes
        return lay.row * (FLOAT_ITEMSIZE[self.dtype] if self.dtype else itemsize)

    def cpu_layout(
        self, dtype: torch.dtype, hidden: int, ffn: int, group_size: int, row_bytes: int
    ) -> CpuLayout:
        """The CPU kernels' layout of rows of this format (float rows of `dtype`) that
        hold `row_bytes` bytes (ValueError if they disagree or the kernels lack it)."""
        return self.layout(hidden, ffn, group_size).cpu_layout(
            str(dtype).removeprefix("torch."), row_bytes
        )


FormatLike = RowFormat | str | None  # a format or its word (None: float rows), at a boundary

NATIVE = RowFormat("native", RowKind.FLOAT)
BF16 = RowFormat("bf16", RowKind.FLOAT, dtype="bfloat16")
INT8 = RowFormat("int8", RowKind.QUANT, code=0, cpu_code=3, qmax=127.0)
FP8 = RowFormat("fp8", RowKind.QUANT, code=1, cpu_code=4, qmax=448.0)
INT4 = RowFormat("int4", RowKind.QUANT, code=2, cpu_code=5, qmax=7.0, grouped=True)
_FIXED: Mapping[str, RowFormat] = MappingProxyType(
    {f.name: f for f in (NATIVE, BF16, INT8, FP8, INT4)}
)
QUANT_FORMATS: tuple[str, ...] = tuple(f.name for f in _FIXED.values() if f.is_quant)
EXPERT_FORMATS: tuple[str, ...] = tuple(_FIXED)  # the words psr.load's expert_format takes


def quant_format(op: str, value: RowFormat | str) -> RowFormat:
    """A quantized format (int8, fp8, int4) from its name or itself."""
    f = _FIXED.get(value) if isinstance(value, str) else value
    if not isinstance(f, RowFormat) or not f.is_quant:
        raise ValueError(
            f"{op}: fmt must be one of {', '.join(map(repr, QUANT_FORMATS))}, got {value!r}"
        )
    return f


def is_ggml_format(fmt: object) -> bool:
    """A GGML row format's word ("gguf:...") or RowFormat."""
    if isinstance(fmt, RowFormat):
        return fmt.is_blocks
    return isinstance(fmt, str) and fmt.startswith(GGML_PREFIX)


def blocks_format(value: RowFormat | str) -> RowFormat:
    """A GGML row format from its word ("gguf:GATE,UP,DOWN") or itself."""
    if isinstance(value, RowFormat):
        _ = value.block_types  # raises for rows that are not GGML blocks
        return value
    return _blocks_format(value)


@functools.lru_cache(maxsize=256)
def _blocks_format(word: str) -> RowFormat:
    parts = word[len(GGML_PREFIX) :].split(",") if word.startswith(GGML_PREFIX) else []
    if len(parts) != 3 or any(p not in BLOCK_TYPE_TRAITS for p in parts):
        raise ValueError(
            f"{word!r} is not a GGML row format: expected 'gguf:GATE,UP,DOWN' with types from "
            f"{', '.join(BLOCK_TYPES)}"
        )
    g, u, d = (BLOCK_TYPE_TRAITS[p] for p in parts)
    return RowFormat(word, RowKind.BLOCKS, cpu_code=CPU_GGML_FMT, types=(g, u, d))


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class CpuLayout:
    """csrc/cpu/expert_gemv.h's `Layout`, field for field and in its order (the bindings
    read `ints()` positionally; `_C.cpu_layout_fields()` names them: a test compares)."""

    fmt: int  # Fmt
    hidden: int
    ffn: int
    gate: int  # byte offsets of the parts
    up: int
    down: int
    gate_s: int  # quant: the scales'
    up_s: int
    down_s: int
    rb_h: int  # bytes per gate/up row, per down row
    rb_f: int
    group_h: int  # scale groups (elements)
    group_f: int
    row_bytes: int
    t_gate: int = 0  # blocks: each part's type id
    t_up: int = 0
    t_down: int = 0
    rb_up: int = 0  # blocks: bytes per up row (rb_h: gate's)

    def ints(self) -> tuple[int, ...]:
        """The integers the bindings take: 14, or 18 for GGML blocks (their types)."""
        t = astuple(self)
        return t if self.fmt == CPU_GGML_FMT else t[:14]


def _check_row_bytes(want: int, row_bytes: int, what: str) -> None:
    if want != row_bytes:
        raise ValueError(f"cpu_expert_ffn: rows hold {row_bytes} bytes, expected {want} ({what})")


@dataclass(frozen=True)
class FloatLayout:
    """Float rows: gate [F, H], up [F, H], down [H, F] back to back (element offsets)."""

    fmt: RowFormat
    hidden_size: int
    ffn_size: int

    @property
    def gate(self) -> int:
        return 0

    @property
    def up(self) -> int:
        return self.hidden_size * self.ffn_size

    @property
    def down(self) -> int:
        return 2 * self.hidden_size * self.ffn_size

    @property
    def row(self) -> int:
        """Elements in a row: 3 * H * F."""
        return 3 * self.hidden_size * self.ffn_size

    def cpu_layout(self, dtype: str, row_bytes: int) -> CpuLayout:
        if dtype not in CPU_FLOAT_FMT:
            raise ValueError(
                f"cpu_expert_ffn: float rows must be float32, bfloat16 or float16, got {dtype}"
            )
        H, F = self.hidden_size, self.ffn_size
        isz = FLOAT_ITEMSIZE[dtype]
        fh = H * F * isz
        return CpuLayout(
            CPU_FLOAT_FMT[dtype], H, F, 0, fh, 2 * fh, 0, 0, 0, H * isz, F * isz, H, F, row_bytes
        )


@dataclass(frozen=True)
class QuantLayout:
    """Byte offsets and sizes of the parts of one quantized expert's slab row."""

    fmt: RowFormat
    hidden_size: int
    ffn_size: int
    group_h: int  # scale group along H (gate/up input dim); = H for int8/fp8
    group_f: int  # scale group along F (down input dim); = F for int8/fp8
    gate: int  # byte offsets of the parts ...
    up: int
    down: int
    gate_scale: int
    up_scale: int
    down_scale: int
    row_bytes_h: int  # bytes per gate/up row (B(H))
    row_bytes_f: int  # bytes per down row (B(F))
    nbytes: int  # row length, a multiple of 16

    @property
    def groups_h(self) -> int:
        return self.hidden_size // self.group_h

    @property
    def groups_f(self) -> int:
        return self.ffn_size // self.group_f

    @classmethod
    def of(
        cls, fmt: RowFormat | str, hidden_size: int, ffn_size: int, group_size: int = 128
    ) -> QuantLayout:
        """The layout of `fmt` for an expert of hidden size H and ffn size F.

        `group_size` matters for int4 only. Raises ValueError for an unknown format, a
        non-positive size, or an int4 group that is not a power of two in [16, 256] or
        does not divide H (or F) where that dim is at least one group long.
        """
        return quant_layout("QuantLayout", fmt, hidden_size, ffn_size, group_size)

    def cpu_layout(self, dtype: str, row_bytes: int) -> CpuLayout:
        H, F = self.hidden_size, self.ffn_size
        _check_row_bytes(
            self.nbytes, row_bytes, f"{self.fmt}, H={H}, F={F}, group_size={self.group_h}"
        )
        return CpuLayout(
            self.fmt.cpu_code, H, F, self.gate, self.up, self.down, self.gate_scale,
            self.up_scale, self.down_scale, self.row_bytes_h, self.row_bytes_f, self.group_h,
            self.group_f, row_bytes,
        )  # fmt: skip


def quant_layout(
    op: str, fmt: RowFormat | str, hidden_size: int, ffn_size: int, group_size: int
) -> QuantLayout:
    """`QuantLayout.of`, its errors prefixed by `op`."""
    f = quant_format(op, fmt)
    H, F = int(hidden_size), int(ffn_size)
    if H < 1 or F < 1:
        raise ValueError(f"{op}: hidden_size and ffn_size must be positive, got {H}, {F}")
    if f.grouped:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"{op}: {f} group_size must be one of {GROUP_SIZES}, got {group_size}")
        gh, gf = min(group_size, H), min(group_size, F)
        for name, dim, g in (("hidden_size", H, gh), ("ffn_size", F, gf)):
            if dim % g:
                raise ValueError(
                    f"{op}: {f} group_size {g} must divide {name} {dim} (or exceed it: "
                    f"then one group spans the row)"
                )
        rbh, rbf = (H + 1) // 2, (F + 1) // 2
    else:
        gh, gf = H, F
        rbh, rbf = H, F
    sizes = [F * rbh, F * rbh, H * rbf, 4 * F * (H // gh), 4 * F * (H // gh), 4 * H * (F // gf)]
    offs, at = [], 0
    for s in sizes:
        offs.append(at)
        at = align(at + s)
    gate, up, down, gate_scale, up_scale, down_scale = offs
    return QuantLayout(
        f, H, F, gh, gf, gate, up, down, gate_scale, up_scale, down_scale, rbh, rbf, at
    )


@dataclass(frozen=True)
class GGMLLayout:
    """Byte offsets of one expert's parts in a slab row of GGML blocks."""

    fmt: RowFormat
    hidden_size: int
    ffn_size: int
    types: tuple[str, str, str]  # gate, up, down
    gate: int
    up: int
    down: int
    rb_gate: int  # bytes per row of each part
    rb_up: int
    rb_down: int
    nbytes: int  # row length, a multiple of 16

    @property
    def part_bytes(self) -> tuple[int, int, int]:
        """Bytes of the gate, up and down matrices (without the alignment padding)."""
        F, H = self.ffn_size, self.hidden_size
        return F * self.rb_gate, F * self.rb_up, H * self.rb_down

    @property
    def type_ids(self) -> tuple[int, int, int]:
        """Each part's block type id: the kernels' T_GATE, T_UP, T_DOWN."""
        g, u, d = (BLOCK_TYPE_TRAITS[t].type_id for t in self.types)
        return g, u, d

    @property
    def triton_type_ids(self) -> tuple[int, int, int]:
        """type_ids for the Triton kernels (ValueError for parts in CPU tiles)."""
        if self.fmt.has_tiles:
            raise ValueError(
                f"expert rows {self.fmt} are in the CPU kernels' tiles; the Triton kernels "
                f"take {self.fmt.untiled()}"
            )
        return self.type_ids

    @classmethod
    def of(cls, fmt: RowFormat | str, hidden_size: int, ffn_size: int) -> GGMLLayout:
        return _ggml_layout(blocks_format(fmt), int(hidden_size), int(ffn_size))

    def cpu_layout(self, dtype: str, row_bytes: int) -> CpuLayout:
        H, F = self.hidden_size, self.ffn_size
        _check_row_bytes(self.nbytes, row_bytes, f"{self.fmt}, H={H}, F={F}")
        tg, tu, td = self.type_ids
        return CpuLayout(
            CPU_GGML_FMT, H, F, self.gate, self.up, self.down, 0, 0, 0, self.rb_gate,
            self.rb_down, H, F, row_bytes, tg, tu, td, self.rb_up,
        )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _ggml_layout(f: RowFormat, H: int, F: int) -> GGMLLayout:
    types = f.block_types
    if H < 1 or F < 1:
        raise ValueError(f"GGMLLayout: hidden_size and ffn_size must be positive, got {H}, {F}")
    rbs = []
    for part, t, k in (("gate", types[0], H), ("up", types[1], H), ("down", types[2], F)):
        try:
            rbs.append(t.row_bytes(k))
        except ValueError as e:
            raise ValueError(f"GGMLLayout: expert {part} rows: {e}") from None
    offs, at = [], 0
    for rows, rb in zip((F, F, H), rbs, strict=True):
        offs.append(at)
        at = align(at + rows * rb)
    tg, tu, td = (t.name for t in types)
    return GGMLLayout(f, H, F, (tg, tu, td), offs[0], offs[1], offs[2], rbs[0], rbs[1], rbs[2], at)


RowLayout = FloatLayout | QuantLayout | GGMLLayout


@functools.lru_cache(maxsize=256)
def _layout(f: RowFormat, H: int, F: int, group_size: int) -> RowLayout:
    if f.is_blocks:
        return _ggml_layout(f, H, F)
    if f.is_quant:
        return quant_layout("QuantLayout", f, H, F, group_size)
    return FloatLayout(f, H, F)
