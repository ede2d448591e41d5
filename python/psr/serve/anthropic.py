"""Anthropic's Messages API over the same worker: `POST /v1/messages` and
`/v1/messages/count_tokens`.

A Messages body becomes the chat request the OpenAI route makes (`parse_messages`):
`system` first, `tool_use` blocks as an assistant's tool calls, `tool_result` blocks as
tool messages, `thinking` blocks as the reasoning templates take back, `tools` with
their `input_schema`, `tool_choice` auto / any / tool / none, `stop_sequences`,
`thinking` as the template's `enable_thinking`. The reply's parts (reasoning, text,
calls) become its content blocks, whole or as the API's event stream. Errors have its
shape: {"type": "error", "error": {"type", "message"}}, the message naming the field.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from psr.serve import tools
from psr.serve.job import Delta, Event, Failed, Finished
from psr.serve.output import Output
from psr.serve.protocol import (
    APIError,
    ChatRequest,
    _check_body,
    _check_keys,
    _short,
    bad_request,
    make_tool,
    parse_chat,
)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
KNOWN_KEYS = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "metadata",
        "service_tier",
    }
)


def error_body(e: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


# ------------------------------------------------------------------ the request


def _text_blocks(v: Any, where: str) -> str:
    """A string, or a list of text blocks, as text."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    out = []
    for j, b in enumerate(v):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else _short(b)
            raise bad_request(f"{where}.{j}.type: only text blocks here, got {kind!r}", where)
        out.append(b["text"])
    return "".join(out)


def _user(blocks: list[Any], where: str, out: list[dict[str, Any]]) -> None:
    """A user turn: its tool results as tool messages (first, as the calls were made),
    then its text."""
    texts = []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result":
            cid = b.get("tool_use_id")
            if not isinstance(cid, str):
                raise bad_request(f"{at}.tool_use_id is required (a string)", "messages")
            content = _text_blocks(b.get("content", ""), f"{at}.content")
            if b.get("is_error"):
                content = f"Error: {content}"
            out.append({"role": "tool", "tool_call_id": cid, "content": content})
        else:
            raise bad_request(
                f"{at}.type: {kind!r} is not a block type psr reads in a user turn (text, "
                "tool_result)",
                "messages",
            )
    if texts:
        out.append({"role": "user", "content": "".join(texts)})


def _assistant(blocks: list[Any], where: str, out: list[dict[str, Any]]) -> None:
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thoughts.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue  # nothing a local template can read
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad_request(f"{at}: a tool_use block needs an id and a name", "messages")
            if not isinstance(b.get("input"), dict):
                raise bad_request(f"{at}.input must be an object", "messages")
            fn = {"name": b["name"], "arguments": json.dumps(b["input"])}
            calls.append({"id": b["id"], "type": "function", "function": fn})
        else:
            raise bad_request(
                f"{at}.type: {kind!r} is not a block type psr reads in an assistant turn "
                "(text, thinking, redacted_thinking, tool_use)",
                "messages",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    out.append(msg)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation in OpenAI's message shape (checked again by parse_chat)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant, got {role!r}", "messages")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"{where}.content must be a string or a list of blocks", "messages")
        (_user if role == "user" else _assistant)(blocks, where, out)
    return out


def _tools(v: Any) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, t in enumerate(v):
        where = f"tools.{i}"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", "tools")
        if t.get("type") not in (None, "custom"):
            raise bad_request(
                f"{where}.type: {t.get('type')!r} is a server tool, which psr does not run "
                "(custom tools only)",
                "tools",
            )
        tool = make_tool(
            t.get("name"),
            t.get("input_schema"),
            t.get("description"),
            None,
            where,
            "tools",
            "input_schema",
        )
        out.append(tool.openai())
    return out


def _tool_choice(v: Any) -> tuple[Any, bool]:
    """OpenAI's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    if v is None:
        return None, True
    kind = v.get("type") if isinstance(v, dict) else None
    parallel = not (isinstance(v, dict) and v.get("disable_parallel_tool_use"))
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(v.get("name"), str):
        return {"type": "function", "function": {"name": v["name"]}}, parallel
    raise bad_request(
        f"tool_choice.type must be auto, any, tool (with a name) or none, got {_short(v)}",
        "tool_choice",
    )


def parse_messages(body: Any, strict: bool = False) -> ChatRequest:
    """A Messages body as the chat request it asks for."""
    body = _check_body(body)
    ignored = _check_keys(body, KNOWN_KEYS, strict)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad_request(f"max_tokens: an integer >= 1 is required, got {_short(max_tokens)}")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 <= temperature <= 1
    ):
        raise bad_request(f"temperature must be in [0, 1], got {_short(temperature)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    choice, parallel = _tool_choice(body.get("tool_choice"))
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": _messages(body),
        "max_tokens": max_tokens,
        "tools": _tools(body.get("tools")),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking(body.get("thinking")),
    }
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    chat["stream"] = stream
    try:
        req = parse_chat(chat)
    except APIError as e:
        if e.param != "stop":
            raise
        raise bad_request(
            e.message.replace("stop", "stop_sequences", 1), "stop_sequences"
        ) from None
    return replace(req, ignored=ignored)


def _thinking(v: Any) -> dict[str, Any]:
    """`thinking` {"type": "enabled" | "disabled"} as the template's enable_thinking (the
    budget is not enforced: the reply's max_tokens bounds it)."""
    if v is None:
        return {}
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("enabled", "disabled"):
        raise bad_request(f"thinking.type must be enabled or disabled, got {_short(v)}", "thinking")
    return {"enable_thinking": kind == "enabled"}


# ------------------------------------------------------------------ the reply


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def _stop_reason(f: Finished, calls: int) -> str:
    if f.finish_reason == "length":
        return "max_tokens"
    if f.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def _usage(f: Finished) -> dict[str, int]:
    return {
        "input_tokens": f.prompt_tokens,
        "output_tokens": f.completion_tokens,
        "cache_read_input_tokens": f.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:  # cut off at max_tokens
        return {}


class MessagesResponder:
    """The Messages API's reply for one request, whole or as its event stream."""

    def __init__(
        self, rid: str, model: str, output: Output, count: Callable[[], None], prompt_tokens: int
    ) -> None:
        self.id, self.model, self.out, self.count = rid, model, output, count
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def whole(self, deltas: list[Delta], f: Finished) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        blocks: list[dict[str, Any]] = []
        args: dict[int, str] = {}
        for part in self.out.feed(text) + self.out.finish():
            if isinstance(part, tools.Text):
                kind = "thinking" if part.kind == "reasoning" else "text"
                if blocks and blocks[-1]["type"] == kind:
                    blocks[-1][kind] += part.text
                else:
                    blocks.append({"type": kind, kind: part.text})
                    if kind == "thinking":
                        blocks[-1]["signature"] = ""
            elif isinstance(part, tools.CallStart):
                args[part.index] = ""
                blocks.append(
                    {"type": "tool_use", "id": _tool_id(part.id), "name": part.name, "input": {}}
                )
                blocks[-1]["_index"] = part.index
            else:
                args[part.index] += part.text
        for b in blocks:
            if b["type"] == "tool_use":
                b["input"] = _input(args[b.pop("_index")])
        self.count()
        return self._head() | {
            "content": blocks,
            "stop_reason": _stop_reason(f, self.out.calls),
            "stop_sequence": f.stop_string,
            "usage": _usage(f),
        }

    async def stream(
        self, first: Event, events: Callable[[], Awaitable[Event]]
    ) -> AsyncIterator[str]:
        start = self._head() | {
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        yield _event("message_start", {"type": "message_start", "message": start})
        blocks = _Blocks()
        ev = first
        while True:
            if isinstance(ev, Delta):
                for part in self.out.feed(ev.text) if ev.text else []:
                    for e in blocks.part(part):
                        yield e
            elif isinstance(ev, Finished):
                for part in self.out.finish():
                    for e in blocks.part(part):
                        yield e
                for e in blocks.close():
                    yield e
                self.count()
                delta = {
                    "stop_reason": _stop_reason(ev, self.out.calls),
                    "stop_sequence": ev.stop_string,
                }
                usage = {"output_tokens": ev.completion_tokens}
                body = {"type": "message_delta", "delta": delta, "usage": usage}
                yield _event("message_delta", body)
                yield _event("message_stop", {"type": "message_stop"})
                return
            elif isinstance(ev, Failed):
                yield _event("error", error_body(APIError(ev.status, ev.message)))
                return
            else:  # the client went away
                return
            ev = await events()


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Blocks:
    """Content blocks as parts arrive: a block opens when the kind of part changes (text,
    thinking, a new call) and closes before the next one opens."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        body = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, _event("content_block_start", body)]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return _event("content_block_delta", body)

    def part(self, part: tools.Part) -> list[str]:
        out: list[str] = []
        if isinstance(part, tools.Text):
            if part.kind == "reasoning":
                if self.kind != "thinking":
                    thinking = {"type": "thinking", "thinking": "", "signature": ""}
                    out += self._open("thinking", thinking)
                out.append(self._delta({"type": "thinking_delta", "thinking": part.text}))
            else:
                if self.kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": part.text}))
        elif isinstance(part, tools.CallStart):
            use: dict[str, Any] = {"type": "tool_use", "id": _tool_id(part.id)}
            use |= {"name": part.name, "input": {}}
            out += self._open("tool_use", use)
        else:
            out.append(self._delta({"type": "input_json_delta", "partial_json": part.text}))
        return out
