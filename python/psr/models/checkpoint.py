"""Read a local Hugging Face checkpoint folder: config, (sharded) safetensors, memory-mapped.

Every tensor is located through the shard index and checked against its file's
size before use, so a missing shard, a truncated file or an absent tensor is an
error that names it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint folder, file or tensor is missing or corrupt."""


def _read_header(path: Path) -> dict:
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise CheckpointError(f"truncated safetensors file {path} (header of {n} bytes)")
            header = json.loads(f.read(n))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from None
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info["data_offsets"][1]
        if end > data:
            raise CheckpointError(
                f"truncated safetensors file {path}: tensor {name!r} needs bytes up to {end}, "
                f"file holds {data}"
            )
    return header


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint folder."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"no config.json in {path}")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt config.json in {path}: {e}") from None


class Checkpoint:
    """Tensor names -> shard files of a checkpoint folder; tensors load lazily (mmap)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config_dict = read_config(self.path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.path}")
            weight_map = {}
        self._where: dict[str, str] = {}
        self._shapes: dict[str, list[int]] = {}
        for name in files:
            f = self.path / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint shard {f} listed in the index is missing")
            for tensor, info in _read_header(f).items():
                if tensor != "__metadata__":
                    self._where[tensor] = name
                    self._shapes[tensor] = info["shape"]
        for tensor, name in weight_map.items():
            if self._where.get(tensor) != name:
                raise CheckpointError(f"tensor {tensor!r} listed in the index is not in {name}")
        self._open: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> list[int]:
        return self._shapes[self._require(name)]

    def _require(self, name: str) -> str:
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        return name

    def _handle(self, name: str):
        file = self._where[self._require(name)]
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt")
        return self._open[file]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_row(self, name: str, i: int) -> torch.Tensor:
        """`tensor[i]` read on its own (one expert of a fused [E, ...] tensor)."""
        return self._handle(name).get_slice(name)[i]

    def first(self, *names: str) -> str | None:
        return next((n for n in names if n in self._where), None)

    def close(self) -> None:
        self._open.clear()
