"""Qwen3-Coder (XML): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
</function>\\n</tool_call>`, values as text (typed by the tool's schema)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from psr.serve.tools.base import (
    Scan,
    Tool,
    ToolFormat,
    alternatives,
    lark_str,
    repeated,
    sections_scan,
    xml_param_rules,
    xml_reader,
)

OPEN = "<tool_call>"
_NAME = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_END = re.compile(r"\s*</function>\s*</tool_call>")


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    read = xml_reader(tools, _NAME, _PARAM, _END, "</tool_call>", ">")
    return sections_scan(region, OPEN, read)


def section(tools: Sequence[Tool], parallel: bool) -> str:
    def param(key: str, value: str) -> str:
        # No newline before the closing tag: a string value (STR) may end with one, and
        # a greedy lexer would take it, leaving the tag unreachable.
        return f'{lark_str(f"<parameter={key}>" + chr(10))} {value} "</parameter>\\n"'

    calls = [
        f"{lark_str(f'<function={t.name}>' + chr(10))} {xml_param_rules(t, param, 'STR')} "
        '"</function>"'
        for t in tools
    ]
    one = '"\\n" call "\\n</tool_call>"'
    return (
        f"section: {repeated(one, lark_str(chr(10) + OPEN), parallel)}\n"
        f"call: {alternatives(calls)}\n"
        "STR: /[^<]*/\n"
    )


FORMAT = ToolFormat("qwen3_coder", OPEN, (OPEN, "<function="), scan, section)
