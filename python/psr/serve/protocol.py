"""OpenAI request bodies, checked: `parse_completion` / `parse_chat` turn a decoded JSON
body into a request, or raise `APIError`, whose `body()` is OpenAI's error object.

Every parameter OpenAI defines is either honoured or refused with a 400 that names it.
Fields nobody defines are ignored and listed in the request's `ignored` (the app answers
with a warning header and a log line, as vLLM does), or refused with a 400 under
`strict`. Extensions, as vLLM accepts them: `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `return_token_ids` (the prompt's and the completion's token ids), and
structured output by `guided_json` / `guided_regex` / `guided_grammar` (Lark) beside
OpenAI's `response_format`. Tools (`tools`, `tool_choice`, `parallel_tool_calls`, and
the history's calls and results), `chat_template_kwargs` and `reasoning_effort` are
checked here too. Strings anywhere in a body must be valid Unicode (no lone
surrogates): a 400 naming the field. Torch-free: no model is needed to check a request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from psr.serve.tools.base import Tool

# OpenAI's default max_tokens for /v1/completions; chat completions default to the rest
# of the model's context (max_tokens None).
COMPLETION_MAX_TOKENS = 16
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64)


class APIError(Exception):
    """A request answered with an OpenAI error body and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "server_error")
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Structured:
    """A grammar the output must follow: `kind` "json" (`spec` a JSON schema as text, or
    None: any JSON object), "regex" or "lark" (`spec` the pattern / grammar)."""

    kind: str
    spec: str | None


@dataclass(frozen=True)
class Sampling:
    """How to decode one request: what `model.generate` and the stop strings take."""

    max_tokens: int | None  # None: the rest of the model's context
    temperature: float  # 0: greedy
    top_p: float
    top_k: int  # 0: off
    seed: int | None  # None: a fresh random seed per request
    stop: tuple[str, ...]
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off (vLLM's: prompt and output tokens)
    presence_penalty: float = 0.0  # OpenAI's: output tokens
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the token's and the k most likely
    structured: Structured | None = None
    n: int = 1  # choices returned
    best_of: int = 1  # sequences decoded (>= n): the n of highest mean logprob returned

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool
    echo: bool
    return_token_ids: bool
    ignored: tuple[str, ...] = ()  # unknown fields, ignored (not strict)


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: bool
    include_usage: bool
    return_token_ids: bool
    ignored: tuple[str, ...] = ()
    tools: tuple[Tool, ...] = ()
    # "auto", "none", "required", or the name of the one function to call
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the template's extras

    @property
    def forced(self) -> bool:
        """The reply must be calls (tool_choice required or named)."""
        return bool(self.tools) and self.tool_choice not in ("auto", "none")

    @property
    def several(self) -> bool:
        """Several calls may be made: parallel_tool_calls, and no function named (a named
        tool_choice is one call, as vLLM's)."""
        return self.parallel_tool_calls and self.tool_choice in ("auto", "required")

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model may call: all, the named one, or none."""
        if not self.tools or self.tool_choice == "none":
            return ()
        if self.tool_choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.tool_choice)


# ------------------------------------------------------------------ field checks


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{key} must be a boolean, got {v!r}", key)
    return v


def _int(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"{key} must be an integer, got {v!r}", key)
    if v < lo or (hi is not None and v >= hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise bad_request(f"{key} must be an integer {bound}, got {v}", key)
    return int(v)


def _number(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_number(v) or not math.isfinite(v):
        raise bad_request(f"{key} must be a finite number, got {v!r}", key)
    return float(v)


def _refuse_unless(body: dict[str, Any], key: str, allowed: tuple[Any, ...], why: str) -> None:
    """`key` may be absent or one of `allowed` (values that change nothing)."""
    v = body.get(key)
    if v is None or any(v == a and type(v) is type(a) for a in allowed):
        return
    raise bad_request(f"{key}={_short(v)} is not supported: {why}", key)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_keys(body: dict[str, Any], known: frozenset[str], strict: bool) -> tuple[str, ...]:
    """The unknown fields (ignored), or under `strict` a 400 for the first."""
    unknown = tuple(key for key in body if key not in known)
    if unknown and strict:
        raise bad_request(f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    return unknown


def check_unicode(v: Any, where: str) -> None:
    """A 400 naming the field if any string in `v` (keys too) is not valid Unicode: a lone
    surrogate such as "\\ud800" that JSON allows and no tokenizer can encode."""
    if isinstance(v, str):
        if not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(
                    f"{where} is not valid Unicode: {e.reason} at character {e.start} "
                    f"({v[e.start]!r})",
                    where.split(".")[0].split("[")[0],
                ) from None
    elif isinstance(v, list):
        for i, x in enumerate(v):
            check_unicode(x, f"{where}[{i}]")
    elif isinstance(v, dict):
        for k, x in v.items():
            check_unicode(k, f"{where} (a key)")
            check_unicode(x, f"{where}.{k}")


def _check_all_unicode(body: dict[str, Any]) -> None:
    for key, value in body.items():
        check_unicode(key, "a field name")
        check_unicode(value, key)


# Accepted and without effect on decoding: end-user and bookkeeping tags.
_METADATA = frozenset({"user", "metadata"})
_SAMPLING = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "max_tokens",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
        "logprobs",
        "guided_json",
        "guided_regex",
        "guided_grammar",
    }
)
_STREAM = frozenset({"stream", "stream_options"})
# Checked by _common_refusals: accepted only with values that change nothing.
_REFUSED_COMMON = frozenset({"logit_bias"})
MAX_CHOICES = 16  # n and best_of: sequences one request may decode
COMPLETION_KEYS = frozenset(
    {"model", "prompt", "echo", "best_of", "suffix", "return_token_ids", "response_format"}
    | _METADATA
    | _SAMPLING
    | _STREAM
    | _REFUSED_COMMON
    | {"n"}
)
CHAT_KEYS = frozenset(
    {
        "model",
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
        "return_token_ids",
        "chat_template_kwargs",
        "reasoning_effort",
        "n",
    }
    | _METADATA
    | _SAMPLING
    | _STREAM
    | _REFUSED_COMMON
)


def _model(body: dict[str, Any]) -> str | None:
    v = body.get("model")
    if v is not None and not isinstance(v, str):
        raise bad_request(f"model must be a string, got {_short(v)}", "model")
    return v


def _ranged(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = _number(body, key)
    if v is None:
        return default
    if not lo <= v <= hi:
        raise bad_request(f"{key} must be in [{lo}, {hi}], got {v}", key)
    return v


def _sampling(body: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> Sampling:
    temperature = _number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", -1)
    rep = _number(body, "repetition_penalty")
    n = _int(body, "n", 1, MAX_CHOICES + 1) or 1
    if rep is not None and rep <= 0:
        raise bad_request(f"repetition_penalty must be > 0, got {rep}", "repetition_penalty")
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,  # OpenAI's default
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k,  # -1 and 0: keep every token
        seed=_int(body, "seed", 0, SEED_LIMIT),
        stop=_stop(body.get("stop")),
        min_p=_ranged(body, "min_p", 0.0, 1.0, 0.0),
        repetition_penalty=1.0 if rep is None else rep,
        presence_penalty=_ranged(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_ranged(body, "frequency_penalty", -2.0, 2.0, 0.0),
        ignore_eos=_bool(body, "ignore_eos"),
        logprobs=logprobs,
        structured=_structured(body),
        n=n,
        best_of=n,
    )


def _best_of(body: dict[str, Any], s: Sampling, stream: bool) -> Sampling:
    """Completions' best_of: >= n sequences decoded, the n best (mean logprob) returned."""
    best_of = _int(body, "best_of", 1, MAX_CHOICES + 1)
    if best_of is None:
        return s
    if best_of < s.n:
        raise bad_request(f"best_of must be >= n ({s.n}), got {best_of}", "best_of")
    if stream and best_of > s.n:
        raise bad_request(
            "best_of > n cannot be streamed (the best are known at the end)", "best_of"
        )
    return replace(s, best_of=best_of)


def _structured(body: dict[str, Any]) -> Structured | None:
    """`response_format` (OpenAI) or vLLM's guided_* fields: at most one grammar."""
    found: list[Structured] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append(rf)
    gj = body.get("guided_json")
    if gj is not None:
        if isinstance(gj, str):
            gj = _json_text(gj, "guided_json")
        if not isinstance(gj, dict):
            raise bad_request("guided_json must be a JSON schema (an object)", "guided_json")
        found.append(Structured("json", json.dumps(gj)))
    for key, kind in (("guided_regex", "regex"), ("guided_grammar", "lark")):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, str) or not v:
                raise bad_request(f"{key} must be a non-empty string", key)
            found.append(Structured(kind, v))
    if len(found) > 1:
        raise bad_request(
            "give one of response_format, guided_json, guided_regex, guided_grammar",
            "response_format",
        )
    return found[0] if found else None


def _json_text(v: str, key: str) -> Any:
    try:
        return json.loads(v)
    except json.JSONDecodeError as e:
        raise bad_request(f"{key} is not valid JSON: {e}", key) from None


def _response_format(v: Any) -> Structured | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured("json", None)
    if kind == "json_schema":
        js = v.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format json_schema needs json_schema.schema (an object)",
                "response_format",
            )
        return Structured("json", json.dumps(schema))
    raise bad_request(
        f"response_format {kind or _short(v)!s} is not supported: text, json_object or json_schema",
        "response_format",
    )


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(f"stop must be a string or a list of strings, got {_short(v)}", "stop")
    if any(s == "" for s in items):
        raise bad_request("stop strings must not be empty", "stop")
    return tuple(dict.fromkeys(items))


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request(f"stream_options must be an object, got {_short(opts)}", "stream_options")
    for key in opts:
        if key != "include_usage":
            raise bad_request(
                f"stream_options.{key} is not supported (include_usage is)", "stream_options"
            )
    return stream, _bool(opts, "include_usage")


def _common_refusals(body: dict[str, Any]) -> None:
    _refuse_unless(body, "logit_bias", ({},), "psr's decoding takes no logit bias")


def _check_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_all_unicode(body)
    return body


MAX_LOGPROBS = 20  # vLLM's default max_logprobs


# ------------------------------------------------------------------ the two requests


def parse_completion(body: Any, strict: bool = False) -> CompletionRequest:
    """A /v1/completions body, checked (APIError 400 naming the parameter)."""
    body = _check_body(body)
    ignored = _check_keys(body, COMPLETION_KEYS, strict)
    _common_refusals(body)
    _refuse_unless(body, "suffix", ("",), "psr does not insert text (no suffix)")
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS + 1)
    max_tokens = _int(body, "max_tokens", 1)
    stream, include_usage = _stream(body)
    sampling = _sampling(
        body, COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens, logprobs
    )
    return CompletionRequest(
        model=_model(body),
        prompt=_prompt(body.get("prompt")),
        sampling=_best_of(body, sampling, stream),
        stream=stream,
        include_usage=include_usage,
        echo=_bool(body, "echo"),
        return_token_ids=_bool(body, "return_token_ids"),
        ignored=ignored,
    )


def _prompt(v: Any) -> str | list[int]:
    if v is None:
        raise bad_request("prompt is required", "prompt")
    # A list of one prompt is one prompt; more are a batch, which psr does not decode.
    if isinstance(v, list) and v and isinstance(v[0], (str, list)):
        if len(v) != 1:
            raise bad_request(
                f"psr serves one prompt per request (batch 1), got {len(v)}", "prompt"
            )
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise bad_request("prompt is empty", "prompt")
        return v
    if isinstance(v, list):
        if not v:
            raise bad_request("prompt is empty", "prompt")
        bad = [t for t in v if not _is_int(t) or t < 0]
        if bad:
            raise bad_request(
                f"prompt token ids must be integers >= 0, got {_short(bad[0])}", "prompt"
            )
        return [int(t) for t in v]
    raise bad_request(
        f"prompt must be a string or a list of token ids, got {type(v).__name__}", "prompt"
    )


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any, strict: bool = False) -> ChatRequest:
    """A /v1/chat/completions body, checked (APIError 400 naming the parameter)."""
    body = _check_body(body)
    ignored = _check_keys(body, CHAT_KEYS, strict)
    _common_refusals(body)
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS + 1)
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    _refuse_unless(body, "functions", ([],), "functions are deprecated: give tools")
    _refuse_unless(
        body, "function_call", ("none",), "function_call is deprecated: give tool_choice"
    )
    tools = parse_tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
    max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", 1)
    stream, include_usage = _stream(body)
    sampling = _sampling(body, max_tokens, (top or 0) if want else None)
    if sampling.structured is not None and tools and choice != "none":
        raise bad_request(
            "give response_format (or guided_*) or tools, not both: one grammar per request",
            "response_format",
        )
    return ChatRequest(
        model=_model(body),
        messages=_messages(body.get("messages")),
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
        ignored=ignored,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        template_kwargs=_template_kwargs(body),
    )


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs` (vLLM's: e.g. enable_thinking), and `reasoning_effort`, which
    templates that take it (gpt-oss's) read as a variable of that name."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        kw = {}
    if not isinstance(kw, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = {"messages", "tools", "add_generation_prompt", "chat_template", "tokenize"}
    for key in kw:
        if key in reserved:
            raise bad_request(
                f"chat_template_kwargs.{key} is set by the server", "chat_template_kwargs"
            )
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("minimal", "low", "medium", "high"):
            raise bad_request(
                f"reasoning_effort must be minimal, low, medium or high, got {_short(effort)}",
                "reasoning_effort",
            )
        kw = {**kw, "reasoning_effort": effort}
    return dict(kw)


# ------------------------------------------------------------------ tools

_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_schema(schema: Any, where: str, param: str = "tools") -> None:
    """A 400 naming `where` unless `schema` is a JSON Schema psr can read: an object whose
    `type`, `properties`, `required`, `items`, `enum` and combinators are well formed (the
    grammar compiler checks the rest)."""

    def bad(what: str) -> APIError:
        return bad_request(f"{where} is not a valid JSON Schema: {what}", param)

    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad(f"expected an object, got {_short(schema)}")
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        for k in kinds:
            if k not in _JSON_TYPES:
                raise bad(f"type {_short(k)} is not a JSON type")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise bad("properties must be an object")
        for key, sub in props.items():
            check_schema(sub, f"{where}.properties.{key}", param)
    req = schema.get("required")
    if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
        raise bad("required must be a list of property names")
    if "items" in schema:
        check_schema(schema["items"], f"{where}.items", param)
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise bad("enum must be a list")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, list) or not subs:
                raise bad(f"{key} must be a non-empty list")
            for j, sub in enumerate(subs):
                check_schema(sub, f"{where}.{key}[{j}]", param)


def parse_tools(v: Any, param: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's `tools`: [{"type": "function", "function": {name, description,
    parameters, strict}}], checked (names unique, schemas readable)."""
    if v is None:
        return ()
    if not isinstance(v, list):
        raise bad_request(f"{param} must be a list of tools", param)
    out: list[Tool] = []
    for i, t in enumerate(v):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f'{where}.type must be "function"', param)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object", param)
        out.append(
            make_tool(
                fn.get("name"),
                fn.get("parameters"),
                fn.get("description"),
                fn.get("strict"),
                f"{where}.function",
                param,
            )
        )
    names = [t.name for t in out]
    for name in names:
        if names.count(name) > 1:
            raise bad_request(f"{param}: the function name {name!r} is given twice", param)
    return tuple(out)


def make_tool(
    name: Any,
    parameters: Any,
    description: Any,
    strict: Any,
    where: str,
    param: str,
    schema_key: str = "parameters",
) -> Tool:
    """One tool, checked; errors name `where` and the schema's field (`schema_key`)."""
    if not isinstance(name, str) or not name or len(name) > 64 or set(name) - _NAME_CHARS:
        raise bad_request(
            f"{where}.name must be 1 to 64 letters, digits, _ - or ., got {_short(name)}", param
        )
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", param)
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be a boolean", param)
    schema = {"type": "object", "properties": {}} if parameters is None else parameters
    check_schema(schema, f"{where}.{schema_key}", param)
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise bad_request(f"{where}.{schema_key} must be an object schema", param)
    return Tool(name, schema, description, bool(strict))


def _tool_choice(v: Any, tools: tuple[Tool, ...]) -> str:
    if v is None:
        return "auto"
    if v in ("none", "auto", "required"):
        if v == "required" and not tools:
            raise bad_request("tool_choice required needs tools", "tool_choice")
        return str(v)
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            f'"function": {{"name": ...}}}}, got {_short(v)}',
            "tool_choice",
        )
    if name not in {t.name for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not among tools", "tool_choice")
    return name


def _messages(v: Any) -> list[dict[str, Any]]:
    """Chat messages, checked, as templates take them: an assistant's `tool_calls` with
    their arguments as objects (vLLM's: templates write them with `tojson`), a `tool`
    message's `tool_call_id` one of an earlier call's."""
    if v is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(v, list) or not v:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    out = []
    call_ids: set[str] = set()
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {_short(m)}", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"{where}.role {role!r} is not supported: one of {', '.join(_ROLES)}", "messages"
            )
        allowed = _MESSAGE_KEYS[role]
        for key in m:
            if key not in allowed:
                raise bad_request(f"{where}.{key} is not supported", "messages")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"{where}.name must be a string", "messages")
        msg: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        if m.get("content") is None and (calls or m.get("reasoning_content")):
            msg["content"] = ""
        else:
            msg["content"] = _content(m.get("content"), where)
        if name is not None:
            msg["name"] = name
        if calls is not None:
            msg["tool_calls"] = _history_calls(calls, f"{where}.tool_calls")
            call_ids.update(c["id"] for c in msg["tool_calls"])
        out.append(msg | _turn_fields(m, where, call_ids))
    return out


def _turn_fields(m: dict[str, Any], where: str, call_ids: set[str]) -> dict[str, Any]:
    """An assistant's earlier reasoning (templates that want it back read it), a tool
    result's call id (one of an earlier assistant call's)."""
    out: dict[str, Any] = {}
    reasoning = m.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise bad_request(f"{where}.reasoning_content must be a string", "messages")
        out["reasoning_content"] = reasoning
    if m.get("role") == "tool":
        cid = m.get("tool_call_id")
        if not isinstance(cid, str):
            raise bad_request(f"{where}.tool_call_id is required (a string)", "messages")
        if cid not in call_ids:
            raise bad_request(
                f"{where}.tool_call_id {cid!r} matches no earlier assistant tool call",
                "messages",
            )
        out["tool_call_id"] = cid
    return out


_MESSAGE_KEYS = {
    "system": ("role", "content", "name"),
    "developer": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "tool_calls", "reasoning_content"),
    "tool": ("role", "content", "name", "tool_call_id"),
}


def _history_calls(v: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise bad_request(f"{where} must be a list", "messages")
    out = []
    for j, c in enumerate(v):
        at = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(c.get("id"), str):
            raise bad_request(f"{at} must have an id and a function", "messages")
        name, args = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not isinstance(args, str):
            raise bad_request(
                f"{at}.function needs a name and arguments (a JSON string)", "messages"
            )
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise bad_request(f"{at}.function.arguments is not JSON: {e}", "messages") from None
        if not isinstance(parsed, dict):
            raise bad_request(f"{at}.function.arguments must be a JSON object", "messages")
        out.append(
            {"id": c["id"], "type": "function", "function": {"name": name, "arguments": parsed}}
        )
    return out


def _content(v: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"{where}.content[{j}]: only text parts are supported, got "
                    f"{kind or _short(part)!s}",
                    "messages",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", "messages")
