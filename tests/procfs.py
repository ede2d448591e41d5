"""What /proc says about this test process: the store's copy threads and resident memory
(leak tests of the store and of dropped models)."""

from __future__ import annotations

import os


def copy_threads() -> int:
    """Live copy-worker threads of this process (the CPU backend names them "psr-copy").

    Counting every thread would also count torch's intra-op pool, which starts threads
    lazily."""
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
