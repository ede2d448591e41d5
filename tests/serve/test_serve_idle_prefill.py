"""`psr serve` prefills finished answers into the prompt cache while idle (psr.serve.idle):
a conversation's next turn resumes after the last answer, with one slot or a batch, and
answers what the model answers without a cache, whether it arrives after the idle prefill
or during it; `--no-cache-answers` leaves the answer to the next turn."""

from __future__ import annotations

import time

import pytest
from servers import InProcessServer

import psr
from psr.runtime.chunked import PromptCache

FIRST = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
MORE = " and so it goes on, and on, to the end of the play"
NEW = 24  # answer tokens: two and more chunks of 16


@pytest.fixture(scope="module")
def model():
    m = psr.load(psr.DEFAULT_MODEL, "psr", 0.5, dtype="float32", progress=False)
    m.set_prefill_chunk(16)
    return m


def _complete(s: InProcessServer, ids: list[int]) -> dict:
    body = {"model": "test", "prompt": ids, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = s.http().post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()


def _idle_tokens(s: InProcessServer, want: int, wait: float) -> float:
    deadline = time.monotonic() + wait
    while True:
        got = s.metrics().get("psr_idle_prefill_tokens_total", 0.0)
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.mark.parametrize("answers", [True, False], ids=["cache-answers", "no-cache-answers"])
@pytest.mark.parametrize("parallel", [1, 2])
@pytest.mark.parametrize("wait", [True, False], ids=["after", "during"])
def test_the_next_turn_resumes_after_the_answer(model, parallel, answers, wait) -> None:
    tok = model.tokenizer
    first = tok(FIRST)["input_ids"]
    s = InProcessServer(lambda: model, parallel=parallel, prompt_cache=PromptCache(1 << 26),
                        cache_answers=answers)  # fmt: skip
    try:
        one = _complete(s, first)
        answer = one["choices"][0]["token_ids"]
        assert len(answer) == NEW
        second = [*first, *answer, *tok(MORE, add_special_tokens=False)["input_ids"]]
        idle = _idle_tokens(s, NEW if answers else 1, 60 if wait and answers else 1)
        if wait:  # the idle prefill ran: the answer's tokens (its prompt's end was cached)
            assert idle == (NEW if answers else 0)
        two = _complete(s, second)
    finally:
        s.close()
    assert model.row_invariant  # the server's forward (its prompt cache's)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (one, two)]
    if wait:
        assert cached == [0, len(first) + (NEW if answers else 0)]
    else:  # it arrived during the idle prefill: after what it computed, the prompt's end at least
        assert cached[0] == 0 and len(first) <= cached[1] <= len(first) + NEW
    for r, ids in ((one, first), (two, second)):  # the answers without a cache
        want = model.generate(ids, max_new_tokens=NEW)[0, len(ids) :].tolist()
        assert r["choices"][0]["token_ids"] == want


def test_an_idle_prefill_goes_one_chunk_at_a_time_and_leaves_for_a_request(model) -> None:
    """The slots' way (a prefill-only sequence of the batch) and the one-slot way (generate
    up to the next boundary): one chunk per step; the batch's sequence leaves when a
    request arrives, and the chunk done stays cached (a request resumes after it)."""
    from psr.runtime.batch import BatchDecoder
    from psr.serve.idle import IdlePrefill

    model.set_row_invariant(True)
    tok = model.tokenizer
    first = tok(FIRST)["input_ids"]
    answer = model.generate(first, max_new_tokens=3 * 16)[0, len(first) :].tolist()
    ids = [*first, *answer]
    for way in ("batch", "solo"):
        cache, counted = PromptCache(1 << 26), []
        model.generate(first, max_new_tokens=1, prompt_cache=cache)  # the request's prefill
        idle = IdlePrefill(counted=counted.append)
        idle.note(model, first, answer, cache)
        dec = BatchDecoder(model, 2, prompt_cache=cache)
        if way == "batch":
            idle.batch_step(dec)
            assert [dec.prefilling(s) for s in dec.live] == [True]  # one chunk, more to go
            idle.batch_stop(dec)  # a request arrives
            assert dec.live == [] and not idle
        else:
            idle.solo_step(model, cache)
            assert idle  # more chunks to go
        step = (len(first) // 16 + 1) * 16  # the first chunk's end: the next boundary
        assert counted == [step - len(first)]
        seq = dec.add([*ids[:step], *ids[step : step + 5]])  # resumes after that chunk
        while dec.prefilling(seq):
            dec.ready()
        assert dec.cached_tokens(seq) == step


def test_an_idle_prefill_beyond_the_batchs_kv_budget_leaves_at_once(model) -> None:
    """A finished request longer than the batch's kv_tokens can never prefill in it: it is
    dropped at its first step, computing nothing (not a failure that drops the others)."""
    from psr.runtime.batch import BatchDecoder
    from psr.serve.idle import IdlePrefill

    model.set_row_invariant(True)
    first = model.tokenizer(FIRST)["input_ids"]
    cache, counted = PromptCache(1 << 26), []
    idle = IdlePrefill(counted=counted.append)
    idle.note(model, first[:4], [5, 6, 7], cache)
    idle.note(model, first, [5, 6, 7], cache)
    dec = BatchDecoder(model, 2, prompt_cache=cache, kv_tokens=len(first) // 2)
    idle.batch_step(dec)  # the newest first: beyond the budget
    assert counted == [] and dec.live == [] and len(idle.pending) == 1
    idle.batch_step(dec)  # the older, short one: prefilled in one chunk
    assert counted == [7] and dec.live == [] and not idle


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_request_arriving_during_an_idle_prefill_goes_first(model, parallel) -> None:
    """The idle prefill held after its first chunk until the second turn is queued: the
    request is served next (the batch's idle sequence leaves first), resumes after that
    chunk, and answers as without a cache."""
    import threading

    tok = model.tokenizer
    first = tok(FIRST)["input_ids"]
    s = InProcessServer(lambda: model, parallel=parallel, prompt_cache=PromptCache(1 << 26))
    idle, started, release = s.engine.idle, threading.Event(), threading.Event()
    name = "batch_step" if parallel > 1 else "solo_step"
    step = getattr(idle, name)

    def held(*args):
        step(*args)
        if not started.is_set():
            started.set()
            assert release.wait(60)

    setattr(idle, name, held)
    got: list[dict] = []
    try:
        one = _complete(s, first)
        answer = one["choices"][0]["token_ids"]
        second = [*first, *answer, *tok(MORE, add_special_tokens=False)["input_ids"]]
        assert started.wait(60)  # one chunk done, the worker held
        sender = threading.Thread(target=lambda: got.append(_complete(s, second)))
        sender.start()
        deadline = time.monotonic() + 60
        while not s.engine.queued and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        sender.join(120)
    finally:
        release.set()
        s.close()
    chunk = (len(first) // 16 + 1) * 16  # the idle prefill's first chunk ended there
    assert got[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == chunk
    want = model.generate(second, max_new_tokens=NEW)[0, len(second) :].tolist()
    assert got[0]["choices"][0]["token_ids"] == want
