"""OpenAI request bodies, checked: `parse_completion` / `parse_chat` turn a decoded JSON
body into a request, or raise `APIError`, whose `body()` is OpenAI's error object.

Every parameter OpenAI defines is either honoured or refused with a 400 that names it;
none is silently ignored. Extensions, as vLLM and llama.cpp accept them: `top_k`, and
`return_token_ids` (the prompt's and the completion's token ids in the response).
Torch-free: no model is needed to check a request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
class Sampling:
    """How to decode one request: what `model.generate` and the stop strings take."""

    max_tokens: int | None  # None: the rest of the model's context
    temperature: float  # 0: greedy
    top_p: float
    top_k: int  # 0: off
    seed: int | None  # None: a fresh random seed per request
    stop: tuple[str, ...]

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


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]
    sampling: Sampling
    stream: bool
    include_usage: bool
    return_token_ids: bool


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


def _check_keys(body: dict[str, Any], known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise bad_request(f"unrecognized request argument supplied: {key}", key)


# Accepted and without effect on decoding: end-user and bookkeeping tags.
_METADATA = frozenset({"user", "metadata"})
_SAMPLING = frozenset({"temperature", "top_p", "top_k", "seed", "stop", "max_tokens"})
_STREAM = frozenset({"stream", "stream_options"})
# Checked by _common_refusals: accepted only with values that change nothing.
_REFUSED_COMMON = frozenset(
    {"n", "logit_bias", "logprobs", "presence_penalty", "frequency_penalty"}
)
COMPLETION_KEYS = frozenset(
    {"model", "prompt", "echo", "best_of", "suffix", "return_token_ids"}
    | _METADATA
    | _SAMPLING
    | _STREAM
    | _REFUSED_COMMON
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


def _sampling(body: dict[str, Any], max_tokens: int | None) -> Sampling:
    temperature = _number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", -1)
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,  # OpenAI's default
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k,  # -1 and 0: keep every token
        seed=_int(body, "seed", 0, SEED_LIMIT),
        stop=_stop(body.get("stop")),
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
    _refuse_unless(body, "n", (1,), "psr decodes one sequence per request (n must be 1)")
    _refuse_unless(body, "logit_bias", ({},), "psr's decoding takes no logit bias")
    for key in ("presence_penalty", "frequency_penalty"):
        _refuse_unless(body, key, (0, 0.0), "psr's decoding applies no penalties")


def _check_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ------------------------------------------------------------------ the two requests


def parse_completion(body: Any) -> CompletionRequest:
    """A /v1/completions body, checked (APIError 400 naming the parameter)."""
    body = _check_body(body)
    _check_keys(body, COMPLETION_KEYS)
    _common_refusals(body)
    _refuse_unless(body, "best_of", (1,), "psr decodes one sequence per request")
    _refuse_unless(body, "suffix", ("",), "psr does not insert text (no suffix)")
    _refuse_unless(
        body, "logprobs", (), "psr's generate returns no logits, so no logprobs are reported"
    )
    max_tokens = _int(body, "max_tokens", 1)
    stream, include_usage = _stream(body)
    return CompletionRequest(
        model=_model(body),
        prompt=_prompt(body.get("prompt")),
        sampling=_sampling(body, COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens),
        stream=stream,
        include_usage=include_usage,
        echo=_bool(body, "echo"),
        return_token_ids=_bool(body, "return_token_ids"),
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


_ROLES = ("system", "developer", "user", "assistant")


def parse_chat(body: Any) -> ChatRequest:
    """A /v1/chat/completions body, checked (APIError 400 naming the parameter)."""
    body = _check_body(body)
    _check_keys(body, CHAT_KEYS)
    _common_refusals(body)
    _refuse_unless(
        body, "logprobs", (False,), "psr's generate returns no logits, so no logprobs are reported"
    )
    _refuse_unless(body, "top_logprobs", (), "psr reports no logprobs")
    for key in ("tools", "functions"):
        _refuse_unless(body, key, ([],), "psr serves no tool or function calls")
    for key in ("tool_choice", "function_call"):
        _refuse_unless(body, key, ("none",), "psr serves no tool or function calls")
    if body.get("parallel_tool_calls") is not None:
        _bool(body, "parallel_tool_calls")  # a well-typed flag; without tools it changes nothing
    _response_format(body.get("response_format"))
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
    max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", 1)
    stream, include_usage = _stream(body)
    return ChatRequest(
        model=_model(body),
        messages=_messages(body.get("messages")),
        sampling=_sampling(body, max_tokens),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
    )


def _response_format(v: Any) -> None:
    if v is None or v == {"type": "text"}:
        return
    kind = v.get("type") if isinstance(v, dict) else None
    raise bad_request(
        f"response_format {kind or _short(v)!s} is not supported: psr decodes free text "
        "(no JSON mode or schema)",
        "response_format",
    )


def _messages(v: Any) -> list[dict[str, str]]:
    if v is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(v, list) or not v:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {_short(m)}", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"{where}.role {role!r} is not supported: one of {', '.join(_ROLES)} "
                "(psr serves no tool calls)",
                "messages",
            )
        for key in m:
            if key not in ("role", "content", "name"):
                raise bad_request(f"{where}.{key} is not supported", "messages")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"{where}.name must be a string", "messages")
        msg = {"role": role, "content": _content(m.get("content"), where)}
        if name is not None:
            msg["name"] = name
        out.append(msg)
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
