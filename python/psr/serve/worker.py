"""The decoding side of the server: one worker thread, a bounded FIFO queue, cancellation.

With one slot (`--parallel 1`; parallel.py runs a batch) psr decodes one sequence at a
time, so requests wait in a FIFO queue and one worker thread runs `model.generate` for
each in turn; the event
loop never blocks on decoding. The worker also loads the model, so the server answers
`/health` (503) while it loads.

Tokens leave the worker as they are made: `generate` calls the job's streamer once per
new token, which turns it into text (incremental detokenizing, stop strings held back)
and hands a `Delta` to the event loop (`call_soon_threadsafe`). The same call is where a
request stops: a cancelled request (client gone) or a stop string makes it raise a
private exception, so `generate` ends before the next forward, within one token. The
model's stats are cumulative; the worker takes each request's differences around its
`generate` call, for the response's `psr` field and the metrics.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from psr.serve.decoding import GrammarMask, Grammars, LogprobSink, Penalties, Processors
from psr.serve.idle import IdlePrefill
from psr.serve.job import (
    Delta,
    Event,
    Failed,
    Finished,
    Job,
    Run,
    _Cancelled,
    _GrammarDone,
    _StopString,
    _Streamer,
)
from psr.serve.metrics import Metrics
from psr.serve.stops import Detokenizer, StopBuffer

if TYPE_CHECKING:
    from psr.runtime.chunked import PromptCache

log = logging.getLogger("psr.serve")


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token stands for: the longest vocab
    entry's (byte-level BPE spells each byte with one or two UTF-8 bytes, SentencePiece a
    space with three), doubled where a normalizer may shrink text first (NFC composing
    characters). None: the tokenizer's vocabulary is not readable."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return None
    if not vocab:
        return None
    longest = max(len(str(k).encode()) for k in vocab)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None) if backend is not None else None
    return longest * (2 if normalizer is not None else 1)


class QueueFull(Exception):
    """The queue holds --max-queue requests already."""


class NotReady(Exception):
    """The model is loading, failed to load, or the server is stopping."""


class Engine:
    """The queue and the worker. `start(loop)` loads the model in the worker thread and
    serves the queue; `submit(job)` (event loop thread) queues a request; `cancel(job)`
    drops it from the queue or stops its decoding within one token."""

    def __init__(
        self,
        loader: Callable[[], Any],
        *,
        max_queue: int = 16,
        metrics: Metrics | None = None,
        prompt_cache: PromptCache | None = None,
        parallel: int | None = 1,
        cache_answers: bool = True,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if parallel is not None and (isinstance(parallel, bool) or parallel < 1):
            raise ValueError(f"parallel must be an int >= 1 or None (auto), got {parallel!r}")
        self._loader = loader
        self.max_queue = max_queue
        # Requests decoding at once (psr.serve.parallel: one batch); None: chosen at load
        # (slots.auto_parallel). Resolved once the model is loaded.
        self.parallel = parallel
        self.metrics = metrics or Metrics()
        # Prefill states of earlier prompts (psr.runtime.chunked): a request extending an
        # earlier one (a conversation's next turn) resumes from it; None: no cache.
        self.prompt_cache = prompt_cache
        # Finished requests' prompts and answers prefilled into it while idle (idle.py).
        self.idle = IdlePrefill(cache_answers, self.metrics.idle_prefill.inc)
        self.model: Any = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        # Called (in the worker thread) when loading fails: the server should stop.
        self.on_fatal: Callable[[], None] | None = None
        # Called (in the worker thread) once the model is loaded and requests are served.
        self.on_ready: Callable[[], None] | None = None
        # Fast tokenizers must not be used from two threads at once: the event loop
        # encodes prompts while the worker decodes tokens.
        self.tokenizer_lock = threading.Lock()
        # Requests are tokenized (and templated, and grammars compiled) in threads off the
        # event loop with a tokenizer of their own, so a long prompt never holds the lock
        # the worker's detokenizing takes: it waits only for other requests' tokenizing.
        self.request_tokenizer: Any = None
        # What the app reads from the chat template once loaded (psr.serve.chat.Features).
        self.chat_features: Any = None
        self.request_lock = threading.Lock()
        self._grammars: Grammars | None = None
        # At most this many bytes of text per token (see max_bytes_per_token): a prompt of
        # more than context x this many bytes cannot fit, and is refused untokenized.
        self.bytes_per_token: int | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.context: int | None = None
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._active: list[Job] = []  # decoding now (at most `parallel`)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The worker thread (None before `start`)."""
        return self._thread

    # -------------------------------------------------------------- event loop side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._main, name="psr-serve-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every request (queued or decoding) and join the worker."""
        with self._cond:
            self._stopping = True
            reason = "the server is shutting down"
            for job in self._active:
                self._cancel(job, reason, 503)  # the worker answers it
            for job in self._queue:
                self._cancel(job, reason, 503)
                self._emit(job, Failed(reason, status=503))
            self._queue.clear()
            self.metrics.queue_depth.set(0)
            self._cond.notify_all()
        # A load under way cannot be interrupted: the (daemon) worker is left to the exit.
        if self._thread is not None and self.ready.is_set():
            self._thread.join(timeout)

    def submit(self, *jobs: Job) -> None:
        """Queue `jobs` (FIFO; all or none), or raise QueueFull / NotReady."""
        with self._cond:
            if self._stopping or not self.ready.is_set():
                raise NotReady
            free = (self.parallel or 1) - len(self._active)
            if len(self._queue) + len(jobs) > self.max_queue + max(free, 0):
                raise QueueFull
            self._queue.extend(jobs)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()

    def cancel(self, job: Job, reason: str = "the client went away") -> None:
        """Drop `job` from the queue, or stop its decoding within one token."""
        with self._cond:
            self._cancel(job, reason)
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.queue_depth.set(len(self._queue))
                self.metrics.count("cancelled")
                log.info("%s cancelled while queued: %s", job.id, reason)

    def _cancel(self, job: Job, reason: str, status: int = 499) -> None:
        if not job.cancelled:
            job.cancel_reason, job.cancel_status = reason, status
            job._cancelled.set()

    def decode_text(self, ids: Sequence[int]) -> str:
        with self.tokenizer_lock:
            text: str = self.model.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def decode_special(self, ids: Sequence[int]) -> str:
        """`decode_text` keeping special tokens, EOS aside."""
        kept = [t for t in ids if t not in self.eos_token_ids]
        with self.tokenizer_lock:
            text: str = self.model.tokenizer.decode(kept, skip_special_tokens=False)
        return text

    def request_decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids` with the requests' tokenizer (hold `request_lock`)."""
        text: str = self.request_tokenizer.decode(list(ids), skip_special_tokens=skip_special)
        return text

    def grammars(self) -> Grammars:
        """llguidance over the requests' tokenizer, made on first use (hold `request_lock`)."""
        if self._grammars is None:
            self._grammars = Grammars(
                self.request_tokenizer, self.model.config.vocab_size, self.eos_token_ids
            )
        return self._grammars

    # -------------------------------------------------------------- worker side

    def _emit(self, job: Job, event: Event) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def _main(self) -> None:
        try:
            model = self._loader()
            if getattr(model, "tokenizer", None) is None:
                raise ValueError(f"{model.path}: no tokenizer; the server reads and writes text")
            if self.prompt_cache is not None:
                model.check_prompt_cache(self.prompt_cache)
                # resume at any cached prefix (a turn's end), not a chunk boundary
                if model.row_invariant_blocker() is None:
                    model.set_row_invariant(True)
            from psr.serve.parallel import open_slots

            slots = open_slots(self, model)
        except BaseException as e:
            self.load_error = e
            log.error("loading the model failed: %s", e)
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self.model = model
        tok = model.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        self.eos_token_ids = tuple([eos] if isinstance(eos, int) else eos or ())
        # psr.load's context= when given, else the checkpoint's (OffloadedModel.context).
        ctx = getattr(model, "context", None)
        self.context = (
            ctx if ctx is not None else getattr(model.config, "max_position_embeddings", None)
        )
        self.request_tokenizer = copy.deepcopy(tok)
        self.bytes_per_token = max_bytes_per_token(tok)
        self.ready.set()
        log.info("model loaded: %s, policy %s", model.path, model.policy.describe())
        if self.on_ready is not None:
            self.on_ready()
        if slots is not None:
            slots.run()
            return
        while True:
            jobs = self.take(wait=not self.idle)
            if self._stopping:
                return
            if not jobs:  # none queued: a chunk of idle prefill
                self.idle_step(lambda: self.idle.solo_step(model, self.prompt_cache))
                continue
            try:
                self._decode(jobs[0])
            finally:
                self.leave(jobs[0])

    def idle_step(self, step: Callable[[], None], dec: Any = None) -> None:
        """One chunk of idle prefill (idle.py; `dec`: the slots' decoder it runs in); a
        failure drops it (logged): requests go on."""
        try:
            step()
        except Exception as e:
            log.warning("idle prefill of finished answers failed, dropped: %s", e)
            self.idle.drop(dec)

    def take(
        self, wait: bool, admits: Callable[[Job], bool] | None = None, most: int | None = None
    ) -> list[Job]:
        """Queued jobs for the free slots (at most `most`), oldest first (they become
        active); with `wait`, block until there is one. Empty when stopping (or none
        queued, not waiting). `admits` (default: all): whether the oldest may start now;
        when it may not, it and those behind it stay queued (FIFO: none overtakes it)."""
        with self._cond:
            while wait and not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return []
            jobs: list[Job] = []
            while self._queue and len(self._active) < (self.parallel or 1):
                if most is not None and len(jobs) >= most:
                    break
                if admits is not None and not admits(self._queue[0]):
                    break
                job = self._queue.popleft()
                job.started = time.perf_counter()
                self._active.append(job)
                jobs.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self.metrics.running.set(len(self._active))
            return jobs

    def leave(self, job: Job) -> None:
        """`job` no longer decodes: its slot is free."""
        with self._cond:
            self._active.remove(job)
            self.metrics.running.set(len(self._active))

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def queued(self) -> bool:
        """Whether a request waits in the queue."""
        with self._cond:
            return bool(self._queue)

    def _processors(self, job: Job) -> tuple[Processors | None, GrammarMask | None]:
        items: list[Any] = []
        if job.sampling is not None:
            pen = Penalties(job.sampling, len(job.prompt_ids))
            if pen.active:
                items.append(pen)
        mask = None
        if job.grammar is not None:
            with self.request_lock:
                mask = self.grammars().mask(job.grammar)
            items.append(mask)
        return (Processors(items) if items else None), mask

    def prepare(self, job: Job) -> Run:
        """`job`'s decoding state: detokenizer, stop strings, logprobs, processors, streamer."""
        decode = self.decode_special if job.keep_special else self.decode_text
        detok = Detokenizer(decode, job.prompt_ids)
        stops = StopBuffer(job.stops)
        s = job.sampling
        sink = None if s is None or s.logprobs is None else LogprobSink(s.logprobs)
        if sink is None and job.score:
            sink = LogprobSink(0)
        processors, mask = self._processors(job)
        streamer = _Streamer(job, detok, stops, lambda ev: self._emit(job, ev), sink, mask)
        ignore_eos = s is not None and s.ignore_eos
        eos = () if ignore_eos else self.eos_token_ids
        return Run(job, detok, stops, sink, processors, mask, streamer, eos)

    def _decode(self, job: Job) -> None:
        model = self.model
        run = self.prepare(job)
        before = dict(model.stats.totals)
        finish: str | None = None
        error: Exception | None = None
        extra: dict[str, Any] = {}
        if run.processors is not None:
            extra["logits_processor"] = run.processors
        if run.sink is not None:
            extra["logprobs"] = run.sink
        if self.prompt_cache is not None:
            extra["prompt_cache"] = self.prompt_cache
            self.prompt_cache.last_cached = 0
        try:
            model.generate(
                job.prompt_ids,
                **job.params.generate_kwargs(),
                eos_token_id=list(run.eos) or None,
                streamer=run.streamer,
                **extra,
            )
            final = run.streamer.tokens[-1] if run.streamer.tokens else None
            finish = "stop" if final in run.eos else "length"
        except (_StopString, _GrammarDone):
            finish = "stop"
        except _Cancelled:
            pass
        except Exception as e:  # a failure inside the model: this request's 500 only
            error = e
        if finish is not None:
            self.idle.note(model, job.prompt_ids, run.streamer.tokens, self.prompt_cache)
        after = model.stats.totals
        diff = {k: after[k] - before.get(k, 0) for k in after}
        cached = 0 if self.prompt_cache is None else self.prompt_cache.last_cached
        self.conclude(run, finish, error, self._psr_figures(model, diff), diff, cached)

    def refuse(self, job: Job, message: str) -> None:
        """`job`, taken but not decoded, is bad input the worker found (its KV reservation
        beyond --parallel's budget): a 400 with `message`; its slot is free."""
        self.metrics.count("invalid")
        rid = f" [{job.request_id}]" if job.request_id else ""
        log.info("%s%s refused: %s", job.id, rid, message)
        self._emit(job, Failed(message, status=400))
        self.leave(job)

    def conclude(
        self,
        run: Run,
        finish: str | None,
        error: Exception | None,
        figures: dict[str, Any],
        diff: dict[str, float] | None,
        cached: int = 0,
    ) -> None:
        """`run`'s end: `finish` ("stop" / "length"), else `error`, else it was cancelled.
        The last text, the Finished / Failed event, metrics and the log line. `diff`: its
        stats differences (None in a batch, whose counts are the batch's)."""
        job, stops, detok, mask = run.job, run.stops, run.detok, run.mask
        n = len(run.streamer.tokens)
        last: Event
        if finish is not None:
            tail = stops.feed(detok.flush())
            if stops.stopped:
                finish = "stop"
            else:
                tail += stops.flush()
            if tail:
                self._emit(job, Delta(tail, ()))
            if mask is not None:
                figures["grammar_mask_ms_per_token"] = round(
                    mask.seconds * 1e3 / max(mask.masks, 1), 4
                )
                self.metrics.grammar.observe(mask.seconds / max(mask.masks, 1))
            lps = 0.0 if run.sink is None else sum(row[1] for row in run.sink.rows)
            last = Finished(finish, len(job.prompt_ids), n, figures, cached, stops.matched, lps)
            outcome = finish
        elif error is not None:
            last = Failed(f"{type(error).__name__}: {error}")
            outcome = "error"
        else:
            last = Failed(job.cancel_reason, status=job.cancel_status)
            outcome = "cancelled"
        # Counted and logged before the answer goes out: a client that has its response
        # finds the request in /metrics.
        self.metrics.count(outcome)
        times = run.streamer.times
        self.metrics.add_request(
            diff, len(job.prompt_ids), n, times, job.arrived, job.started, cached
        )
        self._log(job, outcome, n, times, diff, error)
        self._emit(job, last)

    @staticmethod
    def _psr_figures(model: Any, d: dict[str, float]) -> dict[str, Any]:
        """This request's routing figures (decode steps; prefill bytes apart)."""
        return {
            "policy": model.policy.describe(),
            "decode_steps": int(d["tokens"]),
            "routed": int(d["routed"]),
            "hits": int(d["hits"]),
            "misses": int(d["misses"]),
            "prefetches": int(d["prefetches"]),
            "prefetch_used": int(d["prefetch_used"]),
            "substituted": int(d["substituted"]),
            "cpu_experts": int(d.get("cpu_experts", 0)),
            "bytes_copied": int(d["bytes_copied"]),
            "stall_s": round(float(d["stall_s"]), 6),
            "prefill_bytes": int(d["prefill_bytes"]),
        }

    def _log(
        self,
        job: Job,
        outcome: str,
        n: int,
        times: list[float],
        d: dict[str, float] | None,
        error: Exception | None,
    ) -> None:
        ttft = f"{(times[0] - job.arrived) * 1e3:.0f} ms" if times else "-"
        rate = f"{(n - 1) / (times[-1] - times[0]):.1f}" if n > 1 and times[-1] > times[0] else "-"
        rid = f" [{job.request_id}]" if job.request_id else ""
        line = (
            f"{job.id}{rid} {outcome}: prompt {len(job.prompt_ids)} + completion {n} tokens, "
            f"ttft {ttft}, {rate} tokens/s"
        )
        if d is not None:
            line += f", hits {int(d['hits'])} misses {int(d['misses'])}"
        if error is not None:
            line += f" ({type(error).__name__}: {error})"
        log.info(line)
