"""Independent configurations measured in worker processes (issues 40, 42).

A demo, eval, sweep or tune scores configurations that share nothing but their inputs.
On a few cores with the embedded model's small matrices, one single-threaded process per
physical core does more work than one process with a thread per core (torch's intra-op
pool scales poorly at these sizes), so `Workers.map` runs one task per configuration in a
pool of spawned processes and this one (the last worker: it has the imports each spawned
process pays), each with `threads` intra-op threads, and returns the results
in the order of its tasks: whatever the worker count, the same results in the same order
(each configuration loads its own model and depends on no other run's state).

One worker runs the tasks in this process, one after another: no pool, no pickling.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.pool import Pool
from typing import Any

from psr.machine import THREADS_ENV, check_cpus, physical_cores


def default_workers() -> int:
    """One worker per physical core available to the process (its affinity mask)."""
    return physical_cores()


def check_workers(workers: int) -> int:
    """`workers` as given, if the process may use that many CPUs; else ValueError."""
    return check_cpus(workers, "workers")


def _start(threads: int) -> None:
    """A worker's start: its intra-op threads, kept by every psr.load it makes."""
    os.environ[THREADS_ENV] = str(threads)
    import torch

    torch.set_num_threads(threads)


@contextmanager
def _threads(threads: int) -> Iterator[None]:
    """This process as a worker: `threads` intra-op threads (as `_start` gives a spawned
    one) while it runs a task, its own afterwards."""
    import torch

    env, before = os.environ.get(THREADS_ENV), torch.get_num_threads()
    _start(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop(THREADS_ENV, None)
        else:
            os.environ[THREADS_ENV] = env


def _call(task: tuple[int, Callable[..., Any], tuple[Any, ...]]) -> tuple[int, Any]:
    i, fn, args = task
    return i, fn(*args)


class Workers:
    """`workers` processes of `threads` intra-op threads each, started on first use and
    kept for later `map` calls until `close()` (or the `with` block's end)."""

    def __init__(self, workers: int = 1, threads: int = 1) -> None:
        self.workers, self.threads = check_workers(workers), threads
        self._pool: Pool | None = None

    def map(
        self,
        fn: Callable[..., Any],
        tasks: Sequence[tuple[Any, ...]],
        done: Callable[[int, Any], object] | None = None,
    ) -> list[Any]:
        """`[fn(*t) for t in tasks]`, the tasks spread over the workers; `fn` must be a
        module-level function and its arguments and result picklable. `done(i, result)` is
        called here as each task ends (in completion order: for progress only)."""
        out: list[Any] = [None] * len(tasks)
        if self.workers == 1 or len(tasks) <= 1:
            for i, t in enumerate(tasks):
                out[i] = fn(*t)
                if done is not None:
                    done(i, out[i])
            return out
        if self._pool is None:
            # spawn, not fork: a forked torch with a live OpenMP pool can hang. This
            # process is the last worker (it has the imports each spawned one pays).
            ctx = multiprocessing.get_context("spawn")
            self._pool = ctx.Pool(self.workers - 1, initializer=_start, initargs=(self.threads,))
        pool = self._pool
        todo = deque(range(len(tasks)))
        lock = threading.Lock()
        finished: queue.Queue[tuple[int, Any] | BaseException] = queue.Queue()

        def submit(result: tuple[int, Any] | None = None) -> None:
            # The pool's result thread hands each finished worker the next task at once.
            if result is not None:
                finished.put(result)
            with lock:
                if not todo:
                    return
                i = todo.popleft()
            pool.apply_async(
                _call, ((i, fn, tasks[i]),), callback=submit, error_callback=finished.put
            )

        def got(r: tuple[int, Any] | BaseException) -> None:
            if isinstance(r, BaseException):
                raise r
            out[r[0]] = r[1]
            if done is not None:
                done(*r)

        try:
            for _ in range(self.workers - 1):
                submit()
            left = len(tasks)
            while left:
                while not finished.empty():
                    got(finished.get())
                    left -= 1
                with lock:
                    mine = todo.popleft() if todo else None
                if mine is not None:
                    with _threads(self.threads):
                        got(_call((mine, fn, tasks[mine])))
                    left -= 1
                elif left:
                    got(finished.get())
                    left -= 1
        except BaseException:
            self.close(kill=True)
            raise
        return out

    def close(self, kill: bool = False) -> None:
        """Stop the workers (`kill`: at once, abandoning their tasks)."""
        if self._pool is not None:
            if kill:
                self._pool.terminate()
            else:
                self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)
