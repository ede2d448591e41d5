"""`psr serve --parallel N`: up to N requests decode together, each as it would alone.

The worker thread runs one `psr.runtime.batch.BatchDecoder`: queued requests join it
between steps (their prompts prefilled chunk by chunk between the others' steps), each
step chooses every waiting sequence's next token with that request's own
`TokenChooser` (its penalties, grammar mask, seeded sampling and logprobs, as
`model.generate` makes them), then decodes the batch one token. The decoder keeps every
sequence isolated (its own logical caches; each row computed as at batch 1), so a
request's tokens are those of its solo run whoever shares its steps. With the server's
prompt cache the decoder resumes a newcomer from it and keeps its prefill's states
(runtime/batch.py), shared with the one-slot path; a hit changes no token, and the
request's `cached_tokens` are its own. A request that ends (EOS, length, a stop string,
its grammar complete, cancelled, failed) leaves at once and frees its slot.

Under a KV budget (`kv_limit`: N caches of the context do not fit memory) a request joins
only when its prompt + max_tokens fits beside the running requests' reservations
(BatchDecoder.waits); until then it waits in the engine's queue, first in first out (a
large one is not overtaken by later small ones), and a request that leaves (finished,
cancelled, failed) frees its reservation. So a running step never passes the budget; a
request whose own reservation exceeds it is refused at once (400).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from psr.runtime.batch import KVBudgetExceeded
from psr.runtime.generate import TokenChooser, resolve_settings
from psr.serve.job import Run, _Cancelled, _GrammarDone, _StopString

if TYPE_CHECKING:
    from psr.runtime.batch import BatchDecoder
    from psr.serve.job import Job
    from psr.serve.worker import Engine

log = logging.getLogger("psr.serve")

# --parallel auto opens at most this many slots (llama-server's default): at b = 4 each
# request's ms/token stays near 2x its solo run's, more slots stretch it further
# (bench/results/batch).
AUTO_MAX = 4
# The share of the memory available after loading that auto's KV caches may take: the rest
# stays for the prompt cache, the page cache and the forward's workspaces.
KV_SHARE = 0.5


def kv_room(model: Any, prompt_cache_bytes: int, share: float = KV_SHARE) -> int:
    """Bytes the slots' KV caches may take on the CPU backend: `share` of MemAvailable
    after loading, less the prompt cache's budget, and within `host_memory` (what it
    leaves beside the held experts, the dense part and the slab)."""
    from psr.models.tiers import meminfo

    room = int(meminfo().get("MemAvailable", 0) * share) - prompt_cache_bytes
    budget = getattr(model, "host_budget", None)
    if budget is not None:
        mem = model.memory()
        held = mem["host_experts"] + mem["device_dense"] + mem["device_slab"]
        room = min(room, budget - held)
    return max(room, 0)


def auto_parallel(model: Any, prompt_cache_bytes: int) -> tuple[int, str]:
    """`--parallel auto`: the slots to open and why: as many KV caches of the model's
    context as fit `kv_room`, 1 to AUTO_MAX. CUDA keeps one (its solo decode runs the
    device step and CUDA graphs, which the batch does not capture yet)."""
    from psr.models.tiers import fmt_bytes

    if model.runtime.store.backend == "cuda":
        return 1, "1 slot: on CUDA one request decodes faster through the device step and graphs"
    context = int(model.context or 0)
    per_seq = max(model.memory(context)["device_kv"], 1)
    room = kv_room(model, prompt_cache_bytes)
    n = max(1, min(AUTO_MAX, room // per_seq))
    return n, (
        f"{n} slot{'s' if n > 1 else ''}: KV caches of {context} tokens take "
        f"{fmt_bytes(per_seq)} each, {fmt_bytes(room)} free for them "
        f"({KV_SHARE:.0%} of the memory available after loading, less the prompt cache); "
        f"at most {AUTO_MAX}"
    )


def kv_limit(model: Any, n: int, prompt_cache_bytes: int) -> int | None:
    """An explicit `--parallel n`'s KV budget in tokens (BatchDecoder's `kv_tokens`) on the
    CPU backend: None when n KV caches of the model's context fit the memory available
    after loading (less the prompt cache), else the tokens that do (at least 1)."""
    if model.runtime.store.backend == "cuda":
        return None
    context = int(model.context or 0)
    room = kv_room(model, prompt_cache_bytes, share=1.0)
    if n * model.memory(context)["device_kv"] <= room:
        return None
    per_token: int = max(model.memory(1)["device_kv"], 1)
    return max(room // per_token, 1)


def open_slots(engine: Engine, model: Any) -> Slots | None:
    """Resolve `engine.parallel` for the loaded `model` (logged): the batch's slots, or
    None for the one-at-a-time worker. An explicit parallel > 1 that cannot batch raises
    ValueError; auto falls back to one slot, saying why."""
    from psr.runtime.batch import BatchDecoder

    cache = engine.prompt_cache
    auto = engine.parallel is None
    if engine.parallel is None:
        engine.parallel, why = auto_parallel(model, cache.max_bytes if cache else 0)
    else:
        why = f"{engine.parallel} slot{'s' if engine.parallel > 1 else ''}"
    dec, kv_tokens = None, None
    if engine.parallel > 1 and not auto:
        kv_tokens = kv_limit(model, engine.parallel, cache.max_bytes if cache else 0)
        if kv_tokens is not None:
            why += (f"; their KV caches hold at most {kv_tokens} tokens together (the memory "
                    "available): a request whose prompt + max_tokens does not fit beside the "
                    "running ones' waits, one beyond it is refused")  # fmt: skip
    if engine.parallel > 1:
        try:
            dec = BatchDecoder(model, engine.parallel, kv_tokens=kv_tokens, prompt_cache=cache)
        except ValueError as e:
            if not auto:
                raise ValueError(f"--parallel {engine.parallel}: {e}") from e
            engine.parallel, why = 1, f"1 slot ({e})"
    if dec is not None:
        C, store = model.runtime.capacity, model.runtime.store
        why += f"; the batch's slab {dec.slab.size} of {store.layers[0].num_slots} slots per layer"
        why += f" (each sequence's cache {C})"
    log.info("--parallel %s: %s", "auto" if auto else engine.parallel, why)
    engine.metrics.slots.set(engine.parallel)
    return None if dec is None else Slots(engine, dec)


@dataclass
class _Slot:
    """A request decoding in the batch."""

    run: Run
    seq: int  # its sequence in the decoder
    chooser: TokenChooser
    steps: int = 0  # batched steps it took part in
    batch_sum: int = 0  # sum of those steps' batch sizes


class Slots:
    """The batched worker loop (module docstring); `run` in the worker thread."""

    def __init__(self, engine: Engine, dec: BatchDecoder) -> None:
        self.engine, self.dec = engine, dec
        self.slots: dict[int, _Slot] = {}  # by sequence id
        engine.metrics.slots.set(dec.max_batch)

    def run(self) -> None:
        """Serve until the engine stops; every live request is answered (503) then."""
        eng, idle = self.engine, self.engine.idle
        while True:
            # One at a time: whether the next fits depends on the reservations of those
            # joined before it.
            jobs = eng.take(wait=not self.slots and not idle, admits=self._admits, most=1)
            if eng.stopping:
                for slot in list(self.slots.values()):
                    self._end(slot, None, None)
                idle.drop(self.dec)
                return
            if jobs or eng.queued:  # requests first (one may wait for the idle one's KV):
                # an idle prefill leaves the batch (its chunks stay cached)
                eng.idle_step(lambda: idle.batch_stop(self.dec), self.dec)
            while jobs:
                self._join(jobs[0])
                jobs = eng.take(wait=False, admits=self._admits, most=1)
            self._drop_cancelled()
            if self.slots:
                self._step()
            elif idle and not eng.queued:  # none running or queued: a chunk of idle prefill
                eng.idle_step(lambda: idle.batch_step(self.dec), self.dec)

    # --- one request -------------------------------------------------------------------
    def _admits(self, job: Job) -> bool:
        """Whether `job` may join now: its KV reservation fits beside the running ones'."""
        try:
            return not self.dec.waits(len(job.prompt_ids), job.params.max_new_tokens)
        except (TypeError, ValueError):  # bad max_tokens: `add` refuses it, this request only
            return True

    def _join(self, job: Job) -> None:
        eng = self.engine
        run = eng.prepare(job)
        try:
            kw = job.params.generate_kwargs()
            seed = kw.pop("seed", 0)
            kw["eos_token_id"] = list(run.eos) or None
            settings = resolve_settings(len(job.prompt_ids), kw, None, {})
            ids = torch.tensor([job.prompt_ids], device=eng.model.device)
            chooser = TokenChooser(ids, settings, seed, run.processors, run.sink)
            seq = self.dec.add(job.prompt_ids, job.params.max_new_tokens)
        except KVBudgetExceeded as e:  # it can never fit: refused, as bad input
            eng.refuse(job, str(e))
            return
        except Exception as e:  # this request's 500 only
            eng.conclude(run, None, e, {}, None)
            eng.leave(job)
            return
        run.streamer.put(ids.cpu())  # the streamer's protocol: the prompt first
        self.slots[seq] = _Slot(run, seq, chooser)

    def _drop_cancelled(self) -> None:
        for slot in [s for s in self.slots.values() if s.run.job.cancelled]:
            self._end(slot, None, None)

    def _end(self, slot: _Slot, finish: str | None, error: Exception | None) -> None:
        """`slot`'s request leaves the batch and is answered."""
        self.slots.pop(slot.seq, None)
        cached, counts = 0, {}
        try:
            cached = self.dec.cached_tokens(slot.seq)
            counts = self.dec.seq_stats(slot.seq)
            self.dec.remove(slot.seq)
        except KeyError:
            pass
        eng = self.engine
        if finish is not None:
            run = slot.run
            eng.idle.note(eng.model, run.job.prompt_ids, run.streamer.tokens, eng.prompt_cache)
        # Its routing counts are its solo run's (its own caches); the copies are the batch's.
        figures: dict[str, Any] = {
            "policy": eng.model.policy.describe(),
            "decode_steps": slot.steps,  # as solo: the first token comes from the prefill
            **{k: int(counts.get(k, 0)) for k in _ROUTING_KEYS},
            "mean_batch": round(slot.batch_sum / slot.steps, 3) if slot.steps else 0.0,
        }
        eng.conclude(slot.run, finish, error, figures, None, cached)
        eng.leave(slot.run.job)

    def _choose(self, slot: _Slot, logits: torch.Tensor) -> int | None:
        """`slot`'s next token, or None when its request has ended (answered here)."""
        try:
            token = slot.chooser.choose(logits)
            slot.run.streamer.put(torch.tensor([token]))
        except (_StopString, _GrammarDone):
            self._end(slot, "stop", None)
            return None
        except _Cancelled:
            self._end(slot, None, None)
            return None
        except Exception as e:
            self._end(slot, None, e)
            return None
        if slot.chooser.done:
            self._end(slot, "stop" if token in slot.run.eos else "length", None)
            return None
        return token

    # --- one step ----------------------------------------------------------------------
    def _step(self) -> None:
        """Each waiting sequence's token, then one batched decode step (which also runs a
        chunk of a joining request's prefill)."""
        before = dict(self.dec.stats)
        try:
            ready = self.dec.ready()
        except Exception as e:  # a prefill failed: the prefilling requests' 500
            for slot in [s for s in self.slots.values() if not s.chooser.new]:
                self._end(slot, None, e)
            return
        tokens: dict[int, int] = {}
        for seq, logits in ready.items():
            token = self._choose(self.slots[seq], logits)
            if token is not None:
                tokens[seq] = token
        batch = [self.slots[s] for s in tokens]
        try:
            self.dec.feed(tokens)
        except Exception as e:  # the step failed: its requests' 500
            for slot in batch:
                self._end(slot, None, e)
            return
        if tokens:
            self.engine.metrics.batch_size.observe(len(tokens))
            for slot in batch:
                slot.steps += 1
                slot.batch_sum += len(tokens)
        diff = {k: v - before.get(k, 0) for k, v in self.dec.stats.items()}
        self.engine.metrics.add_experts(_expert_counts(diff))


def _expert_counts(diff: dict[str, int]) -> dict[str, float]:
    """A step's counts in the metrics' names (what the batch does not count: 0)."""
    return {k: float(diff.get(k, 0)) for k in _EXPERT_KEYS}


# A request's own counts in a batch (runtime/batch.py's per-sequence counts).
_ROUTING_KEYS = (
    "routed", "hits", "misses", "prefetches", "prefetch_used", "substituted", "cpu_experts",
)  # fmt: skip

_EXPERT_KEYS = (
    "routed", "hits", "misses", "prefetches", "prefetch_used", "substituted", "cpu_experts",
    "bytes_copied", "stall_s", "prefill_bytes", "prefill_stall_s",
)  # fmt: skip
