"""The FastAPI app: OpenAI's endpoints over an `Engine`.

  GET  /health                200 once the model is loaded, 503 while it loads
  GET  /v1/models             the served model (`id`: the served name)
  POST /v1/completions        OpenAI's request and response shapes, streamed (SSE) or not
  POST /v1/chat/completions   the same, for chat messages
  GET  /metrics               Prometheus text format

A request is checked (protocol), tokenized and queued in the event loop; the engine's
worker decodes it. The response starts with the first token, so a request that fails
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
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from psr.serve import chat
from psr.serve.engine import (
    Delta,
    Disconnected,
    Engine,
    Event,
    Failed,
    Finished,
    Job,
    NotReady,
    Params,
    QueueFull,
)
from psr.serve.metrics import CONTENT_TYPE
from psr.serve.protocol import (
    COMPLETION_MAX_TOKENS,
    APIError,
    ChatRequest,
    CompletionRequest,
    bad_request,
    parse_chat,
    parse_completion,
)

log = logging.getLogger("psr.serve")

RETRY_AFTER_S = 1
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_OUTCOME = {404: "invalid", 429: "rejected", 503: "unavailable"}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_json(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class _Prepared:
    """A checked request, tokenized: what the response needs besides the events."""

    kind: str  # "completion" or "chat"
    id: str
    request: CompletionRequest | ChatRequest
    prompt_ids: list[int]
    echo: str  # completions with echo: the prompt's text
    template: str | None  # chat: "checkpoint" or "fallback"


class _Responder:
    """OpenAI's response objects for one request, whole or in chunks."""

    def __init__(self, p: _Prepared, model_name: str) -> None:
        self.p = p
        self.model_name = model_name
        self.created = int(time.time())
        self.chat = p.kind == "chat"
        self.token_ids = p.request.return_token_ids

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.p.id, "object": obj, "created": self.created, "model": self.model_name}

    @staticmethod
    def usage(f: Finished) -> dict[str, int]:
        return {
            "prompt_tokens": f.prompt_tokens,
            "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
        }

    def psr(self, f: Finished) -> dict[str, Any]:
        out = dict(f.psr)
        if self.p.template is not None:
            out["chat_template"] = self.p.template
        return out

    def whole(self, deltas: list[Delta], f: Finished) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = self.p.echo + text
        choice |= {"logprobs": None, "finish_reason": f.finish_reason}
        out = self._head("chat.completion" if self.chat else "text_completion")
        if self.token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
            self._prompt_ids(out, choice)
        out |= {"choices": [choice], "usage": self.usage(f), "psr": self.psr(f)}
        return out

    def _prompt_ids(self, out: dict[str, Any], choice: dict[str, Any]) -> None:
        # Where vLLM puts them: on the response for chat, on the choice for completions.
        (out if self.chat else choice)["prompt_token_ids"] = list(self.p.prompt_ids)

    def chunk(
        self,
        text: str | None,
        token_ids: tuple[int, ...] = (),
        finish: Finished | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {
            "logprobs": None,
            "finish_reason": None if finish is None else finish.finish_reason,
        }
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

    async def stream(
        self, first: Event, events: Callable[[], Awaitable[Event]]
    ) -> AsyncIterator[str]:
        """The SSE body from the first event on; the caller cancels the job on exit."""
        if self.chat:
            yield _sse(self.chunk("", first=True))
        elif self.p.echo or self.token_ids:
            yield _sse(self.chunk(self.p.echo, first=True))
        ev = first
        while True:
            if isinstance(ev, Delta):
                if ev.text or (self.token_ids and ev.token_ids):
                    yield _sse(self.chunk(ev.text, ev.token_ids))
            elif isinstance(ev, Finished):
                yield _sse(self.chunk(None if self.chat else "", finish=ev))
                if self.p.request.include_usage:
                    yield _sse(self.usage_chunk(ev))
                yield SSE_DONE
                return
            elif isinstance(ev, Failed):
                yield _sse(APIError(ev.status, ev.message).body())
                yield SSE_DONE
                return
            else:  # Disconnected: nobody is reading
                return
            ev = await events()


def create_app(engine: Engine, *, served_name: str) -> FastAPI:
    """The server's app; its lifespan starts the engine (the model loads in its worker)
    and stops it."""
    created = int(time.time())

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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: OpenAI's body all the same (Starlette logs the traceback).
        log.error("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.ready.is_set():
            return JSONResponse({"status": "ok"})
        status = "failed" if engine.load_error is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)

    def card() -> dict[str, Any]:
        return {"id": served_name, "object": "model", "created": created, "owned_by": "psr"}

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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat")

    async def _generate(request: Request, kind: str) -> Response:
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            p = _prepare(engine, served_name, rid, kind, await _body(request))
            job = Job(rid, p.prompt_ids, _params(engine, p), p.request.sampling.stop)
            try:
                engine.submit(job)
            except QueueFull:
                raise APIError(
                    429,
                    f"the queue is full ({engine.max_queue} requests wait while one decodes); "
                    "retry later",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            except NotReady:
                raise _unavailable(engine) from None
        except APIError as e:
            engine.metrics.count(_OUTCOME.get(e.status, "invalid"))
            log.info("%s %d: %s", rid, e.status, e.message)
            return error_response(e)
        return await _respond(engine, job, p, served_name, request)

    return app


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


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def _prepare(engine: Engine, served: str, rid: str, kind: str, body: Any) -> _Prepared:
    """Check and tokenize a request (in the event loop: no decoding here)."""
    req: CompletionRequest | ChatRequest
    req = parse_completion(body) if kind == "completion" else parse_chat(body)
    if req.model is not None and req.model != served:
        raise _unknown_model(req.model, served)
    if not engine.ready.is_set():
        raise _unavailable(engine)
    tok = engine.model.tokenizer
    echo, template = "", None
    if isinstance(req, ChatRequest):
        try:
            with engine.tokenizer_lock:
                ids, template = chat.prompt_ids(tok, req.messages)
        except Exception as e:  # a checkpoint's template may refuse a conversation
            raise bad_request(f"the chat template failed: {e}", "messages") from None
    elif isinstance(req.prompt, str):
        with engine.tokenizer_lock:
            ids = list(tok(req.prompt)["input_ids"])
        if req.echo:
            echo = req.prompt
    else:
        ids = req.prompt
        vocab = engine.model.config.vocab_size
        if max(ids) >= vocab:
            raise bad_request(
                f"prompt token id {max(ids)} is outside the vocabulary of {vocab}", "prompt"
            )
        if req.echo:
            echo = engine.decode_text(ids)
    if not ids:
        raise bad_request("the prompt encodes to no tokens", "prompt")
    return _Prepared(kind, rid, req, ids, echo, template)


def _params(engine: Engine, p: _Prepared) -> Params:
    s = p.request.sampling
    n, ctx = len(p.prompt_ids), engine.context
    max_tokens = s.max_tokens
    param = "max_tokens"
    if max_tokens is None:  # chat: the rest of the context
        max_tokens = COMPLETION_MAX_TOKENS if ctx is None else ctx - n
        param = "messages"
    if ctx is not None and (max_tokens < 1 or n + max_tokens > ctx):
        raise bad_request(
            f"the prompt's {n} tokens + max_tokens {max_tokens} exceed the model's context of "
            f"{ctx} tokens",
            param,
            code="context_length_exceeded",
        )
    if not s.greedy and engine.model.drafter is not None:
        raise bad_request(
            "this server decodes speculatively, which is greedy: temperature must be 0",
            "temperature",
        )
    if s.greedy:
        return Params(max_tokens)
    seed = secrets.randbelow(2**63) if s.seed is None else s.seed
    return Params(max_tokens, True, s.temperature, s.top_k, s.top_p, seed)


async def _watch_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """Cancel `job` when the client goes away (the body has been read: what the server
    receives next is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            break
    engine.cancel(job)
    job.events.put_nowait(Disconnected())


async def _respond(
    engine: Engine, job: Job, p: _Prepared, served: str, request: Request
) -> Response:
    r = _Responder(p, served)
    watch = asyncio.create_task(_watch_disconnect(request, engine, job))
    handed_over = False
    try:
        first = await job.events.get()
        if isinstance(first, (Failed, Disconnected)):
            return _failure(first)
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
            return _failure(ev)
        return JSONResponse(r.whole(deltas, ev))
    finally:
        watch.cancel()
        if not handed_over:
            engine.cancel(job)  # no-op once finished; else (handler cancelled) stop it


def _failure(ev: Failed | Disconnected) -> Response:
    if isinstance(ev, Disconnected):
        return Response(status_code=499)  # nobody is listening
    return error_response(APIError(ev.status, ev.message))
