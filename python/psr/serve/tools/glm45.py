"""GLM-4.5 (XML): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n
</tool_call>`, values as text (typed by the tool's schema)."""

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
_NAME = re.compile(r"([^\s<]+)\s")
_PARAM = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_END = re.compile(r"\s*</tool_call>")


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    read = xml_reader(tools, _NAME, _PARAM, _END, "</tool_call>", "<")
    return sections_scan(region, OPEN, read)


def section(tools: Sequence[Tool], parallel: bool) -> str:
    def param(key: str, value: str) -> str:
        head = lark_str(f"<arg_key>{key}</arg_key>\n<arg_value>")
        return f'{head} {value} "</arg_value>\\n"'

    calls = [f"{lark_str(t.name + chr(10))} {xml_param_rules(t, param, 'STR')}" for t in tools]
    one = 'call "</tool_call>"'
    return (
        f"section: {repeated(one, lark_str(chr(10) + OPEN), parallel)}\n"
        f"call: {alternatives(calls)}\n"
        "STR: /[^<]*/\n"
    )


FORMAT = ToolFormat("glm45", OPEN, (OPEN, "<arg_key>"), scan, section)
