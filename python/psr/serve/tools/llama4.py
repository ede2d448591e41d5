"""Llama 4 (JSON, as vLLM's llama4_json): `{"name": ..., "parameters": {...}}`, calls
separated by `; `. The marker is the call's own start, `{"name"`."""

from __future__ import annotations

from collections.abc import Sequence

from psr.serve.tools.base import (
    Scan,
    Tool,
    ToolFormat,
    alternatives,
    json_calls,
    lark_str,
    params_schema,
    repeated,
    schema_rule,
)

OPEN = '{"name"'


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    return json_calls(region, 0, "parameters", ";", None, whole=False)


def section(tools: Sequence[Tool], parallel: bool) -> str:
    # The marker wrote `{"name"`: the rest of the object, then more calls.
    calls = [
        f'{lark_str(":" + chr(34) + t.name + chr(34) + ",")} "\\"parameters\\":" '
        f'{schema_rule(params_schema(t))} "}}"'
        for t in tools
    ]
    return (
        f"section: {repeated('call', lark_str('; ' + OPEN), parallel)}\n"
        f"call: {alternatives(calls)}\n"
    )


FORMAT = ToolFormat("llama4_json", OPEN, ("<|header_start|>",), scan, section)
