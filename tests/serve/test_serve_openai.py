"""`psr serve` as clients see it: one real server process (the embedded model in float32)
driven by the `openai` package, and by raw HTTP (httpx) for the SSE framing, bad input,
load and disconnects. References come from `model.generate` on the same model, loaded
here with the same options."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import httpx
import openai
import pytest
from servers import RemoteServer

from psr.cli import build_parser
from psr.cli.generate import load_options
from psr.models import DEFAULT_MODEL, load
from psr.serve.chat import FALLBACK_TEMPLATE

SERVE_ARGS = ["--dtype", "float32", "--quiet"]
NAME = "default_model"  # the embedded model's folder
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "To be, or not to be,", "Now is the winter", "Friends, Romans,"]


@pytest.fixture(scope="module")
def server(home):
    # One slot: its per-request figures include the copies (test_serve_parallel.py covers
    # the batched slots, auto's default on the CPU).
    s = RemoteServer([*SERVE_ARGS, "--parallel", "1"])
    yield s
    s.close()


@pytest.fixture(scope="module")
def model(home):
    args = build_parser().parse_args(["serve", *SERVE_ARGS])
    return load(DEFAULT_MODEL, **load_options(args), progress=False)


@pytest.fixture(scope="module")
def tok(model):
    return model.tokenizer


def generate(model, ids: list[int], n: int, **kw) -> list[int]:
    """model.generate's new tokens, as the server decodes them (the tokenizer's EOS)."""
    out = model.generate(ids, max_new_tokens=n, eos_token_id=model.tokenizer.eos_token_id, **kw)
    return out[0, len(ids) :].tolist()


def figures(model, ids: list[int], n: int) -> dict[str, int]:
    """The routing counts of one greedy generate, from the model's cumulative stats."""
    before = dict(model.stats.totals)
    generate(model, ids, n)
    after = model.stats.totals
    return {k: int(after[k] - before[k]) for k in ("routed", "hits", "misses", "prefetches")}


def extra(obj, key):
    return (obj.model_extra or {}).get(key)


def streamed_tokens(chunks) -> list[int]:
    return [t for c in chunks for ch in c.choices for t in (extra(ch, "token_ids") or [])]


# ------------------------------------------------------------------ openai client


def test_models_and_health(server) -> None:
    c = server.client()
    assert [m.id for m in c.models.list().data] == [NAME]
    assert c.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_greedy_equals_generate(server, model, tok) -> None:
    c = server.client()
    for prompt in PROMPTS[:2]:
        ids = tok(prompt)["input_ids"]
        want = generate(model, ids, 12)
        r = c.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        ch = r.choices[0]
        assert extra(ch, "token_ids") == want
        assert extra(ch, "prompt_token_ids") == ids
        assert ch.text == tok.decode(want, skip_special_tokens=True)
        assert ch.finish_reason == "length" and len(want) == 12
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
        assert r.usage.total_tokens == len(ids) + 12
        psr = extra(r, "psr")
        assert psr["policy"] == model.policy.describe()
        want_figures = figures(model, ids, 12)
        assert {k: psr[k] for k in want_figures} == want_figures
        assert psr["decode_steps"] == 11  # the first token comes from the prefill

        chunks = list(
            c.completions.create(
                model=NAME,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
        )
        assert streamed_tokens(chunks) == want
        assert "".join(ch.text for c_ in chunks for ch in c_.choices) == r.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert all(c_.choices[0].finish_reason is None for c_ in chunks[:-1])


def test_completion_from_token_ids_and_echo(server, model, tok) -> None:
    c = server.client()
    ids = tok(PROMPTS[2])["input_ids"]
    want = generate(model, ids, 6)
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == tok.decode(ids + want, skip_special_tokens=True)
    chunks = list(
        c.completions.create(
            model=NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(ch.text for c_ in chunks for ch in c_.choices) == r.choices[0].text
    assert chunks[0].choices[0].text == PROMPTS[2]


def test_chat_uses_the_fallback_template(server, model, tok) -> None:
    assert not tok.chat_template  # the embedded model has none
    messages = [
        {"role": "system", "content": "You speak in verse."},
        {"role": "user", "content": "Who goes there?"},
    ]
    text = tok.apply_chat_template(
        messages, chat_template=FALLBACK_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert text == "system: You speak in verse.\nuser: Who goes there?\nassistant:"
    ids = tok(text)["input_ids"]
    want = generate(model, ids, 10)
    c = server.client()
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == tok.decode(want, skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    assert extra(r, "psr")["chat_template"] == "fallback"
    assert r.object == "chat.completion" and r.model == NAME

    chunks = list(
        c.chat.completions.create(
            model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c_.choices[0].delta.content or "" for c_ in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c_.object == "chat.completion.chunk" for c_ in chunks)


def test_seed_gives_the_same_sample_twice(server, model, tok) -> None:
    c = server.client()
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, top_p=0.9)
    body = {"return_token_ids": True, "top_k": 50}
    a = c.completions.create(seed=7, extra_body=body, **kw)
    b = c.completions.create(seed=7, extra_body=body, **kw)
    assert a.choices[0].text == b.choices[0].text
    # The draws model.generate makes with the same settings and seed.
    ids = tok(PROMPTS[1])["input_ids"]
    want = generate(model, ids, 12, do_sample=True, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    assert extra(a.choices[0], "token_ids") == want
    seeds = {
        c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)
    }  # a sampled text, not the greedy one
    assert len(seeds) > 1


def _spanning_stop(tok, tokens: list[int]) -> tuple[str, int, int]:
    """A two-character stop string made of the last character of token k's text and the
    first of token k+1's, first found at that boundary; returns (stop, k, offset)."""
    text = tok.decode(tokens, skip_special_tokens=True)
    pieces = [tok.decode(tokens[: i + 1], skip_special_tokens=True) for i in range(len(tokens))]
    for k in range(1, len(tokens) - 1):
        end = len(pieces[k])
        if len(pieces[k - 1]) < end < len(pieces[k + 1]) and text.startswith(pieces[k]):
            stop = text[end - 1 : end + 1]
            if text.find(stop) == end - 1:
                return stop, k, end - 1
    raise AssertionError("no two-token stop string in the reference text")


def test_stop_strings_never_leak(server, model, tok) -> None:
    c = server.client()
    ids = tok(PROMPTS[0])["input_ids"]
    want = generate(model, ids, 24)
    text = tok.decode(want, skip_special_tokens=True)
    stop, k, at = _spanning_stop(tok, want)
    for stream in (False, True):
        kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0)
        r = c.completions.create(stop=[stop, "zzzz"], stream=stream, **kw)
        if stream:
            chunks = list(r)
            got = "".join(ch.text for c_ in chunks for ch in c_.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = r.choices[0].text, r.choices[0].finish_reason
            assert r.usage.completion_tokens == k + 2  # decoding stopped at token k+1
        assert got == text[:at] and finish == "stop"
    # A stop string never made: the whole text, finish_reason length.
    r = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop="#")
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"


def test_usage_chunk_closes_the_stream(server, tok) -> None:
    c = server.client()
    chunks = list(
        c.completions.create(
            model=NAME,
            prompt=PROMPTS[3],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == len(tok(PROMPTS[3])["input_ids"])
    assert all(c_.usage is None for c_ in body)
    assert body[-1].choices[0].finish_reason == "length"


def test_metrics_move_with_a_request(server, tok) -> None:
    before = server.metrics()
    r = server.client().completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=7, temperature=0
    )
    after = server.metrics()

    def d(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    psr = extra(r, "psr")
    assert d('psr_requests_total{outcome="length"}') == 1
    assert d("psr_generated_tokens_total") == 7
    assert d("psr_prompt_tokens_total") == r.usage.prompt_tokens
    assert d("psr_routed_experts_total") == psr["routed"]
    assert d("psr_expert_hits_total") == psr["hits"]
    assert d("psr_expert_misses_total") == psr["misses"]
    assert d("psr_prefetches_total") == psr["prefetches"]
    assert d("psr_prefetches_used_total") == psr["prefetch_used"]
    # the default policy is psr (a biased router): it substitutes some routed experts
    assert d("psr_substituted_experts_total") == psr["substituted"] > 0
    assert d("psr_cpu_experts_total") == psr["cpu_experts"] == 0  # experts_on="gpu"
    assert d('psr_copied_bytes_total{phase="decode"}') == psr["bytes_copied"]
    assert d('psr_copied_bytes_total{phase="prefill"}') == psr["prefill_bytes"]
    assert d("psr_time_to_first_token_seconds_count") == 1
    assert d("psr_time_per_output_token_seconds_count") == 6
    assert after["psr_queue_depth"] == 0 and after["psr_running_requests"] == 0
    assert 'psr_stall_seconds_total{phase="decode"}' in after
    # Every expert is held (the tiny model is far inside the default budget): decode read
    # each copied byte from host memory, none from a file.
    assert d('psr_expert_read_bytes_total{tier="pinned"}') == psr["bytes_copied"] > 0
    assert d('psr_expert_read_bytes_total{tier="disk"}') == 0
    assert d('psr_expert_read_bytes_total{tier="page_cache"}') == 0


def test_one_log_line_per_request(server) -> None:
    r = server.client().completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0
    )
    (line,) = server.request_lines(r.id)
    assert "length: prompt" in line and "completion 3 tokens" in line
    assert "ttft" in line and "tokens/s" in line and "hits" in line and "misses" in line


def test_the_readmes_client_snippet_works_as_written(server, capsys) -> None:
    serving = (ROOT / "README.md").read_text().split("## Serving\n", 1)[1].split("\n## ", 1)[0]
    assert "psr serve" in serving
    code = re.findall(r"```python\n(.*?)```", serving, re.S)[0]  # the second: agents
    assert "http://127.0.0.1:8000/v1" in code  # psr serve's defaults
    exec(compile(code.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "completion_tokens=" in out and "'policy': 'psr(" in out


# ------------------------------------------------------------------ raw HTTP


def test_sse_framing(server) -> None:
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    with server.http() as h:
        r = h.post("/v1/completions", json=body | {"stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ") and "\n" not in e
        chunk = json.loads(e.removeprefix("data: "))
        assert chunk["object"] == "text_completion" and chunk["model"] == NAME


BAD = [
    ("/v1/completions", b'{"prompt": "x",', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[a-"}, 400, "response_format"),
    # A lone surrogate, as JSON allows it and no tokenizer encodes it (was a 500).
    ("/v1/completions", b'{"prompt":"To be \\ud800","max_tokens":2}', 400, "prompt"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs"),
    (
        "/v1/chat/completions",
        b'{"messages":[{"role":"user","content":"a \\udfff b"}]}',
        400,
        "messages",
    ),
    ("/v1/chat/completions", {"max_completion_tokens": 1000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_gets_an_openai_error(server, path, body, status, param) -> None:
    if isinstance(body, dict) and path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with server.http() as h:
        if isinstance(body, bytes):
            r = h.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = h.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error"


def test_bad_input_through_the_openai_client(server) -> None:
    c = server.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=NAME, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model=NAME, prompt="x", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "x"}])


def test_unknown_path_and_method(server) -> None:
    with server.http() as h:
        r = h.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = h.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()


# ------------------------------------------------------------------ load and faults


def test_concurrent_clients_get_their_sequential_outputs(server, model, tok) -> None:
    want = {p: generate(model, tok(p)["input_ids"], 4) for p in PROMPTS}
    got: dict[tuple[int, int], tuple[str, list[int]]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        c = server.client(timeout=300)
        try:
            for j in range(4):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                r = c.completions.create(
                    model=NAME,
                    prompt=prompt,
                    max_tokens=4,
                    temperature=0,
                    extra_body={"return_token_ids": True},
                )
                got[i, j] = (prompt, extra(r.choices[0], "token_ids"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 32
    for prompt, tokens in got.values():
        assert tokens == want[prompt]


def test_a_client_that_leaves_mid_stream_frees_the_model(server) -> None:
    before = server.metrics()
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0}
    with server.http() as h, h.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # Gone: the next request is served at once, and the long one stopped where it was.
    r = server.client().completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=2, temperature=0
    )
    assert r.usage.completion_tokens == 2
    key = 'psr_requests_total{outcome="cancelled"}'
    server.wait_until(lambda m: m[key] > before[key])
    after = server.metrics()
    assert after[key] == before[key] + 1
    made = after["psr_generated_tokens_total"] - before["psr_generated_tokens_total"] - 2
    assert 1 <= made < 40  # not the 400 asked for


def test_a_full_queue_answers_429(server) -> None:
    async def scenario() -> None:
        before = server.metrics()
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0}
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as h:
            # One decodes ...
            running = h.stream("POST", "/v1/completions", json=body | {"stream": True})
            r = await running.__aenter__()
            assert r.status_code == 200
            # ... sixteen wait (--max-queue's default): their responses start with a token.
            waiting = [asyncio.create_task(h.post("/v1/completions", json=body)) for _ in range(16)]
            await asyncio.to_thread(server.wait_until, lambda m: m["psr_queue_depth"] == 16)
            full = await h.post("/v1/completions", json=body)
            assert full.status_code == 429
            assert int(full.headers["retry-after"]) >= 1
            assert full.json()["error"]["code"] == "queue_full"
            for t in waiting:  # the clients leave: their requests leave the queue
                t.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            await running.__aexit__(None, None, None)
        await asyncio.to_thread(
            server.wait_until,
            lambda m: m["psr_queue_depth"] == 0 and m["psr_running_requests"] == 0,
        )
        after = server.metrics()
        key = 'psr_requests_total{outcome="cancelled"}'
        assert after[key] - before[key] == 17
        assert after['psr_requests_total{outcome="rejected"}'] > before.get(
            'psr_requests_total{outcome="rejected"}', 0
        )

    asyncio.run(scenario())
    # And the server is free again.
    r = server.client().completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=2, temperature=0
    )
    assert r.choices[0].finish_reason == "length"
