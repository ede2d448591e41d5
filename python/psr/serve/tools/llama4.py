"""Llama 4 (JSON, as vLLM's llama4_json): `{"name": ..., "parameters": {...}}`, calls
separated by `; `. The marker is the call's own start, `{"name"`."""

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
    params_schema,
    repeated,
    schema_rule,
)

OPEN = '{"name"'


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    calls: list[Call] = []
    pos = 0
    while True:
        try:
            call, end = json_call(region[pos:], "parameters")
        except ValueError as e:
            return Scan(tuple(calls), error=str(e), error_at=pos)
        if end is None:
            return Scan(tuple(calls) + ((call,) if call is not None else ()))
        assert call is not None
        calls.append(call)
        pos += end
        rest = region[pos:].lstrip()
        if not rest or ";".startswith(rest):
            return Scan(tuple(calls))
        if rest[0] != ";":
            return Scan(tuple(calls), tail=region[pos:])
        pos = len(region) - len(rest) + 1
        rest = region[pos:].lstrip()
        if rest and not (rest.startswith(OPEN) or OPEN.startswith(rest)):
            return Scan(tuple(calls), error="text after ';' is no call", error_at=pos)
        pos = len(region) - len(rest)


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
