"""The FastAPI app: OpenAI's endpoints over an `Engine`.

  GET  /health                200 once the model is loaded, 503 while it loads
  GET  /v1/models             the served model (`id`: the served name, `max_model_len`)
  POST /v1/completions        OpenAI's request and response shapes, streamed (SSE) or not
  POST /v1/chat/completions   the same, for chat messages
  POST /tokenize, /detokenize vLLM's: text or messages into ids, ids into text
  GET  /metrics               Prometheus text format

A request's body is read up to `max_body` bytes (else 413), then checked (protocol),
templated and tokenized in a thread off the event loop, and queued; the engine's worker
decodes it. The response starts with the first token, so a request that fails
before it (a copy failure in prefill) is a 500, and one that cannot be queued a 429; a
failure mid-stream ends the stream with an OpenAI error object, then `[DONE]`. A client
that goes away, queued or mid-stream, cancels its request: a queued one leaves the queue,
a decoding one stops within one token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from psr.serve import anthropic, chat, tools
from psr.serve.access import Access, AccessMiddleware
from psr.serve.decoding import GrammarError
from psr.serve.job import (
    Delta,
    Disconnected,
    Event,
    Failed,
    Finished,
    Job,
    Logprob,
    Params,
)
from psr.serve.metrics import CONTENT_TYPE
from psr.serve.output import THINK_OPEN, Output, merged
from psr.serve.protocol import (
    COMPLETION_MAX_TOKENS,
    SEED_LIMIT,
    APIError,
    ChatRequest,
    CompletionRequest,
    Structured,
    bad_request,
    check_unicode,
    parse_chat,
    parse_completion,
)
from psr.serve.worker import Engine, NotReady, QueueFull

log = logging.getLogger("psr.serve")

RETRY_AFTER_S = 1
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# How a request answered before decoding counts in psr_requests_total.
_OUTCOME = {401: "unauthorized", 413: "too_large", 429: "rejected", 503: "unavailable"}
DEFAULT_MAX_BODY = 8 * 2**20


def outcome_of(status: int) -> str:
    if status >= 500 and status != 503:
        return "error"
    return _OUTCOME.get(status, "invalid")


@dataclass(frozen=True)
class Options:
    """How the app answers: keys, CORS origins, the body limit, strictness, template."""

    access: Access = field(default_factory=Access)
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers
    max_body: int = DEFAULT_MAX_BODY
    strict: bool = False  # unknown fields: 400 (else ignored, with a warning header)
    chat_template: str | None = None  # a Jinja template overriding the checkpoint's
    tool_parser: str | None = None  # a tool-call format (tools.FORMATS) overriding detection


def error_response(e: APIError, path: str = "") -> JSONResponse:
    """The error in OpenAI's shape, or Anthropic's for the Messages API's paths."""
    body = anthropic.error_body(e) if path.startswith(MESSAGES) else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


MESSAGES = "/v1/messages"
_ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_json(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _delta(part: tools.Part) -> dict[str, Any]:
    """A chat chunk's delta for one part of the reply."""
    if isinstance(part, tools.Text):
        return {"reasoning_content" if part.kind == "reasoning" else "content": part.text}
    if isinstance(part, tools.CallStart):
        fn = {"name": part.name, "arguments": ""}
        call = {"index": part.index, "id": part.id, "type": "function", "function": fn}
        return {"tool_calls": [call]}
    return {"tool_calls": [{"index": part.index, "function": {"arguments": part.text}}]}


@dataclass
class _Prepared:
    """A checked request, tokenized: what the response needs besides the events."""

    kind: str  # "completion" or "chat"
    id: str
    request: CompletionRequest | ChatRequest
    prompt_ids: list[int]
    echo: str  # completions with echo: the prompt's text
    template: str | None  # chat: "checkpoint", "fallback" or "file"
    grammar: str | None = None  # the structured output's or the tool calls' grammar
    features: chat.Features | None = None  # chat: the template's tool format, reasoning
    inside: bool = False  # chat: the prompt opened a <think> block
    keep_special: bool = False  # the tool format's marker is a special token: keep them

    def output(self) -> Output:
        """The parser of this reply's text (reasoning, content, tool calls)."""
        f, req = self.features, self.request
        if f is None or not isinstance(req, ChatRequest):
            return Output()
        return Output(f.tool_format, req.offered, f.reasoning, self.inside)


class _Responder:
    """OpenAI's response objects for one request, whole or in chunks."""

    def __init__(self, p: _Prepared, model_name: str, engine: Engine, index: int = 0) -> None:
        self.p = p
        self.index = index  # the choice's index (n > 1)
        self.finished: Finished | None = None  # its Finished, once streamed
        self.model_name = model_name
        self.engine = engine
        self.logprobs = p.request.sampling.logprobs
        self.created = int(time.time())
        self.chat = p.kind == "chat"
        self.token_ids = p.request.return_token_ids
        self.offset = 0  # completions' text_offset of the next streamed token
        self.out = p.output()

    def finish_reason(self, f: Finished) -> str:
        return "tool_calls" if self.out.calls and f.finish_reason == "stop" else f.finish_reason

    def counted(self) -> None:
        """The reply's tool calls and parse failures, in /metrics."""
        self.engine.metrics.tool_calls.inc(self.out.calls)
        if self.out.failed is not None:
            self.engine.metrics.tool_parse_failures.inc()
            log.info("%s: tool-call markup returned as content: %s", self.p.id, self.out.failed)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.p.id, "object": obj, "created": self.created, "model": self.model_name}

    @staticmethod
    def usage(f: Finished) -> dict[str, Any]:
        return {
            "prompt_tokens": f.prompt_tokens,
            "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
        }

    def psr(self, f: Finished) -> dict[str, Any]:
        out = dict(f.psr)
        if self.p.template is not None:
            out["chat_template"] = self.p.template
        return out

    def _logprobs(self, rows: list[Logprob], offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs object: chat's `content` list, or completions' four lists."""
        if self.logprobs is None:
            return None
        if self.chat:

            def entry(token: str, lp: float) -> dict[str, Any]:
                return {"token": token, "logprob": lp, "bytes": list(token.encode())}

            content = [
                entry(r.token, r.logprob) | {"top_logprobs": [entry(t, v) for t, v in r.top]}
                for r in rows
            ]
            return {"content": content}
        offsets, at = [], offset
        for r in rows:
            offsets.append(at)
            at += len(r.token)
        return {
            "tokens": [r.token for r in rows],
            "token_logprobs": [r.logprob for r in rows],
            "top_logprobs": [dict(r.top) for r in rows],
            "text_offset": offsets,
        }

    def whole(self, deltas: list[Delta], f: Finished) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["message"] = self.message(text)
        else:
            choice["text"] = self.p.echo + text
        rows = [r for d in deltas for r in d.logprobs]
        choice |= {
            "logprobs": self._logprobs(rows, len(self.p.echo)),
            "finish_reason": self.finish_reason(f),
        }
        out = self._head("chat.completion" if self.chat else "text_completion")
        if self.token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
            self._prompt_ids(out, choice)
        out |= {"choices": [choice], "usage": self.usage(f), "psr": self.psr(f)}
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The assistant's message: content (null beside calls, as OpenAI's), the
        reasoning apart, the calls with their arguments as JSON text."""
        reasoning, content, calls = merged(self.out.feed(text) + self.out.finish())
        self.counted()
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["content"] = content or None
            msg["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls
            ]
        return msg

    def _prompt_ids(self, out: dict[str, Any], choice: dict[str, Any]) -> None:
        # Where vLLM puts them: on the response for chat, on the choice for completions.
        (out if self.chat else choice)["prompt_token_ids"] = list(self.p.prompt_ids)

    def chunk(
        self,
        text: str | None,
        token_ids: tuple[int, ...] = (),
        finish: Finished | None = None,
        first: bool = False,
        logprobs: tuple[Logprob, ...] = (),
        part: tools.Part | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if part is not None:
                delta |= _delta(part)
            elif text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {
            "logprobs": self._logprobs(list(logprobs), self.offset) if logprobs else None,
            "finish_reason": None if finish is None else self.finish_reason(finish),
        }
        if text:
            self.offset += len(text)
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
            if first:
                self._prompt_ids(out, choice)
        out["choices"] = [choice]
        if self.p.request.include_usage:
            out["usage"] = None
        if finish is not None:
            out["psr"] = self.psr(finish)
        return out

    def usage_chunk(self, f: Finished) -> dict[str, Any]:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out |= {"choices": [], "usage": self.usage(f), "psr": self.psr(f)}
        return out

    def _chat_chunks(self, ev: Delta) -> list[dict[str, Any]]:
        """A delta's chunks: one per part of the reply (reasoning, content, a call's
        start or arguments); its token ids and logprobs ride on the first."""
        parts: list[tools.Part | None] = list(self.out.feed(ev.text)) if ev.text else []
        if not parts and (ev.logprobs or (self.token_ids and ev.token_ids)):
            parts = [None]
        return [
            self.chunk(
                None if part is not None else "",
                ev.token_ids if j == 0 else (),
                logprobs=ev.logprobs if j == 0 else (),
                part=part,
            )
            for j, part in enumerate(parts)
        ]

    async def stream(
        self, first: Event, events: Callable[[], Awaitable[Event]], last: bool = True
    ) -> AsyncIterator[str]:
        """The SSE body from the first event on; the caller cancels the job on exit.
        `last` False (one of n choices): no usage chunk and no [DONE] (the caller's)."""
        if self.chat:
            yield _sse(self.chunk("", first=True))
        elif self.p.echo or self.token_ids:
            yield _sse(self.chunk(self.p.echo, first=True))
        ev = first
        while True:
            if isinstance(ev, Delta) and self.chat:
                for c in self._chat_chunks(ev):
                    yield _sse(c)
            elif isinstance(ev, Delta):
                if ev.text or ev.logprobs or (self.token_ids and ev.token_ids):
                    yield _sse(self.chunk(ev.text, ev.token_ids, logprobs=ev.logprobs))
            elif isinstance(ev, Finished):
                if self.chat:
                    for part in self.out.finish():
                        yield _sse(self.chunk(None, part=part))
                    self.counted()
                yield _sse(self.chunk(None if self.chat else "", finish=ev))
                self.finished = ev
                if last and self.p.request.include_usage:
                    yield _sse(self.usage_chunk(ev))
                if last:
                    yield SSE_DONE
                return
            elif isinstance(ev, Failed):
                yield _sse(APIError(ev.status, ev.message).body())
                if last:
                    yield SSE_DONE
                return
            else:  # Disconnected: nobody is reading
                return
            ev = await events()


def create_app(engine: Engine, *, served_name: str, options: Options | None = None) -> FastAPI:
    """The server's app; its lifespan starts the engine (the model loads in its worker)
    and stops it."""
    opts = options or Options()
    created = int(time.time())

    def ready() -> None:
        f = engine.chat_features = chat.features(
            engine.request_tokenizer, opts.chat_template, opts.tool_parser
        )
        log.info(f.describe())

    engine.on_ready = ready

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(
        title="psr serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    _add_middleware(app, engine, opts)
    _add_handlers(app, engine)
    _add_info_routes(app, engine, served_name, created)
    _add_generation_routes(app, engine, served_name, opts)
    return app


def _add_middleware(app: FastAPI, engine: Engine, opts: Options) -> None:
    app.add_middleware(
        AccessMiddleware,
        access=opts.access,
        on_unauthorized=lambda: engine.metrics.count("unauthorized"),
    )
    if opts.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Added last, so outermost: a preflight is answered before the key check.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(opts.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Warning"],
        )


def _add_handlers(app: FastAPI, engine: Engine) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{exc.detail}: {request.method} {request.url.path}"
        engine.metrics.count(outcome_of(exc.status_code))
        error = APIError(exc.status_code, message, headers=exc.headers)
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: OpenAI's body all the same (Starlette logs the traceback).
        log.error("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        engine.metrics.count("error")
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return error_response(error, request.url.path)


def _add_info_routes(app: FastAPI, engine: Engine, served_name: str, created: int) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.ready.is_set():
            return JSONResponse({"status": "ok"})
        status = "failed" if engine.load_error is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)

    def card() -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": served_name,
            "object": "model",
            "created": created,
            "owned_by": "psr",
        }
        if engine.ready.is_set():
            out["max_model_len"] = engine.context
        return out

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> JSONResponse:
        if model_id != served_name:
            return error_response(_unknown_model(model_id, served_name))
        return JSONResponse(card())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)


def _add_generation_routes(app: FastAPI, engine: Engine, served_name: str, opts: Options) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat")

    @app.post(MESSAGES)
    async def messages(request: Request) -> Response:
        return await _generate(request, "messages")

    @app.post(MESSAGES + "/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await _guarded(request, lambda b: _count_tokens(engine, served_name, opts, b))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _guarded(request, lambda b: _tokenize(engine, served_name, opts, b))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _guarded(request, lambda b: _detokenize(engine, served_name, b))

    async def _guarded(request: Request, fn: Callable[[Any], dict[str, Any]]) -> Response:
        rid = _request_id(request)
        try:
            body = await _body(request, opts.max_body)
            if not engine.ready.is_set():
                raise _unavailable(engine)
            out = await asyncio.to_thread(fn, body)
        except APIError as e:
            engine.metrics.count(outcome_of(e.status))
            log.info("[%s] %s %d: %s", rid, request.url.path, e.status, e.message)
            return error_response(e, request.url.path)
        return JSONResponse(out)

    async def _generate(request: Request, kind: str) -> Response:
        rid = _response_id(kind)
        request_id = _request_id(request)
        path = request.url.path
        try:
            body = await _body(request, opts.max_body)
            # Checks, the template, tokenizing and the grammar: in a thread (a long
            # prompt must not stall the streams the event loop is writing).
            p = await asyncio.to_thread(_prepare, engine, served_name, rid, kind, body, opts)
            jobs = _submit(engine, rid, request_id, p)
        except APIError as e:
            engine.metrics.count(outcome_of(e.status))
            log.info("%s [%s] %d: %s", rid, request_id, e.status, e.message)
            return error_response(e, path)
        if p.request.ignored:
            names = ", ".join(p.request.ignored)
            log.warning("%s [%s] ignored unknown fields: %s", rid, request_id, names)
        if len(jobs) == 1:
            response = await _respond(engine, jobs[0], p, served_name, request)
        else:
            response = await _respond_many(engine, jobs, p, served_name, request)
        if p.request.ignored:
            response.headers["Warning"] = f'299 psr "unknown fields ignored: {names}"'
        return response


def _response_id(kind: str) -> str:
    """A new response's id, as the API of `kind` spells its ids."""
    if kind == "messages":
        return anthropic.message_id()
    return f"{_ID_PREFIX[kind]}-{uuid.uuid4().hex[:24]}"


def _submit(engine: Engine, rid: str, request_id: str, p: _Prepared) -> list[Job]:
    """The prepared request's jobs (best_of of them, the i-th sampled with seed + i),
    queued together (a full queue: 429 with Retry-After; an engine not ready: 503)."""
    s = p.request.sampling
    params = _params(engine, p)
    jobs = [
        Job(
            rid if i == 0 else f"{rid}-{i}",
            p.prompt_ids,
            replace(params, seed=(params.seed + i) % SEED_LIMIT) if params.do_sample else params,
            s.stop,
            sampling=s,
            grammar=p.grammar,
            request_id=request_id,
            keep_special=p.keep_special,
            score=s.best_of > s.n,
        )
        for i in range(s.best_of)
    ]
    try:
        engine.submit(*jobs)
    except QueueFull:
        raise APIError(
            429,
            f"the queue is full ({engine.max_queue} requests wait while one decodes); retry later",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except NotReady:
        raise _unavailable(engine) from None
    return jobs


def _request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))


def _unknown_model(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"the model {name!r} does not exist: this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


def _unavailable(engine: Engine) -> APIError:
    if engine.load_error is not None:
        return APIError(503, f"the model failed to load: {engine.load_error}")
    if engine.ready.is_set():
        return APIError(503, "the server is shutting down")
    return APIError(503, "the model is loading; retry when /health answers 200", code="loading")


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body exceeds the server's limit of {limit} bytes (--max-body)",
        type="invalid_request_error",
        code="request_too_large",
    )


async def _body(request: Request, limit: int) -> Any:
    """The JSON body, read up to `limit` bytes (413 beyond: by Content-Length before
    reading, else while reading), decoded in a thread."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw) if len(raw) < 2**16 else await asyncio.to_thread(json.loads, raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def _encode(engine: Engine, text: str, special: bool = True) -> list[int]:
    """Text into ids with the requests' tokenizer (hold engine.request_lock)."""
    return list(engine.request_tokenizer(text, add_special_tokens=special)["input_ids"])


def _chat_ids(engine: Engine, req: ChatRequest, template: str | None) -> tuple[list[int], str, str]:
    tools_json = [t.openai() for t in req.tools] or None
    try:
        return chat.prompt_ids(
            engine.request_tokenizer, req.messages, template, tools_json, req.template_kwargs
        )
    except Exception as e:  # a checkpoint's template may refuse a conversation
        raise bad_request(f"the chat template failed: {e}", "messages") from None


def _marker_is_special(engine: Engine, req: ChatRequest, f: chat.Features) -> bool:
    """Whether the offered tools' format marks calls with a special token, which the
    reply's text must keep to be parsed."""
    if not req.offered or f.tool_format is None:
        return False
    special = getattr(engine.request_tokenizer, "all_special_tokens", None) or ()
    added = getattr(engine.request_tokenizer, "added_tokens_decoder", None) or {}
    names = set(special) | {str(t) for t in added.values() if getattr(t, "special", False)}
    return f.tool_format.marker in names


def _budget(req: ChatRequest) -> int:
    """The reasoning budget of a forced call after an opened <think>: half the reply's
    tokens (the call needs the rest), at most THINK_BUDGET."""
    n = req.sampling.max_tokens
    return THINK_BUDGET if n is None else max(1, min(n // 2, THINK_BUDGET))


THINK_BUDGET = 1024


def _tool_grammar(engine: Engine, req: ChatRequest, f: chat.Features, inside: bool) -> str | None:
    """The grammar of a reply that may call tools: the calls alone (tool_choice required
    or named), or text that turns into calls at the format's marker (auto)."""
    if not req.offered:
        return None
    if f.tool_format is None:
        raise bad_request(f"this server does not serve tool calls: {f.why}", "tools")
    lark = tools.grammar(
        f.tool_format, req.offered, req.forced, req.several, _budget(req) if inside else None
    )
    try:
        return engine.grammars().grammar(Structured("lark", lark))
    except ImportError:
        if req.forced:
            raise bad_request(
                "tool_choice required or named needs llguidance: pip install 'psr[serve]'",
                "tool_choice",
            ) from None
        return None  # auto: the calls are parsed, not constrained
    except GrammarError as e:
        raise bad_request(f"the tools' schemas do not compile to a grammar: {e}", "tools") from None


def _prepare(
    engine: Engine, served: str, rid: str, kind: str, body: Any, opts: Options
) -> _Prepared:
    """Check and tokenize a request (in a worker thread of the event loop's pool)."""
    req: CompletionRequest | ChatRequest
    if kind == "completion":
        req = parse_completion(body, opts.strict)
    elif kind == "messages":
        req = anthropic.parse_messages(body, opts.strict)
    else:
        req = parse_chat(body, opts.strict)
    if req.model is not None and req.model != served:
        raise _unknown_model(req.model, served)
    if not engine.ready.is_set():
        raise _unavailable(engine)
    echo, template, grammar = "", None, None
    features: chat.Features | None = None
    inside = keep_special = False
    _check_length(engine, req)
    with engine.request_lock:
        if isinstance(req, ChatRequest):
            features = engine.chat_features
            ids, template, text = _chat_ids(engine, req, opts.chat_template)
            inside = (
                features is not None and features.reasoning and text.rstrip().endswith(THINK_OPEN)
            )
            if features is not None:
                grammar = _tool_grammar(engine, req, features, inside)
                keep_special = _marker_is_special(engine, req, features)
        elif isinstance(req.prompt, str):
            ids = _encode(engine, req.prompt)
            if req.echo:
                echo = req.prompt
        else:
            ids = req.prompt
            _check_vocab(engine, ids, "prompt")
            if req.echo:
                echo = engine.request_decode(ids)
        structured = req.sampling.structured
        if structured is not None:
            try:
                grammar = engine.grammars().grammar(structured)
            except ImportError:
                raise bad_request(
                    "structured output needs llguidance on the server: pip install 'psr[serve]'",
                    "response_format",
                ) from None
            except GrammarError as e:
                raise bad_request(
                    f"the structured output's grammar: {e}", "response_format"
                ) from None
    if not ids:
        raise bad_request("the prompt encodes to no tokens", "prompt")
    return _Prepared(kind, rid, req, ids, echo, template, grammar, features, inside, keep_special)


def _check_length(engine: Engine, req: CompletionRequest | ChatRequest) -> None:
    """Refuse, without tokenizing, text that has more tokens than the context for certain
    (a 4 MB prompt takes seconds to tokenize, all to be refused)."""
    ctx, per = engine.context, engine.bytes_per_token
    if ctx is None or per is None:
        return
    if isinstance(req, ChatRequest):
        size = sum(len(m["content"].encode()) for m in req.messages)
    elif isinstance(req.prompt, str):
        size = len(req.prompt.encode())
    else:
        return
    least = -(-size // per)  # tokens at least (a token stands for at most `per` bytes)
    if least >= ctx:  # no room for one new token (shorter ones: _params' exact check)
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        raise bad_request(
            f"the prompt is {size} bytes, so at least {least} tokens (at most {per} bytes "
            f"per token), beyond the model's context of {ctx} tokens",
            param,
            code="context_length_exceeded",
        )


def _check_vocab(engine: Engine, ids: list[int], param: str) -> None:
    vocab = engine.model.config.vocab_size
    if ids and max(ids) >= vocab:
        raise bad_request(f"token id {max(ids)} is outside the vocabulary of {vocab}", param)


def _tokenize(engine: Engine, served: str, opts: Options, body: Any) -> dict[str, Any]:
    """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (add_generation_prompt),
    `add_special_tokens` (default true, prompts only) -> count, max_model_len, tokens."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key, value in body.items():
        check_unicode(value, key)
    model = body.get("model")
    if model is not None and model != served:
        raise _unknown_model(str(model), served)
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise bad_request("add_special_tokens must be a boolean", "add_special_tokens")
    with engine.request_lock:
        if "messages" in body:
            req = parse_chat({"messages": body["messages"], "tools": body.get("tools")})
            ids, _, _ = _chat_ids(engine, req, opts.chat_template)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("prompt must be a string (or give messages)", "prompt")
            ids = _encode(engine, prompt, special)
    return {"count": len(ids), "max_model_len": engine.context, "tokens": ids}


def _count_tokens(engine: Engine, served: str, opts: Options, body: Any) -> dict[str, Any]:
    """Anthropic's /v1/messages/count_tokens: the prompt's tokens, as the reply would
    be prompted (max_tokens is not needed)."""
    if isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}
    req = anthropic.parse_messages(body)
    if req.model is not None and req.model != served:
        raise _unknown_model(req.model, served)
    with engine.request_lock:
        ids, _, _ = _chat_ids(engine, req, opts.chat_template)
    return {"input_tokens": len(ids)}


def _detokenize(engine: Engine, served: str, body: Any) -> dict[str, Any]:
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served:
        raise _unknown_model(str(model), served)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise bad_request("tokens must be a list of token ids (integers >= 0)", "tokens")
    _check_vocab(engine, ids, "tokens")
    with engine.request_lock:
        return {"prompt": engine.request_decode(ids, skip_special=False)}


def _params(engine: Engine, p: _Prepared) -> Params:
    s = p.request.sampling
    n, ctx = len(p.prompt_ids), engine.context
    max_tokens = s.max_tokens
    if max_tokens is None and ctx is not None and n >= ctx:  # chat: the rest of the context
        raise bad_request(
            f"the prompt is {n} tokens, which fills the model's context of {ctx} tokens: "
            "no room for a completion (shorten the messages)",
            "messages",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = COMPLETION_MAX_TOKENS if ctx is None else ctx - n
    if ctx is not None and n + max_tokens > ctx:
        raise bad_request(
            f"the prompt's {n} tokens + max_tokens {max_tokens} exceed the model's context of "
            f"{ctx} tokens",
            "max_tokens",
            code="context_length_exceeded",
        )
    if not s.greedy and engine.model.drafter is not None:
        raise bad_request(
            "this server decodes speculatively, which is greedy: temperature must be 0",
            "temperature",
        )
    if engine.model.drafter is not None and (
        s.logprobs is not None
        or p.grammar is not None
        or s.repetition_penalty != 1.0
        or s.presence_penalty
        or s.frequency_penalty
    ):
        raise bad_request(
            "this server decodes speculatively: no logprobs, penalties or structured output"
        )
    if s.greedy:
        return Params(max_tokens)
    seed = secrets.randbelow(2**63) if s.seed is None else s.seed
    return Params(max_tokens, True, s.temperature, s.top_k, s.top_p, seed, s.min_p)


async def _watch_disconnect(request: Request, engine: Engine, *jobs: Job) -> None:
    """Cancel `jobs` when the client goes away (the body has been read: what the server
    receives next is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            break
    for job in jobs:
        engine.cancel(job)
        job.events.put_nowait(Disconnected())


async def _respond(
    engine: Engine, job: Job, p: _Prepared, served: str, request: Request
) -> Response:
    openai_r = _Responder(p, served, engine)
    r: _Responder | anthropic.MessagesResponder = openai_r
    if p.kind == "messages":  # the same parser and counters, Anthropic's shapes
        r = anthropic.MessagesResponder(
            p.id, served, openai_r.out, openai_r.counted, len(p.prompt_ids)
        )
    path = request.url.path
    watch = asyncio.create_task(_watch_disconnect(request, engine, job))
    handed_over = False
    try:
        first = await job.events.get()
        if isinstance(first, (Failed, Disconnected)):
            return _failure(first, path)
        if p.request.stream:
            watch.cancel()  # from here Starlette cancels the stream when the client leaves

            async def body() -> AsyncIterator[str]:
                try:
                    async for chunk in r.stream(first, job.events.get):
                        yield chunk
                finally:
                    engine.cancel(job)  # no-op once finished

            handed_over = True
            return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
        deltas: list[Delta] = []
        ev: Event = first
        while isinstance(ev, Delta):
            deltas.append(ev)
            ev = await job.events.get()
        if not isinstance(ev, Finished):
            return _failure(ev, path)
        return JSONResponse(r.whole(deltas, ev))
    finally:
        watch.cancel()
        if not handed_over:
            engine.cancel(job)  # no-op once finished; else (handler cancelled) stop it


async def _respond_many(
    engine: Engine, jobs: list[Job], p: _Prepared, served: str, request: Request
) -> Response:
    """n > 1 (or best_of): one choice per job, each decoded as its own request would be
    (in one batch with --parallel); whole, the best_of's n of highest mean logprob."""
    rs = [_Responder(p, served, engine, i) for i in range(len(jobs))]
    watch = asyncio.create_task(_watch_disconnect(request, engine, *jobs))
    handed_over = False
    try:
        firsts = [await job.events.get() for job in jobs]
        bad = next((ev for ev in firsts if isinstance(ev, (Failed, Disconnected))), None)
        if bad is not None:
            return _failure(bad, request.url.path)
        if p.request.stream:
            watch.cancel()
            handed_over = True
            return StreamingResponse(
                _merged_streams(engine, jobs, rs, firsts), media_type="text/event-stream",
                headers=SSE_HEADERS,
            )  # fmt: skip
        done: list[tuple[list[Delta], Finished]] = []
        for job, ev in zip(jobs, firsts, strict=True):
            deltas: list[Delta] = []
            while isinstance(ev, Delta):
                deltas.append(ev)
                ev = await job.events.get()
            if not isinstance(ev, Finished):
                return _failure(ev, request.url.path)
            done.append((deltas, ev))
        return JSONResponse(_choices(p, rs, done))
    finally:
        watch.cancel()
        if not handed_over:
            for job in jobs:
                engine.cancel(job)


def _choices(
    p: _Prepared, rs: list[_Responder], done: list[tuple[list[Delta], Finished]]
) -> dict[str, Any]:
    """The whole response of several choices: the n best (best_of) by mean logprob."""
    order = list(range(len(done)))
    n = p.request.sampling.n
    if len(done) > n:
        order.sort(key=lambda i: -done[i][1].logprob_sum / max(done[i][1].completion_tokens, 1))
        order = order[:n]
    out = rs[0].whole(*done[0])
    out["choices"] = []
    for k, i in enumerate(order):
        rs[i].index = k
        out["choices"].append(rs[i].whole(*done[i])["choices"][0])
    out["usage"] = _usage([f for _, f in done])
    out["psr"] = {"choices": [rs[i].psr(done[i][1]) for i in order]}
    return out


def _usage(finished: list[Finished]) -> dict[str, Any]:
    """Usage over several choices: the prompt once, every decoded token."""
    out = _Responder.usage(finished[0])
    out["completion_tokens"] = sum(f.completion_tokens for f in finished)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


async def _merged_streams(
    engine: Engine, jobs: list[Job], rs: list[_Responder], firsts: list[Event]
) -> AsyncIterator[str]:
    """The choices' chunks as they come, then the usage (if asked) and one [DONE]."""
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    async def pump(r: _Responder, job: Job, first: Event) -> None:
        try:
            async for chunk in r.stream(first, job.events.get, last=False):
                await queue.put(chunk)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(*a)) for a in zip(rs, jobs, firsts, strict=True)]
    try:
        left = len(tasks)
        while left:
            chunk = await queue.get()
            if chunk is None:
                left -= 1
            else:
                yield chunk
        finished = [r.finished for r in rs]
        if all(f is not None for f in finished):
            if rs[0].p.request.include_usage:
                tail = rs[0].usage_chunk(finished[0])  # type: ignore[arg-type]
                tail["usage"] = _usage(finished)  # type: ignore[arg-type]
                yield _sse(tail)
        yield SSE_DONE
    finally:
        for t in tasks:
            t.cancel()
        for job in jobs:
            engine.cancel(job)  # no-op once finished


def _failure(ev: Failed | Disconnected, path: str) -> Response:
    if isinstance(ev, Disconnected):
        return Response(status_code=499)  # nobody is listening
    return error_response(APIError(ev.status, ev.message), path)
