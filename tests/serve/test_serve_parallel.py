"""`psr serve --parallel N`: requests decode together, each answer its solo run's; the
prompt cache is on (its default) and a conversation's next turn resumes from it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from servers import InProcessServer, RemoteServer

from psr.cli import build_parser
from psr.cli.generate import load_options
from psr.models import DEFAULT_MODEL, load

SERVE_ARGS = ["--dtype", "float32", "--quiet"]
NAME = "default_model"
PROMPTS = ["The quick brown fox", "To be, or not to be,", "Now is the winter", "Friends, Romans,"]


@pytest.fixture(scope="module")
def server(home):
    s = RemoteServer([*SERVE_ARGS, "--parallel", "4"])
    yield s
    s.close()


@pytest.fixture(scope="module")
def model(home):
    args = build_parser().parse_args(["serve", *SERVE_ARGS])
    m = load(DEFAULT_MODEL, **load_options(args), progress=False)
    m.set_row_invariant(True)  # the server's forward with its prompt cache (on by default)
    return m


def solo(model, prompt: str, n: int, **kw) -> list[int]:
    ids = model.tokenizer(prompt)["input_ids"]
    out = model.generate(ids, max_new_tokens=n, eos_token_id=model.tokenizer.eos_token_id, **kw)
    return out[0, len(ids) :].tolist()


def as_generate(body: dict) -> dict:
    """model.generate's arguments for an API request's sampling fields."""
    if body["temperature"] == 0:
        return {}
    return {"do_sample": True, **body}


def at_once(n: int, fn: Callable[[int], None]) -> None:
    """`fn(0)` .. `fn(n - 1)` in n threads started together; their errors re-raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait()
            fn(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_four_openai_streams_decode_together_each_as_alone(server, model) -> None:
    # Greedy and seeded sampling, different lengths: four streams at once through the
    # openai client, each one's tokens those of its solo run (model.generate).
    cases = [
        (PROMPTS[0], 24, {"temperature": 0}),
        (PROMPTS[1], 17, {"temperature": 0.8, "seed": 7}),
        (PROMPTS[2], 30, {"temperature": 0}),
        (PROMPTS[3], 9, {"temperature": 1.0, "top_p": 0.9, "seed": 3}),
    ]
    want = [solo(model, p, n, **as_generate(body)) for p, n, body in cases]
    before = server.metrics()
    got: dict[int, list[int]] = {}

    def client(i: int) -> None:
        prompt, n, body = cases[i]
        stream = server.client(timeout=300).completions.create(
            model=NAME, prompt=prompt, max_tokens=n, stream=True,
            extra_body={"return_token_ids": True}, **body,
        )  # fmt: skip
        got[i] = [t for c in stream for ch in c.choices
                  for t in ((ch.model_extra or {}).get("token_ids") or [])]  # fmt: skip

    at_once(len(cases), client)
    assert [got[i] for i in range(len(cases))] == want
    after = server.metrics()
    assert after["psr_slots"] == 4
    steps = after["psr_batch_size_count"] - before.get("psr_batch_size_count", 0)
    rows = after["psr_batch_size_sum"] - before.get("psr_batch_size_sum", 0)
    assert rows == sum(len(w) - 1 for w in want)  # every token but each request's first
    assert rows / steps > 1.5  # they did share steps
    assert after["psr_running_requests"] == 0


def test_a_second_request_does_not_wait_for_the_first(server) -> None:
    # A long stream is decoding; a short request arriving after it finishes first.
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0}
    with server.http() as h, h.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        t0 = time.perf_counter()
        short = server.client().completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0
        )
        assert short.usage.completion_tokens == 3
        assert time.perf_counter() - t0 < 120
        # the long one is still going: its stream has more to give
        assert next(lines) is not None


def test_a_client_that_leaves_frees_its_slot(server) -> None:
    before = server.metrics()
    key = 'psr_requests_total{outcome="cancelled"}'
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0}
    with server.http() as h, h.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    server.wait_until(lambda m: m[key] > before.get(key, 0) and m["psr_running_requests"] == 0)
    made = server.metrics()["psr_generated_tokens_total"] - before["psr_generated_tokens_total"]
    assert 1 <= made < 40  # not the 400 asked for


def test_conversations_second_turns_resume_from_the_prompt_cache(server, model) -> None:
    # Four two-turn conversations at once through the openai client: each second turn
    # (the first turn's prompt and answer, then more) resumes from the cached end of its
    # first turn's prompt, and every answer is its solo run's (model.generate, no cache).
    tok = model.tokenizer
    more = tok(" and so it goes on", add_special_tokens=False)["input_ids"]
    firsts = [tok(p)["input_ids"] for p in PROMPTS]
    before = server.metrics()
    got: dict[int, list[tuple[list[int], list[int], int]]] = {}

    def turn(ids: list[int], n: int) -> tuple[list[int], list[int], int]:
        stream = server.client(timeout=300).completions.create(
            model=NAME, prompt=ids, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
        )  # fmt: skip
        out, cached = [], -1
        for c in stream:
            if c.usage is not None:
                cached = c.usage.prompt_tokens_details.cached_tokens
            for ch in c.choices:
                out += (ch.model_extra or {}).get("token_ids") or []
        return ids, out, cached

    def conversation(i: int) -> None:
        one = turn(firsts[i], 6 + i)
        got[i] = [one, turn([*one[0], *one[1], *more], 5)]

    at_once(len(PROMPTS), conversation)
    eos = tok.eos_token_id
    for i, first in enumerate(firsts):
        for ids, out, _ in got[i]:
            want = model.generate(ids, max_new_tokens=len(out), eos_token_id=eos)
            assert out == want[0, len(ids) :].tolist(), f"conversation {i}"
        # turn 2 from turn 1's end (at least); turn 1 from any earlier prompt of this
        # server where they part (the same prompt in an earlier test: its last token)
        assert got[i][0][2] < len(first) <= got[i][1][2] < len(got[i][1][0])
    after = server.metrics()
    cached = sum(c for turns in got.values() for _, _, c in turns)
    prompts = sum(len(ids) for turns in got.values() for ids, _, _ in turns)
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["psr_prompt_tokens_cached_total"] == cached
    assert d["psr_prompt_tokens_computed_total"] == prompts - cached


def test_n_choices_are_the_seeds_solo_runs(server, model) -> None:
    # n = 3 sampled with seed 5: choice i is the solo run seeded 5 + i, decoded together.
    r = server.client().completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0.9, seed=5, n=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    want = [
        solo(model, PROMPTS[1], 12, do_sample=True, temperature=0.9, seed=5 + i) for i in range(3)
    ]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [(c.model_extra or {})["token_ids"] for c in r.choices] == want
    assert len({tuple(w) for w in want}) > 1  # the seeds differ
    assert r.usage.completion_tokens == sum(len(w) for w in want)
    # The copies decode in one batch (joined together; the first steps run while the
    # others' prefills finish, one chunk per step), each with its solo run's routing.
    figures = (r.model_extra or {})["psr"]["choices"]
    assert all(f["mean_batch"] > 2 for f in figures), figures
    assert all(f["routed"] > 0 for f in figures)


def test_n_streamed_chat_choices(server, model) -> None:
    tok = model.tokenizer
    stream = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
        temperature=0.7, seed=11, n=2, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    got: dict[int, list[int]] = {0: [], 1: []}
    finished, usage, ids = set(), None, None
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        ids = ids or (c.model_extra or {}).get("prompt_token_ids")  # the fallback template's
        for ch in c.choices:
            got[ch.index] += (ch.model_extra or {}).get("token_ids") or []
            if ch.finish_reason is not None:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert ids
    for i in range(2):
        out = model.generate(ids, max_new_tokens=6, eos_token_id=tok.eos_token_id,
                             do_sample=True, temperature=0.7, seed=11 + i)  # fmt: skip
        assert got[i] == out[0, len(ids) :].tolist()
    assert usage is not None and usage.completion_tokens == len(got[0]) + len(got[1])


def test_best_of_returns_the_best_mean_logprob(server, model) -> None:
    from psr.serve.decoding import LogprobSink

    ids = model.tokenizer(PROMPTS[3])["input_ids"]
    scored = []
    for i in range(3):
        sink = LogprobSink(0)
        eos = model.tokenizer.eos_token_id
        out = model.generate(ids, max_new_tokens=8, eos_token_id=eos, do_sample=True,
                             temperature=1.0, seed=21 + i, logprobs=sink)  # fmt: skip
        tokens = out[0, len(ids) :].tolist()
        scored.append((sum(row[1] for row in sink.rows) / len(tokens), tokens))
    best = max(scored)[1]
    r = server.client().completions.create(
        model=NAME, prompt=PROMPTS[3], max_tokens=8, temperature=1.0, seed=21, best_of=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert len(r.choices) == 1
    assert (r.choices[0].model_extra or {})["token_ids"] == best


def test_auto_opens_the_kv_caches_that_fit(model, monkeypatch) -> None:
    """--parallel auto on the CPU backend: as many KV caches of the model's context as fit
    KV_SHARE of MemAvailable less the prompt cache (and host_memory's remainder), 1 to
    AUTO_MAX; the log line says why."""
    import psr.models.tiers as tiers
    from psr.serve.parallel import AUTO_MAX, KV_SHARE, auto_parallel

    per_seq = model.memory(model.context)["device_kv"]

    def avail(n_caches: float, cache: int = 0) -> int:
        return int((n_caches * per_seq + cache) / KV_SHARE) + 1

    for fits, want in ((0.5, 1), (2.4, 2), (3, 3), (40, AUTO_MAX)):
        a = avail(fits)
        monkeypatch.setattr(tiers, "meminfo", lambda a=a: {"MemAvailable": a})
        n, why = auto_parallel(model, 0)
        assert n == want, (fits, why)
        assert f"{n} slot" in why and f"{model.context} tokens" in why
    # The prompt cache's budget comes off the room first.
    monkeypatch.setattr(tiers, "meminfo", lambda: {"MemAvailable": avail(3, 2 * per_seq)})
    assert auto_parallel(model, 2 * per_seq)[0] == 3
    assert auto_parallel(model, 3 * per_seq)[0] == 2
    # host_memory's remainder beside what the model holds bounds it too.
    mem = model.memory()
    held = mem["host_experts"] + mem["device_dense"] + mem["device_slab"]
    monkeypatch.setattr(tiers, "meminfo", lambda: {"MemAvailable": avail(40)})
    monkeypatch.setattr(model, "host_budget", held + 2 * per_seq)
    assert auto_parallel(model, 0)[0] == 2


def test_auto_is_logged_and_shown_in_metrics(home) -> None:
    # No --parallel: auto. The embedded model's KV caches are small: AUTO_MAX slots here.
    from psr.serve.parallel import AUTO_MAX

    s = RemoteServer(SERVE_ARGS)
    try:
        m = s.metrics()
        assert m["psr_slots"] == AUTO_MAX
        assert f"--parallel auto: {AUTO_MAX} slots: KV caches of" in s.log()
        c = s.client()
        c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0)
        assert s.metrics()["psr_batch_size_count"] >= 3 - 1  # one per batched step
    finally:
        s.close()


def test_explicit_slots_beyond_memory_get_a_kv_budget(model, monkeypatch) -> None:
    """--parallel N whose N KV caches of the context do not fit the memory available: the
    batch's KV budget (kv_tokens) is what does fit, so a prompt beyond it waits or is
    refused (runtime/batch.py) instead of taking memory there is not."""
    import psr.models.tiers as tiers
    from psr.serve.parallel import open_slots
    from psr.serve.worker import Engine

    per_seq = model.memory(model.context)["device_kv"]
    per_token = model.memory(1)["device_kv"]
    for avail, want in ((8 * per_seq, None), (int(2.5 * per_seq), int(2.5 * per_seq) // per_token),
                        (per_seq // 2, per_seq // 2 // per_token)):  # fmt: skip
        monkeypatch.setattr(tiers, "meminfo", lambda a=avail: {"MemAvailable": a})
        engine = Engine(lambda: model, parallel=4)
        slots = open_slots(engine, model)
        assert slots is not None and slots.dec.max_batch == 4
        assert slots.dec.kv_tokens == want
    with pytest.raises(ValueError, match="exceeds the batch's KV budget"):
        slots.dec.add(list(range(1, want + 2)))


@contextmanager
def kv_budget_server(model, tokens: int, monkeypatch) -> Iterator[InProcessServer]:
    """`--parallel 4` over `model` whose four KV caches do not fit: the memory available
    holds `tokens` KV tokens (kv_limit), so the batch's KV budget is `tokens`."""
    import psr.models.tiers as tiers

    per_token = model.memory(1)["device_kv"]
    monkeypatch.setattr(tiers, "meminfo", lambda: {"MemAvailable": tokens * per_token + 1})
    s = InProcessServer(lambda: model, parallel=4)
    try:
        assert s.engine.ready.wait(60)
        yield s
    finally:
        s.close()


def test_requests_beyond_the_kv_budget_wait_their_turn(model, monkeypatch) -> None:
    # A budget of 64 KV tokens; four requests of prompt + 24 tokens (29 to 33 each, 124
    # together) at once: two fit together, the others wait for them (no step ever holds
    # more than two), and all four answer their solo runs' tokens (no 500). One whose own
    # prompt + max_tokens exceeds the budget is refused at once: a one-line 400.
    want = [solo(model, p, 24) for p in PROMPTS]
    got: dict[int, list[int]] = {}
    with kv_budget_server(model, 64, monkeypatch) as s:

        def client(i: int) -> None:
            r = s.client(timeout=300).completions.create(
                model="test", prompt=PROMPTS[i], max_tokens=24, temperature=0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            got[i] = (r.choices[0].model_extra or {})["token_ids"]

        at_once(len(PROMPTS), client)
        assert [got[i] for i in range(len(PROMPTS))] == want
        m = s.metrics()
        ends = [m.get(f'psr_requests_total{{outcome="{k}"}}', 0) for k in ("stop", "length")]
        assert sum(ends) == len(PROMPTS)  # none failed
        assert m['psr_batch_size_bucket{le="2.0"}'] == m["psr_batch_size_count"]  # <= 2 rows
        assert m["psr_batch_size_sum"] == sum(len(w) - 1 for w in want)
        for stream in (False, True):
            big = {"model": "test", "prompt": PROMPTS[0], "max_tokens": 60, "stream": stream}
            with s.http() as h:
                r = h.post("/v1/completions", json=big)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == (
                "a prompt of 6 tokens + max_tokens 60 exceeds the batch's KV budget of 64 "
                "tokens (kv_tokens): lower max_tokens"
            )
        m = s.metrics()
        assert m['psr_requests_total{outcome="invalid"}'] == 2
        assert m["psr_running_requests"] == 0 and m["psr_queue_depth"] == 0


def test_a_cancelled_request_frees_its_kv_for_a_waiting_one(model, monkeypatch) -> None:
    # A stream reserves the whole budget (6 + 294 of 300 KV tokens); a second request (8 +
    # 10) waits in the queue behind it; the stream's client leaves: its reservation is
    # freed and the waiting request runs, its solo run's tokens.
    want = solo(model, PROMPTS[1], 10)
    got: list[list[int]] = []
    with kv_budget_server(model, 300, monkeypatch) as s:
        body = {"model": "test", "prompt": PROMPTS[0], "max_tokens": 294, "temperature": 0}
        with s.http() as h, h.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            lines = r.iter_lines()  # held: a dropped iterator closes the stream
            assert next(lines).startswith("data: ")

            def waiting() -> None:
                out = s.client(timeout=300).completions.create(
                    model="test", prompt=PROMPTS[1], max_tokens=10, temperature=0,
                    extra_body={"return_token_ids": True},
                )  # fmt: skip
                got.append((out.choices[0].model_extra or {})["token_ids"])

            t = threading.Thread(target=waiting)
            t.start()
            s.wait_until(lambda m: m["psr_queue_depth"] == 1 and m["psr_running_requests"] == 1)
            assert not got  # it waits while the stream runs
        t.join(300)
        assert got == [want]
        m = s.metrics()
        assert m['psr_requests_total{outcome="cancelled"}'] == 1
        assert m['psr_requests_total{outcome="length"}'] == 1
        assert m["psr_generated_tokens_total"] < 294  # the stream did not run to its end
