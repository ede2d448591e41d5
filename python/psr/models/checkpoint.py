"""Read a local Hugging Face checkpoint folder: config, (sharded) safetensors, memory-mapped.

Every tensor is located through the shard index and checked against its file's
size before use, so a missing shard, a truncated file or an absent tensor is an
error that names it. psr reads the headers itself and maps each file read-only and shared
(the safetensors library maps copy-on-write, which the kernel refuses for a file larger
than the memory it can commit); a tensor read is a copy of its bytes, the caller's own.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from psr.models.files import CheckpointError as CheckpointError  # its home: files.py


def dequantize_fp8_tiles(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 of a block-wise FP8 weight `[R, K]` and its `[ceil(R/128), ceil(K/128)]` scales
    (DeepSeek-V3's `weight_scale_inv`: w = code * scale of its 128 x 128 tile)."""
    R, K = codes.shape
    want = (-(-R // 128), -(-K // 128))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"an FP8 weight {[R, K]} needs scales {list(want)}, got {list(scale_inv.shape)}"
        )
    s = scale_inv.float().repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :K]
    return codes.float() * s


FLOAT_DTYPES = ("F64", "F32", "BF16", "F16", "F8_E4M3", "F8_E5M2")
# safetensors dtype names -> torch dtypes (those this torch has)
TORCH_DTYPES: dict[str, torch.dtype] = {
    k: getattr(torch, v)
    for k, v in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E8M0": "float8_e8m0fnu",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
    }.items()
    if hasattr(torch, v)
}


def _tensor_info(path: Path, name: str, info: Any) -> dict[str, Any]:
    """A header entry checked for what psr reads: dtype, shape, data_offsets."""
    ok = (
        isinstance(info, dict)
        and isinstance(info.get("dtype"), str)
        and isinstance(info.get("shape"), list)
        and all(isinstance(d, int) and d >= 0 for d in info["shape"])
        and isinstance(info.get("data_offsets"), list)
        and len(info["data_offsets"]) == 2
        and all(isinstance(o, int) and o >= 0 for o in info["data_offsets"])
    )
    if not ok:
        raise CheckpointError(
            f"corrupt safetensors file {path}: tensor {name!r} lacks a valid dtype, shape "
            "or data_offsets"
        )
    return dict(info)


def read_header(path: Path) -> dict:
    """A safetensors file's header, checked (JSON object, offsets inside the file).
    Error messages name the file and the problem, never its contents."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"corrupt safetensors file {path}: shorter than its header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(
                f"truncated or corrupt safetensors file {path}: its header length field "
                "exceeds the file size"
            )
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(
                f"corrupt safetensors file {path}: its header is not valid UTF-8 JSON"
            ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt safetensors file {path}: its header is not a JSON object")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = _tensor_info(path, name, info)["data_offsets"][1]
        if end > data:
            raise CheckpointError(
                f"truncated safetensors file {path}: tensor {name!r} needs bytes up to {end}, "
                f"file holds {data}"
            )
    return header


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is a file, not a folder")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"no config.json in {path}")
    try:
        out = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt config.json in {path}: {e}") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"corrupt config.json in {path}: not a JSON object")
    return out


def _index(path: Path) -> dict[str, str]:
    """weight_map of model.safetensors.index.json: tensor name -> shard file name, every
    shard inside the checkpoint folder (a name like ../../x is refused, never opened)."""
    index = path / "model.safetensors.index.json"
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"corrupt shard index {index}: not valid JSON") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
    ):
        raise CheckpointError(f"corrupt shard index {index}: no weight_map of names to files")
    root = path.resolve()
    for shard in set(wm.values()):
        target = (path / shard).resolve()
        if target.parent != root:
            raise CheckpointError(
                f"shard index {index} names {shard!r}, which is not a file in the checkpoint folder"
            )
    return wm


class Checkpoint:
    """Tensor names -> shard files of a checkpoint folder; tensors load lazily (mmap)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config_dict = read_config(self.path)
        if (self.path / "model.safetensors.index.json").is_file():
            weight_map = _index(self.path)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.path}")
            weight_map = {}
        self.files = files  # the safetensors files, inside the folder
        self._where: dict[str, str] = {}
        self._shapes: dict[str, list[int]] = {}
        self._dtypes: dict[str, str] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # absolute byte offset, bytes
        for name in files:
            f = self.path / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint shard {f} listed in the index is missing")
            header = read_header(f)
            with f.open("rb") as fh:
                data_start = 8 + struct.unpack("<Q", fh.read(8))[0]
            for tensor, info in header.items():
                if tensor != "__metadata__":
                    self._where[tensor] = name
                    self._shapes[tensor] = info["shape"]
                    self._dtypes[tensor] = info["dtype"]
                    a, b = info["data_offsets"]
                    self._spans[tensor] = (data_start + a, b - a)
        for tensor, name in weight_map.items():
            if self._where.get(tensor) != name:
                raise CheckpointError(f"tensor {tensor!r} listed in the index is not in {name}")
        self._open: dict[str, mmap.mmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> list[int]:
        return self._shapes[self._require(name)]

    def dtype(self, name: str) -> str:
        """The safetensors dtype string ('F32', 'BF16', 'F16', 'I8', 'BOOL', ...)."""
        return self._dtypes[self._require(name)]

    def require_float(self, name: str, what: str = "weight") -> None:
        """Refuse a non-floating tensor where weights are expected (never cast silently)."""
        if self.dtype(name) not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {self.path} has dtype {self.dtype(name)}; a {what} must be "
                f"floating point ({', '.join(FLOAT_DTYPES)})"
            )

    def _require(self, name: str) -> str:
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        return name

    def _bytes(self, name: str, i: int | None = None) -> torch.Tensor:
        """A copy of the bytes of tensor `name` (or of its row `i`) from the file's
        read-only shared map, as uint8."""
        path, off, n = self.span(name, i)
        m = self._open.get(path)
        if m is None:
            with open(path, "rb") as fh:
                m = self._open[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return torch.from_numpy(np.frombuffer(m, np.uint8, n, off).copy())

    def _typed(self, name: str, raw: torch.Tensor, shape: list[int]) -> torch.Tensor:
        dt = TORCH_DTYPES.get(self.dtype(name))
        if dt is None:
            raise CheckpointError(
                f"tensor {name!r} in {self.path} has dtype {self.dtype(name)}, which psr "
                f"does not read ({', '.join(TORCH_DTYPES)})"
            )
        return raw.view(dt).reshape(shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor; a block-wise FP8 weight (e4m3 with its `weight_scale_inv`) comes
        dequantized to fp32, and an FP8 weight without one is refused, never cast bare."""
        t = self.get_raw(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = f"{name}_scale_inv"
            if scale not in self._where:
                raise CheckpointError(
                    f"tensor {name!r} in {self.path} is FP8 without its {scale!r}: psr loads "
                    "block-wise FP8 (128 x 128 scales) and will not cast FP8 without its scales"
                )
            return dequantize_fp8_tiles(t, self.get_raw(scale))
        return t

    def get_raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (a copy: the file's map is read-only)."""
        return self._typed(name, self._bytes(name), self.shape(name))

    def get_row(self, name: str, i: int) -> torch.Tensor:
        """`tensor[i]` read on its own (one expert of a fused [E, ...] tensor)."""
        return self._typed(name, self._bytes(name, i), self.shape(name)[1:])

    def span(self, name: str, i: int | None = None) -> tuple[str, int, int]:
        """(file path, absolute byte offset, bytes) of tensor `name` as stored, or of its
        row `i` along the first dimension (one expert of a fused [E, ...] tensor)."""
        off, n = self._spans[self._require(name)]
        path = str(self.path / self._where[name])
        if i is None:
            return path, off, n
        rows = self._shapes[name][0]
        if not 0 <= i < rows:
            raise IndexError(f"row {i} out of range for {name!r} ({rows} rows)")
        return path, off + i * (n // rows), n // rows

    def first(self, *names: str) -> str | None:
        return next((n for n in names if n in self._where), None)

    def close(self) -> None:
        for m in self._open.values():
            m.close()  # nothing views it: every read was copied out
        self._open.clear()
