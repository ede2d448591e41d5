"""Finished answers prefilled into the prompt cache while the server is idle.

A conversation's next turn sends the last prompt, the answer and new text. The prompt cache
resumes it where it parts from a cached prompt (psr.runtime.chunked): at the last prompt's
end, so the answer is prefilled again, on the next turn's time to first token. The answer's
decode-time KV is not what a prefill computes (under PSR steering its tokens were routed
with the cache bias) and a hit must change nothing, so it is not kept. Instead, when no
request runs or waits, the server prefills each finished request's prompt and answer (the
`MOST` most recent, newest first), one prefill chunk at a time, and stops as soon as a
request arrives (the chunks computed stay cached): the next turn resumes at the end of the
answer, or where the template's rendering of it parts from the generated tokens. Only with a
row-invariant forward (the CPU backend; `psr serve` turns it on with its prompt cache),
whose state after any prefix resumes, so the prompt's end is where the answer starts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from psr.runtime.batch import KVBudgetExceeded
from psr.runtime.chunked import PromptCache, boundaries

MOST = 4  # finished requests waiting to be prefilled; older ones are dropped


class IdlePrefill:
    """The finished requests to prefill while idle, and the two ways of doing one chunk:
    `solo_step` (the one-at-a-time worker, through `generate`) and `batch_step` (the slots'
    BatchDecoder, as a sequence that only prefills, into the decoder's prompt cache). The
    prompt cache is the caller's (the server's), passed to `note` and `solo_step`. `on`:
    whether to prefill answers at all; `counted(tokens)` is told the tokens each chunk
    prefilled (the server's metrics)."""

    def __init__(self, on: bool = True, counted: Callable[[int], None] | None = None) -> None:
        self.on = on
        self.counted = counted or (lambda tokens: None)
        # (prompt and answer ids, prefilled up to): the newest last
        self.pending: deque[tuple[list[int], int]] = deque(maxlen=MOST)
        self._solo: tuple[list[int], int] | None = None  # the one `solo_step` prefills
        self._seq: int | None = None  # the decoder's sequence prefilling one

    def __bool__(self) -> bool:
        """Whether there is idle prefill to do."""
        return bool(self.pending) or self._solo is not None or self._seq is not None

    def note(
        self, model: Any, prompt: Sequence[int], answer: Sequence[int], cache: PromptCache | None
    ) -> None:
        """A request finished with `answer` after `prompt`: prefill both into `cache` when
        idle (its prompt's end is cached: its answer is what is left)."""
        if self.on and cache is not None and answer and model.row_invariant:
            ids = [*prompt, *answer]
            if model.context is not None:  # prefilled with one token after it
                ids = ids[: model.context - 1]
            if len(ids) > len(prompt):
                self.pending.append((ids, len(prompt)))
                self._solo = None  # the newest first: one cut short stays as far as it got

    def solo_step(self, model: Any, cache: PromptCache | None) -> None:
        """One chunk of the newest finished request through `generate` into `cache`: up to
        the next chunk boundary, resuming where the last call ended (a row-invariant
        prompt's end is cached)."""
        ids, done = self._solo or self.pending.pop()
        end = boundaries(done, len(ids), model.prefill_chunk)[0]
        model.generate(ids[:end], max_new_tokens=1, prompt_cache=cache)
        self.counted(end - done)
        self._solo = None if end >= len(ids) else (ids, end)

    def batch_step(self, dec: Any) -> None:
        """One chunk of the newest finished request as a prefill-only sequence of `dec`."""
        if self._seq is None:
            try:
                self._seq = dec.add(self.pending.pop()[0])
            except KVBudgetExceeded:  # longer than the batch's whole KV budget: dropped
                return
        before = dec.stats["prefill_tokens"]
        dec.feed({})  # one chunk of the oldest queued prefill: the only one
        done = dec.stats["prefill_tokens"] - before
        self.counted(done)
        # Prefilled, or its chunk waits (no room in kv_tokens; alone it always has): it leaves.
        if not done or not dec.prefilling(self._seq):
            self.batch_stop(dec)

    def drop(self, dec: Any = None) -> None:
        """Forget every finished request (a step failed), the sequence of `dec` leaving it."""
        self.pending.clear()
        self._solo = None
        if dec is not None:
            try:
                self.batch_stop(dec)
            finally:
                self._seq = None

    def batch_stop(self, dec: Any) -> None:
        """A request arrived (or the prefill ended): the sequence leaves `dec`; its chunks
        stay cached."""
        if self._seq is not None:
            dec.remove(self._seq)
            self._seq = None
