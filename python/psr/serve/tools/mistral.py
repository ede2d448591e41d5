"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, one JSON list."""

from __future__ import annotations

from collections.abc import Sequence

from psr.serve.tools.base import (
    Call,
    Scan,
    Tool,
    ToolFormat,
    alternatives,
    json_call,
    lark_str,
    object_schema,
    params_schema,
    repeated,
    schema_rule,
)

OPEN = "[TOOL_CALLS]"


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    text = region[len(OPEN) :]
    lead = text.lstrip()
    if lead and lead[0] != "[":
        return Scan(error="[TOOL_CALLS] without a JSON list", error_at=0)
    pos = len(text) - len(lead) + 1
    calls: list[Call] = []
    while pos <= len(text):
        try:
            call, end = json_call(text[pos:])
        except ValueError as e:
            return Scan(tuple(calls), error=str(e), error_at=0)
        if end is None:
            return Scan(tuple(calls) + ((call,) if call is not None else ()))
        assert call is not None
        calls.append(call)
        rest = text[pos + end :].lstrip()
        if rest[:1] == "]":
            return Scan(tuple(calls), tail=rest[1:])
        if rest[:1] not in (",", ""):
            return Scan(tuple(calls), error="calls not separated by commas", error_at=0)
        pos = len(text) - len(rest) + 1
    return Scan(tuple(calls))


def section(tools: Sequence[Tool], parallel: bool) -> str:
    objs = [
        schema_rule(object_schema({"name": {"const": t.name}, "arguments": params_schema(t)}))
        for t in tools
    ]
    calls = repeated("call", lark_str(","), parallel)
    return f'section: "[" {calls} "]"\ncall: {alternatives(objs)}\n'


FORMAT = ToolFormat("mistral", OPEN, (OPEN,), scan, section)
