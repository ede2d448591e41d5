"""The embedded default model: a small OLMoE trained on Shakespeare, shipped with psr
(weights, tokenizer, held-out text, training record, tuned operating points)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "default_model")


def heldout_text(path: str | Path) -> str:
    """The evaluation text shipped beside a model (`heldout.txt`): never trained on."""
    f = Path(path) / "heldout.txt"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: evaluation text for {path}")
    return f.read_text(encoding="utf-8")


def tokenizer_of(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
