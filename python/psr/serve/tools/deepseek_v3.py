"""DeepSeek-V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n
```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`."""

from __future__ import annotations

import json
from collections.abc import Sequence

from psr.serve.tools.base import (
    Call,
    Scan,
    Tool,
    ToolFormat,
    alternatives,
    args_text,
    json_end,
    lark_str,
    params_schema,
    repeated,
    schema_rule,
    sections_scan,
)

OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE = "\n```json\n"
FENCE_END = "\n```"


def _read(region: str, at: int) -> tuple[Call | None, int | None]:
    head = "function" + SEP
    text = region[at:]
    if not text.startswith(head):
        if head.startswith(text):
            return None, None
        raise ValueError("a tool call without function<｜tool▁sep｜>")
    nl = text.find("\n", len(head))
    if nl < 0:
        return None, None
    name = text[len(head) : nl]
    if not text.startswith(FENCE, nl):
        if FENCE.startswith(text[nl:]):
            return None, None
        raise ValueError(f"the call of {name} has no ```json block")
    start = nl + len(FENCE)
    end = json_end(text, start)
    if end is None:
        return Call(name, text[start:], closed=False), None
    raw = text[start:end]
    try:
        args_text(json.loads(raw), name)
    except (json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"the call of {name}: {e}") from None
    close = FENCE_END + CALL_END
    rest = text[end:]
    if not rest.startswith(close):
        if close.startswith(rest):
            return Call(name, raw, closed=False), None
        raise ValueError(f"the call of {name} does not end with ```<｜tool▁call▁end｜>")
    return Call(name, raw), at + end + len(close)


def scan(region: str, tools: Sequence[Tool]) -> Scan:
    body = region[len(OPEN) :]
    close = body.find(CLOSE)
    found = sections_scan(body if close < 0 else body[:close], CALL, _read)
    if found.error is not None:
        return Scan(found.calls, error=found.error, error_at=0)
    tail = found.tail + (body[close + len(CLOSE) :] if close >= 0 else "")
    return Scan(found.calls, tail=tail)


def section(tools: Sequence[Tool], parallel: bool) -> str:
    calls = [
        f"{lark_str(CALL + 'function' + SEP + t.name + FENCE)} {schema_rule(params_schema(t))} "
        f"{lark_str(FENCE_END + CALL_END)}"
        for t in tools
    ]
    return (
        f"section: {repeated('call', lark_str(''), parallel)} {lark_str(CLOSE)}\n"
        f"call: {alternatives(calls)}\n"
    )


FORMAT = ToolFormat("deepseek_v3", OPEN, (OPEN, SEP), scan, section)
