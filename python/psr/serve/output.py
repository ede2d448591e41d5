"""The model's text into what a client sees: reasoning (`<think>` ... `</think>`),
content, and tool calls (the template family's format, never shown as markup).

`Output.feed` takes each streamed delta of text and returns parts; `finish` the rest.
Whole responses run the same parser over the whole text, so streamed and whole replies
agree. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from psr.serve.tools import CallArgs, CallStart, Part, Text, ToolFormat, ToolStream, held_prefix
from psr.serve.tools.base import Tool

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Reasoning:
    """`<think>` ... `</think>` at the start of a reply as reasoning, the rest content.
    `inside`: the prompt opened the block (DeepSeek-R1's and some Qwen3 templates end
    the generation prompt with `<think>`), so the reply starts in it."""

    def __init__(self, inside: bool, ends: tuple[str, ...] = ()) -> None:
        self.state = "inside" if inside else "start"
        self.held = ""
        self.ends = ends  # markers that end reasoning unclosed (a call cut the budget)

    def feed(self, text: str) -> list[Text]:
        buf, self.held = self.held + text, ""
        out: list[Text] = []
        while buf:
            if self.state == "start":
                lead = buf.lstrip()
                if THINK_OPEN.startswith(lead):  # "" or a part of the tag: wait
                    self.held = buf
                    break
                if lead.startswith(THINK_OPEN):
                    self.state, buf = "inside", lead[len(THINK_OPEN) :]
                else:
                    self.state = "content"
            elif self.state == "inside":
                found = [(i, m) for m in (THINK_CLOSE, *self.ends) if (i := buf.find(m)) >= 0]
                if not found:
                    keep = max(held_prefix(buf, m) for m in (THINK_CLOSE, *self.ends))
                    self.held = buf[len(buf) - keep :]
                    if len(buf) > keep:
                        out.append(Text("reasoning", buf[: len(buf) - keep]))
                    break
                at, end = min(found)
                if at:
                    out.append(Text("reasoning", buf[:at]))
                if end == THINK_CLOSE:
                    self.state, buf = "after", buf[at + len(THINK_CLOSE) :]
                else:  # the call begins: it is content's, whole
                    self.state, buf = "content", buf[at:]
            elif self.state == "after":  # the blank lines after the block
                lead = buf.lstrip()
                if not lead:
                    break
                self.state, buf = "content", lead
            else:
                out.append(Text("content", buf))
                break
        return out

    def finish(self) -> list[Text]:
        out, self.held = self.held, ""
        if not out or self.state == "after":
            return []
        return [Text("reasoning" if self.state == "inside" else "content", out)]


class Output:
    """Reasoning first (where the template has it), then content and calls."""

    def __init__(
        self,
        tool_format: ToolFormat | None = None,
        tools: Sequence[Tool] = (),
        reasoning: bool = False,
        inside: bool = False,
    ) -> None:
        ends = (tool_format.marker,) if tool_format is not None and tools else ()
        self.reasoning = Reasoning(inside, ends) if reasoning else None
        self.tools = ToolStream(tool_format, tools) if tool_format is not None and tools else None

    @property
    def calls(self) -> int:
        return 0 if self.tools is None else self.tools.calls

    @property
    def failed(self) -> str | None:
        """Why call markup was returned as content, if it was."""
        return None if self.tools is None else self.tools.failed

    def feed(self, text: str) -> list[Part]:
        texts = self.reasoning.feed(text) if self.reasoning else [Text("content", text)]
        return self._content(texts)

    def finish(self) -> list[Part]:
        texts = self.reasoning.finish() if self.reasoning else []
        out = self._content(texts)
        if self.tools is not None:
            out += self.tools.finish()
        return out

    def _content(self, texts: list[Text]) -> list[Part]:
        out: list[Part] = []
        for t in texts:
            if t.kind == "content" and self.tools is not None:
                out += self.tools.feed(t.text)
            elif t.text:
                out.append(t)
        return out


def merged(parts: Sequence[Part]) -> tuple[str, str, list[tuple[str, str, str]]]:
    """A whole reply's reasoning, content and calls (id, name, arguments)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[list[str]] = []
    for p in parts:
        if isinstance(p, Text):
            (reasoning if p.kind == "reasoning" else content).append(p.text)
        elif isinstance(p, CallStart):
            calls.append([p.id, p.name, ""])
        elif isinstance(p, CallArgs):
            calls[p.index][2] += p.text
    return "".join(reasoning), "".join(content), [(i, n, a) for i, n, a in calls]
