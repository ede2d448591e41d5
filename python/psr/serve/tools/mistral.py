"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, one JSON list."""

from __future__ import annotations

from collections.abc import Sequence

from psr.serve.tools.base import (
    Scan,
    Tool,
    ToolFormat,
    alternatives,
    json_calls,
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
    if not lead:
        return Scan()
    if lead[0] != "[":
        return Scan(error="[TOOL_CALLS] without a JSON list", error_at=0)
    return json_calls(text, len(text) - len(lead) + 1, "arguments", ",", "]", whole=True)


def section(tools: Sequence[Tool], parallel: bool) -> str:
    objs = [
        schema_rule(object_schema({"name": {"const": t.name}, "arguments": params_schema(t)}))
        for t in tools
    ]
    calls = repeated("call", lark_str(","), parallel)
    return f'section: "[" {calls} "]"\ncall: {alternatives(objs)}\n'


FORMAT = ToolFormat("mistral", OPEN, (OPEN,), scan, section)
