"""Qwen3-Coder (XML): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
</function>\\n</tool_call>`, values as text (typed by the tool's schema)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from psr.serve.tools.base import (
    Call,
    Scan,
    Tool,
    ToolFormat,
    alternatives,
    lark_str,
    repeated,
    sections_scan,
    xml_call,
    xml_param_rules,
)

OPEN = "<tool_call>"
_NAME = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_END = re.compile(r"\s*</function>\s*</tool_call>")


def _one(tools: Sequence[Tool]) -> Callable[[str, int], tuple[Call | None, int | None]]:
    def read(region: str, at: int) -> tuple[Call | None, int | None]:
        m = _NAME.match(region, at)
        if m is None:
            if "</tool_call>" in region[at:] or ">" in region[at:]:
                raise ValueError("a <tool_call> without <function=NAME>")
            return None, None
        call, end = xml_call(region[m.end() :], m.group(1), tools, _PARAM, _END, "</tool_call>")
        return call, None if end is None else m.end() + end

    return read


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    return sections_scan(region, OPEN, _one(tools))


def section(tools: Sequence[Tool], parallel: bool) -> str:
    def param(key: str, value: str) -> str:
        # No newline before the closing tag: a string value (STR) may end with one, and
        # a greedy lexer would take it, leaving the tag unreachable.
        return f'{lark_str(f"<parameter={key}>" + chr(10))} {value} "</parameter>\\n"'

    calls = [
        f"{lark_str(f'<function={t.name}>' + chr(10))} {xml_param_rules(t, i, param, 'STR')} "
        '"</function>"'
        for i, t in enumerate(tools)
    ]
    one = '"\\n" call "\\n</tool_call>"'
    return (
        f"section: {repeated(one, lark_str(chr(10) + OPEN), parallel)}\n"
        f"call: {alternatives(calls)}\n"
        "STR: /[^<]*/\n"
    )


FORMAT = ToolFormat("qwen3_coder", OPEN, (OPEN, "<function="), scan, section)
