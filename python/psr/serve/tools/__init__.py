"""Tool calls: one table of call formats by template family, the grammar that makes a
model's call well formed, and the stream that turns the model's text into content and
calls (no raw call markup ever reaches a client).

Each format is a small module (`FORMAT`: its marker, scanner and grammar); `FORMATS` is
the table, in the order `detect` tries their template signatures (the more specific
first: Qwen3-Coder and GLM-4.5 also write `<tool_call>`). Torch-free.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from psr.serve.tools import deepseek_v3, glm45, hermes, llama4, minimax_m2, mistral, qwen3_coder
from psr.serve.tools.base import Call, Scan, Tool, ToolFormat, lark_str

__all__ = [
    "FORMATS",
    "Call",
    "CallArgs",
    "CallStart",
    "Scan",
    "Text",
    "Tool",
    "ToolFormat",
    "ToolStream",
    "detect",
    "grammar",
    "held_prefix",
]

FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        qwen3_coder.FORMAT,
        glm45.FORMAT,
        minimax_m2.FORMAT,
        hermes.FORMAT,
        mistral.FORMAT,
        deepseek_v3.FORMAT,
        llama4.FORMAT,
    )
}


def detect(template: str | None) -> ToolFormat | None:
    """The format whose signature the chat template's text contains, or None."""
    if not template:
        return None
    for f in FORMATS.values():
        if all(s in template for s in f.signature):
            return f
    return None


def grammar(
    fmt: ToolFormat,
    tools: Sequence[Tool],
    forced: bool,
    parallel: bool,
    thinking: int | None = None,
) -> str:
    """The Lark grammar of a reply: `forced` (tool_choice required or named), one call or
    several and nothing else; else text, or text then the calls: the grammar is lazy, it
    constrains nothing until the text reaches the format's marker. `thinking`: the
    prompt opened a `<think>` block, which a forced reply closes first, or which ends at
    the marker after this many tokens (the reasoning budget)."""
    rules = fmt.section(tools, parallel)
    marker = lark_str(fmt.marker)
    head = "%llguidance {}\nTEXT: /(.|\\n)*/\n"
    if forced and thinking is not None:
        return (
            f'{head}start: thought "\\n"? {marker} section\n'
            f'thought[lazy, max_tokens={thinking}]: TEXT "</think>"\n'
            f"{rules}"
        )
    if forced:
        return f"{head}start: {marker} section\n{rules}"
    return f"{head}start: TEXT | trigger section\ntrigger[lazy]: TEXT {marker}\n{rules}"


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# ------------------------------------------------------------------ the stream


@dataclass(frozen=True)
class Text:
    """Text for the client: `kind` "content" or "reasoning"."""

    kind: str
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str  # the next piece of the call's arguments (JSON text)


Part = Text | CallStart | CallArgs


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolStream:
    """Content in, content and calls out. Text before the format's marker passes (less
    an end that may begin the marker); from the marker on the text is a call section,
    scanned again as it grows: a call shows once its name is known, then its arguments
    in pieces. `finish` ends it: markup that does not parse is content after all
    (`failed` says why)."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Tool]) -> None:
        self.fmt, self.tools = fmt, tuple(tools)
        self.held = ""  # text that may begin the marker
        self.region: str | None = None  # the call section, once the marker is seen
        self.sent: list[int] = []  # per call shown: how much of its arguments
        self.ids: list[str] = []
        self.failed: str | None = None

    @property
    def calls(self) -> int:
        return len(self.sent)

    def feed(self, text: str) -> list[Part]:
        if self.region is not None:
            self.region += text
            return self._calls(self.fmt.scan(self.region, self.tools))
        buf = self.held + text
        at = buf.find(self.fmt.marker)
        if at < 0:
            keep = held_prefix(buf, self.fmt.marker)
            self.held = buf[len(buf) - keep :]
            out = buf[: len(buf) - keep]
            return [Text("content", out)] if out else []
        self.held, self.region = "", buf[at:]
        parts: list[Part] = [Text("content", buf[:at])] if at else []
        return parts + self._calls(self.fmt.scan(self.region, self.tools))

    def _calls(self, scan: Scan) -> list[Part]:
        parts: list[Part] = []
        for i, call in enumerate(scan.calls):
            if i == len(self.sent):
                self.sent.append(0)
                self.ids.append(call_id())
                parts.append(CallStart(i, self.ids[i], call.name))
            piece = call.arguments[self.sent[i] :]
            if piece:
                self.sent[i] = len(call.arguments)
                parts.append(CallArgs(i, piece))
        return parts

    def finish(self) -> list[Part]:
        if self.region is None:
            out, self.held = self.held, ""
            return [Text("content", out)] if out else []
        scan = self.fmt.scan(self.region, self.tools)
        parts = self._calls(Scan(scan.calls))
        if scan.error is not None:
            self.failed = scan.error
            parts.append(Text("content", self.region[scan.error_at :]))
        elif scan.tail.strip():
            parts.append(Text("content", scan.tail))
        elif not scan.calls and self.region.strip():
            # The marker and nothing the format reads (cut off at max_tokens, or text).
            self.failed = "the call markup ended before a call"
            parts.append(Text("content", self.region))
        return parts
