"""One request on its way through the server: its decoding arguments, the events the worker
sends the event loop, its streamer (text out as tokens are made; stop strings, grammar and
cancellation end it within one token) and its decoding state (`Run`). Shared by the
one-at-a-time worker (`worker.py`) and `--parallel`'s batch (`parallel.py`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from psr.serve.decoding import GrammarMask, LogprobSink, Processors
from psr.serve.protocol import Sampling
from psr.serve.stops import Detokenizer, StopBuffer


@dataclass(frozen=True)
class Params:
    """`model.generate`'s decoding arguments for one request (seed drawn if not given)."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0

    def generate_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.do_sample:
            kw |= {
                "temperature": self.temperature,
                "top_k": self.top_k,
                "top_p": self.top_p,
                "seed": self.seed,
            }
            if self.min_p > 0:
                kw["min_p"] = self.min_p
        return kw


@dataclass(frozen=True)
class Logprob:
    """One token's logprob entry: its text and logprob, and the most likely tokens'."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


# ------------------------------------------------------------------ events: worker -> loop


@dataclass(frozen=True)
class Delta:
    """Text that may be shown now (possibly empty), and the tokens made since the last."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    psr: dict[str, Any]
    # Of prompt_tokens, those read from a prompt cache rather than prefilled: the one
    # figure usage reports as OpenAI's cached_tokens and Anthropic's
    # cache_read_input_tokens (resumed from the prompt cache).
    cached_tokens: int = 0
    stop_string: str | None = None  # the stop string that ended it, if one did
    logprob_sum: float = 0.0  # of its tokens (a scored job's: best_of ranks by the mean)


@dataclass(frozen=True)
class Failed:
    """The request failed inside the model (500), or was cancelled."""

    message: str
    status: int = 500


class Disconnected:
    """Put by the app when the client went away (the job is cancelled)."""


Event = Delta | Finished | Failed | Disconnected


@dataclass(eq=False)  # compared by identity (queue removal)
class Job:
    """One request on its way through the queue and the worker."""

    id: str
    prompt_ids: list[int]
    params: Params
    stops: tuple[str, ...] = ()
    sampling: Sampling | None = None  # penalties, ignore_eos, logprobs
    grammar: str | None = None  # an llguidance grammar (checked) the output must follow
    request_id: str = ""  # X-Request-Id, for the log line
    # Special tokens stay in the text (all but EOS): a tool-call format whose markers are
    # special tokens of the checkpoint's vocabulary (Mistral's [TOOL_CALLS]).
    keep_special: bool = False
    score: bool = False  # sum its tokens' logprobs (best_of > n ranks the choices)
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when the worker took it
    # Created in the event loop's thread (submit runs there); filled by the worker.
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = "the request was cancelled"
    cancel_status: int = 499  # client gone (nginx's code); 503 when the server stops

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class _Cancelled(Exception):
    pass


class _StopString(Exception):
    pass


class _GrammarDone(Exception):
    pass


class _Streamer:
    """transformers' streamer protocol, as `model.generate` drives it: put(prompt), then
    put(tokens) per step (one token; several at once when decoding speculatively), end()."""

    def __init__(
        self,
        job: Job,
        detok: Detokenizer,
        stops: StopBuffer,
        emit: Callable[[Event], None],
        sink: LogprobSink | None = None,
        grammar: GrammarMask | None = None,
    ) -> None:
        self.job, self.detok, self.stops, self.emit = job, detok, stops, emit
        self.sink, self.grammar = sink, grammar
        self.tokens: list[int] = []
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for t in value.reshape(-1).tolist():
            if self.job.cancelled:
                raise _Cancelled
            self.tokens.append(int(t))
            self.times.append(time.perf_counter())
            lp = () if self.sink is None else (self._logprob(len(self.tokens) - 1),)
            self.emit(Delta(self.stops.feed(self.detok.add(int(t))), (int(t),), lp))
            if self.stops.stopped:
                raise _StopString
            if self.grammar is not None:
                self.grammar.consume(int(t))  # the next mask follows this token
                if self.grammar.done:
                    raise _GrammarDone

    def end(self) -> None:
        pass

    def _logprob(self, i: int) -> Logprob:
        assert self.sink is not None
        token, lp, top = self.sink.rows[i]
        piece = self.detok.piece
        return Logprob(piece(token), lp, tuple((piece(t), v) for t, v in top))


@dataclass
class Run:
    """One request's decoding state in the worker (`Engine.prepare`)."""

    job: Job
    detok: Detokenizer
    stops: StopBuffer
    sink: LogprobSink | None
    processors: Processors | None
    mask: GrammarMask | None
    streamer: _Streamer
    eos: tuple[int, ...]  # the ids that end it (none with ignore_eos)
