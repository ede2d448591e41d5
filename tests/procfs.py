"""What /proc says about this test process: the store's copy threads and resident memory
(leak tests of the store and of dropped models)."""

from __future__ import annotations

import os
import time


def copy_threads(expect: int | None = None, timeout_s: float = 5.0) -> int:
    """Live copy-worker threads of this process (the CPU backend names them "psr-copy").

    Counting every thread would also count torch's intra-op pool, which starts threads
    lazily. With `expect`, poll up to `timeout_s` for that count: `pthread_join` returns
    once the kernel clears the thread's tid, a moment before the task leaves
    /proc/self/task, so a joined worker can still be listed (seen under xdist's load)."""
    deadline = time.monotonic() + timeout_s
    n = _count()
    while expect is not None and n != expect and time.monotonic() < deadline:
        time.sleep(0.005)
        n = _count()
    return n


def _count() -> int:
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "psr-copy"
        except OSError:  # the thread ended while we listed
            pass
    return n


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
