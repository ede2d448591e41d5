"""What psr reads of a model path before loading it, whatever it is: a checkpoint folder
(config.json, tokenizer files) or a GGUF file / folder / split set (its metadata)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from psr.models.checkpoint import read_config
from psr.models.gguf_load import is_gguf, open_gguf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@contextmanager
def _gguf(path: str | Path) -> Iterator[Any]:
    ck = open_gguf(path)
    try:
        yield ck
    finally:
        ck.close()


def model_config(path: str | Path) -> dict[str, Any]:
    """The model's config as a config.json dict (a GGUF file's, built from its metadata)."""
    if is_gguf(path):
        with _gguf(path) as ck:
            return dict(ck.config_dict)
    return read_config(path)


def has_tokenizer(path: str | Path) -> bool:
    """The model ships a tokenizer (files beside a checkpoint, or GGUF metadata)."""
    if is_gguf(path):
        with _gguf(path) as ck:
            return bool(ck.metadata("tokenizer.ggml.model"))
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_of(path: str | Path) -> Any:
    """The model's tokenizer (transformers'; a GGUF file's built from its metadata)."""
    if is_gguf(path):
        with _gguf(path) as ck:
            return ck.tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def describe_missing_tokenizer(path: str | Path) -> str:
    """Where a tokenizer would have been looked for (for error messages)."""
    if is_gguf(path):
        return "no tokenizer.ggml.* metadata"
    return f"no tokenizer ({' or '.join(TOKENIZER_FILES)})"
