"""What every tool-call format shares: a call, a scan of the model's call markup, the
format entry, and the JSON helpers the formats' scanners and grammars use. Torch-free."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tool:
    """A function the client offers (OpenAI's `tools[i].function`)."""

    name: str
    parameters: dict[str, Any]  # a JSON schema for the arguments (an object)
    description: str | None = None
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """As chat templates take it (`tools=` in apply_chat_template)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class Call:
    """A call the model wrote: `arguments` is JSON text; while the call is still open
    (streaming, or cut off at max_tokens) it is a prefix of the final text."""

    name: str
    arguments: str
    closed: bool = True


@dataclass(frozen=True)
class Scan:
    """The calls found in a call section (the text from the format's marker on). `tail`:
    text after the calls that is none (content); `error`: why the section stopped being
    parseable, and `error_at` where (that text, to the end, is content)."""

    calls: tuple[Call, ...] = ()
    tail: str = ""
    error: str | None = None
    error_at: int = 0


@dataclass(frozen=True)
class ToolFormat:
    """One template family's call markup: `marker` opens its call section (text before
    it is content); `scan` reads a section; `section` writes the Lark rules of one
    (rule `section`: what follows the marker), over `tools`, with several calls or one;
    `signature`: strings a chat template of this family contains (all of them). `scan`
    takes the offered tools too: XML formats write values as text, typed by the schema."""

    name: str
    marker: str
    signature: tuple[str, ...]
    scan: Callable[[str, Sequence[Tool]], Scan]
    section: Callable[[Sequence[Tool], bool], str]


# ------------------------------------------------------------------ JSON helpers


def json_end(text: str, start: int) -> int | None:
    """The end of the JSON value that begins at `start` (after whitespace), or None while
    it is unfinished. Only brackets and strings are tracked: json.loads checks the rest."""
    i, n = start, len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i == n:
        return None
    if text[i] not in '{["':
        # A scalar: it ends where the next delimiter is (unknown while the text ends).
        j = i
        while j < n and text[j] not in ",}] \t\r\n":
            j += 1
        return j if j < n else None
    depth, in_str, esc = 0, False, False
    for j in range(i, n):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def schema_rule(schema: dict[str, Any]) -> str:
    """A Lark `%json` item: compact JSON (no free whitespace, as structured output's)."""
    s = dict(schema)
    s["x-guidance"] = {"whitespace_flexible": False}
    return "%json " + json.dumps(s)


def params_schema(tool: Tool) -> dict[str, Any]:
    return tool.parameters or {"type": "object"}


def object_schema(props: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly `props`, in order (the call's name first)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def lark_str(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s)


def alternatives(rules: Sequence[str]) -> str:
    return " | ".join(f"({r})" for r in rules)


def repeated(one: str, sep: str, parallel: bool) -> str:
    """`one`, or `one (sep one)*` when several calls may be made (sep "": `one+`)."""
    if not parallel:
        return one
    return f"({one})+" if sep == '""' else f"{one} ({sep} {one})*"


def args_text(value: Any, where: str) -> str:
    """Arguments as JSON text; the model's must be an object."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: arguments must be a JSON object, got {type(value).__name__}")
    return dumps(value)


# ------------------------------------------------------------------ shared scanners

_NAME_THEN_ARGS = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:%s)"\s*:\s*'


def json_call(body: str, args_key: str = "arguments") -> tuple[Call | None, int | None]:
    """A `{"name": ..., "<args_key>": {...}}` call at the start of `body`: the call (open
    while unfinished; None before its name is known) and where its object ends (None
    while it is open). The arguments are the model's own text of them, so an open call's
    are a prefix of the closed one's. ValueError: the object is complete and no call."""
    import re

    end = json_end(body, 0)
    m = re.match(_NAME_THEN_ARGS % args_key, body)
    if end is None:
        if m is None:
            return None, None
        args_end = json_end(body, m.end())  # the arguments may be complete already
        text = body[m.end() : args_end] if args_end is not None else body[m.end() :]
        return Call(json.loads(f'"{m.group(1)}"'), text, closed=False), None
    try:
        obj = json.loads(body[:end])
    except json.JSONDecodeError as e:
        raise ValueError(f"the call is not JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("the call has no name")
    if args_key not in obj:
        raise ValueError(f"the call has no {args_key}")
    args = obj[args_key]
    args_end = json_end(body, m.end()) if m is not None else None
    if m is not None and args_end is not None and json.loads(body[m.end() : args_end]) == args:
        text = body[m.end() : args_end]
        args_text(args, obj["name"])  # an object
    else:
        text = args_text(args, obj["name"])
    return Call(obj["name"], text), end


def typed_value(raw: str, schema: dict[str, Any]) -> Any:
    """A parameter's value written as text (XML formats): a string where the schema says
    so, else JSON (text that is no JSON stays a string, as vLLM's parsers read it)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def xml_args(pairs: Sequence[tuple[str, Any]], closed: bool) -> str:
    """Arguments from (key, value) pairs as JSON text; an open call's lacks the closing
    brace (and only has whole pairs), so it is a prefix of the closed call's."""
    body = ", ".join(f"{dumps(k)}: {dumps(v)}" for k, v in pairs)
    return "{" + body + ("}" if closed else "")


def tool_schema(tools: Sequence[Tool], name: str) -> dict[str, Any]:
    for t in tools:
        if t.name == name:
            return params_schema(t)
    return {}


def xml_param_rules(tool: Tool, write: Callable[[str, str], str], string_value: str) -> str:
    """The Lark rules of `tool`'s parameters in an XML format: required ones in order,
    then optional ones, each optional; `write(key, value_rule)` one parameter's markup;
    a string value matches `string_value` (a Lark terminal), any other its schema."""
    schema = params_schema(tool)
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    items = []
    for key, prop in props.items():
        prop = prop if isinstance(prop, dict) else {}
        enum = prop.get("enum")
        if prop.get("type") == "string" and isinstance(enum, list):  # written bare
            value = "(" + " | ".join(lark_str(str(v)) for v in enum) + ")"
        elif prop.get("type") == "string":
            value = string_value
        else:
            value = schema_rule(prop)
        one = write(key, value)
        items.append(one if key in required else f"({one})?")
    return " ".join(items) if items else '""'


def xml_call(
    body: str,
    name: str,
    tools: Sequence[Tool],
    param: Any,
    end: Any,
    end_tag: str,
) -> tuple[Call, int | None]:
    """One XML-format call's parameters from `body` (after its name): `param` a compiled
    regex matching one parameter (groups key, value, leading whitespace allowed), `end`
    one matching the call's end; `end_tag` the literal that shows the call is complete
    (before it, an unmatched rest is the unfinished part). ValueError: markup that is
    neither."""
    schema = tool_schema(tools, name)
    props = schema.get("properties") or {}
    pairs: list[tuple[str, Any]] = []
    pos = 0
    while True:
        m = param.match(body, pos)
        if m is not None:
            key, raw = m.group(1), m.group(2)
            pairs.append((key, typed_value(raw, props.get(key) or {})))
            pos = m.end()
            continue
        e = end.match(body, pos)
        if e is not None:
            return Call(name, xml_args(pairs, True)), e.end()
        if end_tag not in body[pos:]:
            return Call(name, xml_args(pairs, False), closed=False), None
        raise ValueError(f"unreadable parameter markup in the call of {name}")


Reader = Callable[[str, int], tuple[Call | None, int | None]]


def xml_reader(
    tools: Sequence[Tool], name: Any, param: Any, end: Any, end_tag: str, written_by: str
) -> Reader:
    """A reader (for `sections_scan`) of one XML-format call: its name by the compiled
    regex `name` (group 1), then its parameters (`xml_call`). No name yet while
    `written_by` (a character the name's markup ends with) has not appeared: it is still
    being written; after it, the markup is malformed."""

    def read(region: str, at: int) -> tuple[Call | None, int | None]:
        m = name.match(region, at)
        if m is None:
            if written_by in region[at:]:
                raise ValueError("a call without a function name")
            return None, None
        call, stop = xml_call(region[m.end() :], m.group(1), tools, param, end, end_tag)
        return call, None if stop is None else m.end() + stop

    return read


def sections_scan(
    region: str,
    opening: str,
    one: Reader,
) -> Scan:
    """A section of calls each opened by `opening` (whitespace between): `one(region,
    at)` reads the call whose body starts at `at` -> (call or None while its name is
    unknown, its end in `region` or None while it is open); ValueError: malformed."""
    calls: list[Call] = []
    pos = 0
    while True:
        start = pos
        while pos < len(region) and region[pos].isspace():
            pos += 1
        rest = region[pos:]
        if not rest or opening.startswith(rest):
            return Scan(tuple(calls))
        if not rest.startswith(opening):
            return Scan(tuple(calls), tail=region[start:])
        try:
            call, end = one(region, pos + len(opening))
        except ValueError as e:
            return Scan(tuple(calls), error=str(e), error_at=pos)
        if end is None:
            return Scan(tuple(calls) + ((call,) if call is not None else ()))
        assert call is not None
        calls.append(call)
        pos = end


def json_calls(
    text: str, pos: int, args_key: str, sep: str, close: str | None, whole: bool
) -> Scan:
    """JSON calls (`json_call`) from `pos` on, separated by `sep`: a list that ends at
    `close`, or (None) calls until text that is no separator, the tail. A call that does
    not parse is content from the start of the text (`whole`) or from itself."""
    calls: list[Call] = []
    while True:
        try:
            call, end = json_call(text[pos:], args_key)
        except ValueError as e:
            return Scan(tuple(calls), error=str(e), error_at=0 if whole else pos)
        if end is None:
            return Scan(tuple(calls) + ((call,) if call is not None else ()))
        assert call is not None
        calls.append(call)
        rest = text[pos + end :].lstrip()
        if not rest or ((rest.startswith(sep) or sep.startswith(rest)) and len(rest) < len(sep)):
            return Scan(tuple(calls))  # the end, or a separator still being written
        if rest.startswith(sep):
            pos = len(text) - len(rest) + len(sep)
        elif close is not None and rest.startswith(close):
            return Scan(tuple(calls), tail=rest[len(close) :])
        elif close is None:
            return Scan(tuple(calls), tail=text[pos + end :])
        else:
            return Scan(tuple(calls), error=f"calls not separated by {sep!r}", error_at=0)
