"""Torch-free facts about checkpoint files: the checkpoint error and what a GGUF path is
(a GGUF header is read without torch: `psr inspect`)."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint folder, file or tensor is missing or corrupt."""


def is_gguf(path: str | Path) -> bool:
    """A .gguf file, or a folder without config.json that holds .gguf files."""
    p = Path(path)
    if p.is_file() or p.suffix == ".gguf":
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))
