"""The access middleware and the CLI's access options, without a model: a bare ASGI app
behind `AccessMiddleware`, driven through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from psr.cli import build_parser
from psr.cli.serve import api_keys, is_loopback, serve_options
from psr.serve.access import Access, AccessMiddleware
from psr.serve.protocol import APIError, parse_chat, parse_completion


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _get(access: Access, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        app = AccessMiddleware(_ok, access)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get(path, headers=headers or {})

    return asyncio.run(go())


def test_health_and_metrics_open_unless_protect_all() -> None:
    keyed = Access(("k1", "k2"))
    for path in ("/health", "/metrics"):
        assert _get(keyed, path).status_code == 200
        assert _get(Access(("k1",), protect_all=True), path).status_code == 401
    assert _get(keyed, "/v1/models").status_code == 401
    assert _get(keyed, "/v1/models", {"Authorization": "Bearer k2"}).status_code == 200
    assert _get(keyed, "/v1/models", {"Authorization": "k2"}).status_code == 401  # no Bearer
    assert _get(Access(), "/v1/models").status_code == 200  # no keys: open
    r = _get(keyed, "/v1/models", {"Authorization": "Bearer k3"})
    assert json.loads(r.content)["error"]["code"] == "invalid_api_key"


def test_request_ids_are_bounded() -> None:
    r = _get(Access(), "/x", {"X-Request-Id": "a" * 500})
    assert len(r.headers["x-request-id"]) == 32  # too long: replaced
    assert _get(Access(), "/x", {"X-Request-Id": "ok-1"}).headers["x-request-id"] == "ok-1"


def test_keys_from_flags_file_and_env(tmp_path, monkeypatch) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\nfile-key\n\n")
    p = build_parser()
    monkeypatch.setenv("PSR_API_KEY", "env-key")
    assert api_keys(p.parse_args(["serve"])) == ("env-key",)
    assert api_keys(p.parse_args(["serve", "--api-key", "a", "--api-key-file", str(f)])) == (
        "a",
        "file-key",
    )
    monkeypatch.delenv("PSR_API_KEY")
    assert api_keys(p.parse_args(["serve"])) == ()
    f.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no keys"):
        api_keys(p.parse_args(["serve", "--api-key-file", str(f)]))
    opts = serve_options(p.parse_args(["serve", "--allowed-origins", "http://a.b/, *"]))
    assert opts.allowed_origins == ("http://a.b", "*")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_strict_refuses_unknown_fields_else_lists_them() -> None:
    body = {"prompt": "x", "mystery": 1}
    assert parse_completion(body).ignored == ("mystery",)
    with pytest.raises(APIError, match="unrecognized request argument supplied: mystery"):
        parse_completion(body, strict=True)
    chat = {"messages": [{"role": "user", "content": "hi"}], "zz": 0}
    assert parse_chat(chat).ignored == ("zz",)
    with pytest.raises(APIError):
        parse_chat(chat, strict=True)


def test_sampling_fields_parsed() -> None:
    s = parse_completion(
        {
            "prompt": "x",
            "min_p": 0.2,
            "repetition_penalty": 1.3,
            "presence_penalty": -1,
            "frequency_penalty": 0.5,
            "ignore_eos": True,
            "logprobs": 0,
            "guided_regex": "a+",
        }
    ).sampling
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (
        0.2,
        1.3,
        -1.0,
        0.5,
    )
    assert s.ignore_eos and s.logprobs == 0 and s.structured is not None
    assert s.structured.kind == "regex"
    with pytest.raises(APIError, match="one of"):
        parse_completion({"prompt": "x", "guided_regex": "a", "guided_json": {}})


def test_an_unexpected_failure_is_a_counted_500(monkeypatch) -> None:
    """A bug in a handler (not bad input): a 500 in OpenAI's shape, counted as an error."""
    from types import SimpleNamespace

    from servers import InProcessServer
    from transformers import AutoTokenizer

    import psr.serve.app as app_module
    from psr.models import DEFAULT_MODEL

    fake = SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(DEFAULT_MODEL),
        config=SimpleNamespace(vocab_size=2048, max_position_embeddings=512, eos_token_id=0),
        path="fake",
        policy=SimpleNamespace(describe=lambda: "fake"),
        drafter=None,
    )

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "_tokenize", broken)
    server = InProcessServer(lambda: fake, name="fake")
    try:
        assert server.engine.ready.wait(60)
        before = server.metrics()['psr_requests_total{outcome="error"}']
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 500 and "a bug" in r.json()["error"]["message"]
        assert server.metrics()['psr_requests_total{outcome="error"}'] == before + 1
    finally:
        server.close()
