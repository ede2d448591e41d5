"""The serve Engine's cancellation, exactly: a fake model whose `generate` drives the
streamer as psr's decode loop does (put the prompt; per token: choose it, put it, run the
next forward) and stops at a chosen token until the test lets it go, so a request is
cancelled at a known point. A cancelled decode stops at the next token's put (that token
is chosen but never streamed); a cancelled queued request never reaches `generate`."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from psr.runtime.stats import Stats
from psr.serve.job import Delta, Failed, Finished, Job, Params, _Cancelled
from psr.serve.worker import Engine

TIMEOUT = 10.0  # a bound on each wait, never a means of synchronising
EOS = 0
FIRST = 10  # the fake's tokens: FIRST, FIRST + 1, ... (never EOS)


class FakeTokenizer:
    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f" t{i}" for i in ids)


@dataclass
class Call:
    prompt: list[int]
    kwargs: dict[str, Any]
    made: int = 0  # tokens chosen and handed to the streamer
    forwards: int = 0  # the prefill and the decode steps
    raised: BaseException | None = None


class FakeModel:
    """What the Engine reads of an OffloadedModel. `pause_after[c] = k`: the c-th call to
    `generate` stops after the streamer took its k-th token (k = 0: after the prompt),
    sets `paused` and waits for `resume`."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.config = SimpleNamespace(eos_token_id=EOS, max_position_embeddings=128)
        self.policy = SimpleNamespace(describe=lambda: "fake")
        self.stats = Stats()
        self.path = "fake-model"
        self.drafter = None
        self.calls: list[Call] = []
        self.pause_after: dict[int, int] = {}
        self.paused = threading.Event()
        self.resume = threading.Event()

    def _checkpoint(self, index: int, streamed: int) -> None:
        if self.pause_after.get(index) == streamed:
            self.paused.set()
            if not self.resume.wait(TIMEOUT):
                raise TimeoutError("the test never resumed generate")

    def generate(
        self, prompt_ids: list[int], *, max_new_tokens: int, streamer: Any, **kwargs: Any
    ) -> torch.Tensor:
        index = len(self.calls)
        call = Call(list(prompt_ids), kwargs)
        self.calls.append(call)
        streamer.put(torch.tensor([prompt_ids]))
        try:
            self._checkpoint(index, 0)
            call.forwards += 1  # the prefill: the first token's logits
            for i in range(max_new_tokens):
                call.made += 1
                self.stats.totals["tokens"] += 1
                streamer.put(torch.tensor([FIRST + i]))
                self._checkpoint(index, i + 1)
                if i == max_new_tokens - 1:
                    break
                call.forwards += 1  # the next token's logits
            return torch.tensor([[*prompt_ids, *range(FIRST, FIRST + max_new_tokens)]])
        except BaseException as e:
            call.raised = e
            raise
        finally:
            streamer.end()


def requests(engine: Engine, outcome: str) -> float:
    labels = {"model_name": "", "outcome": outcome}
    v = engine.metrics.registry.get_sample_value("psr_requests_total", labels)
    assert v is not None
    return v


def sample(engine: Engine, name: str) -> float:
    v = engine.metrics.registry.get_sample_value(name, {"model_name": ""})
    assert v is not None
    return v


def generated(engine: Engine) -> float:
    return sample(engine, "psr_generated_tokens_total")


async def next_event(job: Job) -> Any:
    return await asyncio.wait_for(job.events.get(), TIMEOUT)


async def wait(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, TIMEOUT), "timed out"


async def started(model: FakeModel) -> Engine:
    engine = Engine(lambda: model)
    engine.start(asyncio.get_running_loop())
    await wait(engine.ready)
    return engine


def stop(engine: Engine, model: FakeModel) -> None:
    model.resume.set()  # a failed assertion must not leave the worker waiting
    engine.stop(TIMEOUT)
    assert engine._thread is not None and not engine._thread.is_alive()


async def rest(job: Job) -> tuple[list[Delta], Any]:
    """A submitted job's remaining events: the deltas, then the final event."""
    deltas = []
    while isinstance(ev := await next_event(job), Delta):
        deltas.append(ev)
    return deltas, ev


async def run_to_end(engine: Engine, job: Job) -> tuple[list[Delta], Any]:
    engine.submit(job)
    return await rest(job)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_cancelled_decode_stops_at_the_next_token(k: int) -> None:
    """Cancelled after its k-th token was streamed: generate chooses token k + 1 (one
    more forward), whose put raises; k tokens reach the client and the metrics, the job
    ends Failed(499), and the next request is served in full."""
    model = FakeModel()
    model.pause_after[0] = k

    async def scenario() -> None:
        engine = await started(model)
        try:
            job = Job("req-a", [1, 2, 3], Params(max_new_tokens=20))
            engine.submit(job)
            await wait(model.paused)  # generate holds after its k-th token ...
            deltas = [await next_event(job) for _ in range(k)]  # ... which reached the loop
            assert deltas == [Delta(f" t{FIRST + i}", (FIRST + i,)) for i in range(k)]
            assert job.events.empty()
            engine.cancel(job)  # as the app does when the client goes away
            model.resume.set()
            final = await next_event(job)
            assert final == Failed("the client went away", status=499)
            assert job.events.empty()
            call = model.calls[0]
            assert (call.made, call.forwards) == (k + 1, k + 1)  # not 20
            assert isinstance(call.raised, _Cancelled)
            assert requests(engine, "cancelled") == 1
            assert generated(engine) == k

            # The worker is free: the next request runs to its length.
            nxt = Job("req-b", [4, 5], Params(max_new_tokens=3))
            deltas, final = await run_to_end(engine, nxt)
            assert [d.token_ids for d in deltas] == [(FIRST,), (FIRST + 1,), (FIRST + 2,)]
            assert isinstance(final, Finished)
            assert (final.finish_reason, final.prompt_tokens, final.completion_tokens) == (
                "length",
                2,
                3,
            )
            assert final.psr["decode_steps"] == 3
            assert [c.prompt for c in model.calls] == [[1, 2, 3], [4, 5]]
            assert model.calls[1].made == 3 and model.calls[1].raised is None
            assert model.calls[1].kwargs == {"do_sample": False, "eos_token_id": [EOS]}
            assert requests(engine, "length") == 1
            assert requests(engine, "cancelled") == 1
            assert generated(engine) == k + 3
        finally:
            stop(engine, model)

    asyncio.run(scenario())


def test_a_cancelled_queued_request_never_reaches_generate() -> None:
    """Cancelled while another decodes: it leaves the queue at once (counted cancelled,
    no event: the app answers the client), and the worker goes on to the next one."""
    model = FakeModel()
    model.pause_after[0] = 1

    async def scenario() -> None:
        engine = await started(model)
        try:
            running = Job("req-a", [1, 2, 3], Params(max_new_tokens=4))
            engine.submit(running)
            await wait(model.paused)
            queued = Job("req-b", [7, 8], Params(max_new_tokens=4))
            engine.submit(queued)
            assert sample(engine, "psr_queue_depth") == 1
            engine.cancel(queued)
            assert queued.cancelled
            assert sample(engine, "psr_queue_depth") == 0
            assert requests(engine, "cancelled") == 1
            model.resume.set()
            deltas, final = await rest(running)
            assert [d.token_ids for d in deltas] == [(FIRST + i,) for i in range(4)]
            assert isinstance(final, Finished) and final.finish_reason == "length"

            # The worker skips nothing else: the next request is the next generate call.
            after = Job("req-c", [9], Params(max_new_tokens=2))
            deltas, final = await run_to_end(engine, after)
            assert isinstance(final, Finished) and final.completion_tokens == 2
            assert [c.prompt for c in model.calls] == [[1, 2, 3], [9]]  # never [7, 8]
            assert queued.events.empty()
            assert requests(engine, "cancelled") == 1
            assert requests(engine, "length") == 2
        finally:
            stop(engine, model)

    asyncio.run(scenario())
