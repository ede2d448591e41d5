"""Faults, with the server in this process (uvicorn in a thread) so that a test can reach
the model behind it: loading (503), copy failures injected mid-request (that request's
500 or stream error, never a dead server), random copy delays (bit-identical streams)."""

from __future__ import annotations

import os
import threading

import httpx
import openai
import pytest
from servers import InProcessServer

import psr
from psr.models import DEFAULT_MODEL

PROMPTS = ["The quick brown fox", "To be, or not to be,"]
NEW = 16


def _load(**kw):
    return psr.load(DEFAULT_MODEL, dtype="float32", progress=False, **kw)


@pytest.fixture(scope="module")
def model():
    # No retries: the first failed copy is the request's CopyError.
    return _load(copy_retries=0)


@pytest.fixture(scope="module")
def reference(model) -> dict[str, list[int]]:
    """Fresh greedy outputs, before any fault."""
    tok = model.tokenizer
    out = {}
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        gen = model.generate(ids, max_new_tokens=NEW, eos_token_id=tok.eos_token_id)
        out[p] = gen[0, len(ids) :].tolist()
    return out


@pytest.fixture
def served(model, reference):
    s = InProcessServer(lambda: model)
    yield s
    s.close()
    model.runtime.store.fail_next_copies(0)


def greedy_stream(server, prompt: str, max_tokens: int = NEW) -> list[int]:
    chunks = server.client().completions.create(
        model="test",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    return [t for c in chunks for ch in c.choices for t in (ch.model_extra or {})["token_ids"]]


def test_health_is_503_while_the_model_loads(model) -> None:
    release = threading.Event()

    def loader():
        assert release.wait(60)
        return model

    s = InProcessServer(loader)
    try:
        with s.http() as h:
            r = h.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "loading"}
            r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 503
            assert "loading" in r.json()["error"]["message"]
            assert h.get("/v1/models").json()["data"][0]["id"] == "test"
            release.set()
            s.engine.ready.wait(60)
            assert h.get("/health").status_code == 200
    finally:
        release.set()
        s.close()


def test_a_copy_failure_in_prefill_is_that_requests_500(served, model, reference) -> None:
    model.runtime.store.fail_next_copies(1)
    with served.http() as h:
        r = h.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "CopyError" in err["message"]
    # The server keeps serving, as a fresh one would.
    assert greedy_stream(served, PROMPTS[0]) == reference[PROMPTS[0]]
    assert served.metrics()['psr_requests_total{outcome="error"}'] == 1


def test_a_copy_failure_mid_stream_ends_only_that_stream(served, model, reference) -> None:
    """The host-driven decode step copies through the store, whose copies can fail (the
    device step's gathers cannot fail recoverably: no injection there)."""
    c = served.client()
    model.runtime.set_decode("host")
    try:
        stream = c.completions.create(
            model="test", prompt=PROMPTS[1], max_tokens=200, temperature=0, stream=True
        )
        got = []
        with pytest.raises(openai.APIError, match="CopyError"):
            for chunk in stream:
                got.append(chunk.choices[0].text)
                if len(got) == 1:  # decoding under way: every copy from now on fails
                    model.runtime.store.fail_next_copies(10**6)
        assert 1 <= len(got) < 200
    finally:
        model.runtime.store.fail_next_copies(0)
        model.runtime.set_decode("device")
    for p in PROMPTS:
        assert greedy_stream(served, p) == reference[p]
    r = httpx.get(f"{served.url}/health")
    assert r.status_code == 200


def test_random_copy_delays_give_bit_identical_streams(reference, monkeypatch) -> None:
    monkeypatch.setenv("PSR_COPY_DELAY_US", "3000")  # longer than a layer: joins wait
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", "11")
    delayed = _load()
    assert os.environ["PSR_COPY_DELAY_US"] == "3000"
    s = InProcessServer(lambda: delayed)
    try:
        for p in PROMPTS:
            assert greedy_stream(s, p) == reference[p]
        assert delayed.stats["stall_s"] > 0  # the delays were there to be waited for
    finally:
        s.close()
        delayed.close()
