"""`psr serve` with a prompt cache (issue 36): a request extending an earlier one resumes
from its cached prefill (usage.prompt_tokens_details.cached_tokens, /metrics counts cached
and computed prompt tokens) and answers what the model answers without a cache."""

from __future__ import annotations

import pytest
from servers import InProcessServer

import psr
from psr.runtime.chunked import PromptCache

FIRST = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
SECOND = FIRST + " the slings and arrows of outrageous fortune, or to take arms against a sea"
NEW = 5


@pytest.fixture(scope="module")
def model():
    m = psr.load(psr.DEFAULT_MODEL, "psr", 0.5, dtype="float32", progress=False)
    m.set_prefill_chunk(16)
    return m


def test_a_turn_extending_the_last_resumes_from_its_cache(model) -> None:
    tok = model.tokenizer
    want = {}
    for p in (FIRST, SECOND):
        ids = tok(p)["input_ids"]
        want[p] = model.generate(ids, max_new_tokens=NEW, eos_token_id=tok.eos_token_id)[
            0, len(ids) :
        ].tolist()
    s = InProcessServer(lambda: model)
    s.engine.prompt_cache = PromptCache(1 << 26)
    try:
        got = []
        for p in (FIRST, SECOND):
            r = s.http().post(
                "/v1/completions",
                json={"model": "test", "prompt": p, "max_tokens": NEW, "temperature": 0,
                      "return_token_ids": True},
            ).json()  # fmt: skip
            got.append(r)
        m = s.metrics()
    finally:
        s.close()
    n1, n2 = (len(tok(p)["input_ids"]) for p in (FIRST, SECOND))
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in got]
    assert cached == [0, (n1 - 1) // 16 * 16] and cached[1] > 0
    assert [r["choices"][0]["token_ids"] for r in got] == [want[FIRST], want[SECOND]]
    assert m["psr_prompt_tokens_cached_total"] == cached[1]
    assert m["psr_prompt_tokens_computed_total"] == n1 + n2 - cached[1]
