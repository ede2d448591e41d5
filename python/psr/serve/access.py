"""Who may call the server, and the request id: one ASGI middleware around the app.

  keys        with API keys set, every route under /v1 (and /tokenize, /detokenize)
              needs `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`,
              else a 401 in OpenAI's error shape (Anthropic's under /v1/messages);
              /health and /metrics too when `protect_all` is set
  request id  `X-Request-Id` taken from the request (or made), put in the ASGI scope's
              state for the log line, and echoed on every response

A pure ASGI middleware, not Starlette's BaseHTTPMiddleware: the app's streaming
responses and its disconnect watch read `receive` directly.
CORS (`--allowed-origins`) is Starlette's CORSMiddleware outside this one, so a preflight
is answered without a key and a 401 carries the CORS headers.
"""

from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID = "x-request-id"
MAX_REQUEST_ID = 128  # a longer or non-printable id is replaced by a fresh one
OPEN_PATHS = ("/health", "/metrics")


@dataclass(frozen=True)
class Access:
    keys: tuple[str, ...] = ()
    protect_all: bool = False  # /health and /metrics need the key too

    def needs_key(self, path: str) -> bool:
        if not self.keys:
            return False
        return self.protect_all or path not in OPEN_PATHS

    def allowed(self, header: str | None, api_key: str | None = None) -> bool:
        """`Authorization: Bearer KEY` (OpenAI's), or `x-api-key: KEY` (Anthropic's)."""
        if header is not None and header.startswith("Bearer "):
            return self._known(header[len("Bearer ") :].strip())
        return api_key is not None and self._known(api_key.strip())

    def _known(self, key_given: str) -> bool:
        given = key_given.encode()
        # Every key compared, in constant time each: no early exit that times a match.
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(given, key.encode())
        return ok


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


def request_id_of(given: str | None) -> str:
    if given and len(given) <= MAX_REQUEST_ID and given.isprintable() and given.isascii():
        return given
    return uuid.uuid4().hex


def unauthorized_body(has_header: bool, anthropic: bool = False) -> bytes:
    message = (
        "Incorrect API key provided"
        if has_header
        else "Missing API key: send Authorization: Bearer KEY (or x-api-key: KEY)"
    )
    if anthropic:  # the Messages API's error shape
        error = {"type": "authentication_error", "message": message}
        return json.dumps({"type": "error", "error": error}).encode()
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    ).encode()


class AccessMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        access: Access,
        on_unauthorized: Callable[[], None] = lambda: None,
    ) -> None:
        self.app, self.access, self.on_unauthorized = app, access, on_unauthorized

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(_header(scope, b"x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid
        echo = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), echo]
            await send(message)

        if scope["method"] != "OPTIONS" and self.access.needs_key(scope["path"]):
            auth = _header(scope, b"authorization")
            api_key = _header(scope, b"x-api-key")
            if not self.access.allowed(auth, api_key):
                self.on_unauthorized()
                given = auth is not None or api_key is not None
                body = unauthorized_body(given, scope["path"].startswith("/v1/messages"))
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer"),
                        ],
                    }
                )
                await send_with_id({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send_with_id)
