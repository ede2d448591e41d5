"""The user's tuning text (`psr tune --text FILE|DIR`): reading it, its deterministic split
into a selection set (A) and a replication set (B), and how many tokens a quality budget
needs.

A FILE is plain text, or JSONL (`.jsonl`: one JSON object per line with a string `text`
field); a DIR means its `.txt` and `.jsonl` files, in sorted order. Each file (or JSONL
record) is a document. The split keeps whole documents where it can, as the embedded
model's sets keep whole plays: A is the leading documents up to the document boundary
nearest the middle of the text, B the rest; when no boundary lies in the middle third (one
document, or a few of very unequal lengths) the text is cut at the line break nearest
before its middle, as any model's heldout.txt is (psr.models.embedded.heldout_sets).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = (".txt", ".jsonl")
# Each set's text needs enough decode-path tokens that the 95% interval of Δ nats/token of
# a point at the budget's edge is narrower than the budget. Per-window Δ has a variance
# about proportional to its mean (a sum of rare substituted-expert events): on the
# embedded model's selection sweep (bench/results/tune/select, 54 biased points) the
# variance of a 128-token window's mean Δ was 0.015-0.036 times its mean (median 0.023;
# 0.024-0.029 for the points near the 0.01 budget). Taken as 0.03 per 128 tokens, i.e.
# 3.84 per token: tokens >= (2 * 1.96)^2 * 3.84 / budget (5,900 for 0.01 nats/token).
DISPERSION = 3.84
Z95 = 1.959964
MIN_WINDOWS = 2


class TextError(ValueError):
    """The tuning text is missing, unreadable, empty, not UTF-8 or too short."""


class EmptyText(TextError):
    """The tuning text holds no text (check_sets' caller adds what the budget needs)."""


def _decode(f: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is UTF-8 too
    except UnicodeDecodeError as e:
        raise TextError(
            f"--text {f}: not UTF-8 (byte {e.start}: {data[e.start : e.start + 4]!r}); "
            "save it as UTF-8"
        ) from None


def _jsonl(f: Path, text: str) -> list[tuple[str, str]]:
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise TextError(f"--text {f}: line {i} is not JSON ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise TextError(f"--text {f}: line {i} has no string field 'text'")
        docs.append((f"{f.name}:{i}", rec["text"]))
    return docs


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise TextError(f"--text {path}: a folder without .txt or .jsonl files")
        return files
    if path.is_file():
        return [path]
    raise TextError(f"--text {path}: no such file or folder")


def read_documents(path: str | Path) -> list[tuple[str, str]]:
    """(name, text) of every non-empty document of a FILE or DIR, in order."""
    docs: list[tuple[str, str]] = []
    for f in _files(Path(path)):
        try:
            data = f.read_bytes()
        except OSError as e:
            raise TextError(f"--text {f}: cannot read: {e.strerror or e}") from None
        text = _decode(f, data)
        docs += _jsonl(f, text) if f.suffix == ".jsonl" else [(f.name, text)]
    docs = [(name, t) for name, t in docs if t.strip()]
    if not docs:
        raise EmptyText(f"--text {path}: no text (empty), 0 tokens")
    return docs


def _cut(docs: list[tuple[str, str]]) -> tuple[int | None, int]:
    """(documents in A, or None for a cut inside the text; the cut's character offset)."""
    sep = 2  # documents are joined by a blank line
    ends, pos = [], 0
    for _, t in docs[:-1]:
        pos += len(t)
        ends.append(pos)
        pos += sep
    total = pos + len(docs[-1][1])
    mid = total / 2
    if ends:
        i = min(range(len(ends)), key=lambda j: abs(ends[j] - mid))
        if total / 3 <= ends[i] <= 2 * total / 3:
            return i + 1, ends[i]
    text = "\n\n".join(t for _, t in docs)
    cut = text.rfind("\n", 0, int(mid)) + 1
    if cut < total / 3:  # no line break near the middle: a space, else the middle itself
        cut = text.rfind(" ", 0, int(mid)) + 1 or int(mid)
    return None, cut


def text_sets(path: str | Path) -> dict[str, tuple[str, str]]:
    """`{"A": (description, text), "B": (...)}` of the tuning text at `path` (the format of
    psr.models.embedded.heldout_sets). Each description names the source, a hash of its
    text, and what went where, so a selection is reused only on the same text's set A."""
    docs = read_documents(path)
    text = "\n\n".join(t for _, t in docs)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    k, cut = _cut(docs)
    head = f"{path} [sha256 {digest}]"
    if k is not None:
        n = len(docs)
        where = {"A": f"documents 1-{k} of {n}", "B": f"documents {k + 1}-{n} of {n}"}
    else:
        where = {"A": f"characters 0-{cut:,}", "B": f"characters {cut:,}-{len(text):,}"}
    return {
        "A": (f"set A of {head} ({where['A']})", text[:cut]),
        "B": (f"set B of {head} ({where['B']})", text[cut:].lstrip("\n")),
    }


def tokens_needed(budget: float) -> int:
    """Decode-path tokens per set for a 95% interval narrower than `budget` at its edge."""
    if not budget > 0:
        raise TextError(f"a budget of {budget:g} nats/token: no text makes the interval narrower")
    return math.ceil((2 * Z95) ** 2 * DISPERSION / budget)


def windows_needed(budget: float, scored_per_window: int) -> int:
    """Windows of `scored_per_window` decode-path tokens each set needs (tokens_needed; at
    least two: one window has no spread to make an interval of)."""
    return max(MIN_WINDOWS, math.ceil(tokens_needed(budget) / scored_per_window))


def needs(budget: float, window_tokens: int, prompt_tokens: int) -> str:
    """What a budget needs of each set, in words."""
    need = windows_needed(budget, window_tokens - prompt_tokens)
    per_set = need * window_tokens
    return (
        f"the {budget:g} nats/token budget needs {need} windows of {window_tokens} tokens in "
        f"each set ({per_set:,} per set, {2 * per_set:,} in all) for a 95% interval narrower "
        "than the budget"
    )


def check_sets(
    tokenizer: Any,
    sets: dict[str, tuple[str, str]],
    source: str,
    budget: float,
    windows: int,
    window_tokens: int,
    prompt_tokens: int,
) -> int:
    """The windows each set holds for the budget (at most `windows`); a TextError that says
    how many tokens the text has and how many the budget needs when it is too short."""
    need = windows_needed(budget, window_tokens - prompt_tokens)
    per_set = need * window_tokens
    if windows < need:
        raise TextError(
            f"--windows {windows}: the {budget:g} nats/token budget needs {need} windows per "
            f"set for a 95% interval narrower than it; pass --windows {need} or more, or a "
            "larger --budget"
        )
    have = {s: len(tokenizer(t)["input_ids"]) for s, (_, t) in sets.items()}
    short = sum(max(0, per_set - h) for h in have.values())
    if short:
        raise TextError(
            f"{source}: {sum(have.values()):,} tokens (set A {have['A']:,}, set B "
            f"{have['B']:,}); {needs(budget, window_tokens, prompt_tokens)}: about "
            f"{short:,} more tokens, or a larger --budget"
        )
    return min(windows, *(h // window_tokens for h in have.values()))
