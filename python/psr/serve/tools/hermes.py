"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
one block per call."""

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
    sections_scan,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _one(region: str, at: int) -> tuple[Call | None, int | None]:
    close = region.find(CLOSE, at)
    body = region[at:] if close < 0 else region[at:close]
    call, end = json_call(body)
    if close < 0:
        return call, None
    if end is None or body[end:].strip():
        raise ValueError("the block is not one JSON call")
    return call, close + len(CLOSE)


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    return sections_scan(region, OPEN, _one)


def section(tools: Sequence[Tool], parallel: bool) -> str:
    objs = [
        schema_rule(object_schema({"name": {"const": t.name}, "arguments": params_schema(t)}))
        for t in tools
    ]
    one = '"\\n" call "\\n</tool_call>"'
    calls = repeated(one, lark_str("\n" + OPEN), parallel)
    return f"section: {calls}\ncall: {alternatives(objs)}\n"


FORMAT = ToolFormat("hermes", OPEN, (OPEN,), scan, section)
