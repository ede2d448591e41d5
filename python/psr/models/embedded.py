"""The embedded default model: a small OLMoE trained on Shakespeare, shipped with psr
(weights, tokenizer, held-out text, training record, tuned operating points)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "default_model")


def heldout_text(path: str | Path) -> str:
    """The evaluation text shipped beside a model (`heldout.txt`): never trained on."""
    f = Path(path) / "heldout.txt"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: evaluation text for {path}")
    return f.read_text(encoding="utf-8")


def heldout_sets(path: str | Path) -> dict[str, tuple[str, str]]:
    """Two disjoint held-out sets, `{"A": (description, text), "B": (...)}`: operating
    points are selected on A and must replicate on B. For a model trained by
    scripts/train_default_model.py, whole plays (the first half of them in A, the rest in
    B, by `heldout_spans` in train_info.json); for any other model, the first and the
    second half of its heldout.txt."""
    text = heldout_text(path)
    info = Path(path) / "train_info.json"
    spans = json.loads(info.read_text()).get("heldout_spans") if info.is_file() else None
    if spans:
        names = list(spans)
        half = (len(names) + 1) // 2
        out = {}
        for key, group in (("A", names[:half]), ("B", names[half:])):
            parts = [text[spans[n][0] : spans[n][1]] for n in group]
            out[key] = (f"held-out set {key} ({', '.join(group)})", "\n\n".join(parts))
        return out
    mid = len(text) // 2
    cut = text.rfind("\n", 0, mid) + 1 or mid  # at a line break near the middle
    return {
        "A": ("held-out set A (first half of heldout.txt)", text[:cut]),
        "B": ("held-out set B (second half of heldout.txt)", text[cut:]),
    }


def tokenizer_of(path: str | Path) -> Any:
    """The model's tokenizer (a GGUF file's from its metadata)."""
    from psr.models.sources import tokenizer_of as of

    return of(path)
