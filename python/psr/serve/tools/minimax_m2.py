"""MiniMax-M2 (XML): `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE
</parameter>\\n</invoke>\\n</minimax:tool_call>`, several invokes in one section."""

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

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = '<invoke name="'
_NAME = re.compile(r'([^"]+)">')
_PARAM = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>', re.S)
_END = re.compile(r"\s*</invoke>")


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    body = region[len(OPEN) :]
    close = body.find(CLOSE)
    inner = body if close < 0 else body[:close]

    read = xml_reader(tools, _NAME, _PARAM, _END, "</invoke>", ">")
    found = sections_scan(inner, _INVOKE, read)
    if found.error is not None:
        return Scan(found.calls, error=found.error, error_at=0)
    if close >= 0 and found.calls and not found.calls[-1].closed:
        return Scan(found.calls[:-1], error="an unfinished <invoke>", error_at=0)
    tail = found.tail + (body[close + len(CLOSE) :] if close >= 0 else "")
    return Scan(found.calls, tail=tail)


def section(tools: Sequence[Tool], parallel: bool) -> str:
    def param(key: str, value: str) -> str:
        return f'{lark_str(f"<parameter name={chr(34)}{key}{chr(34)}>")} {value} "</parameter>\\n"'

    calls = [
        f"{lark_str(f'<invoke name={chr(34)}{t.name}{chr(34)}>' + chr(10))} "
        f'{xml_param_rules(t, param, "STR")} "</invoke>"'
        for t in tools
    ]
    return (
        f"section: {lark_str(chr(10))} {repeated('call', lark_str(chr(10)), parallel)} "
        f"{lark_str(chr(10) + CLOSE)}\n"
        f"call: {alternatives(calls)}\n"
        "STR: /[^<]*/\n"
    )


FORMAT = ToolFormat("minimax_m2", OPEN, (OPEN,), scan, section)
