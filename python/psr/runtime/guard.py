"""One sequence at a time: the lock every forward holds, and the owner of the sequence.

A sequence belongs to the thread that began it and to its KV-cache object. A forward with
an empty (or no) KV cache begins a new sequence; any other forward must continue the
current one, from the same thread and with the same cache object, or it is refused:
interleaved sequences would route on each other's caches.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from psr.runtime.kv import output_cache


class SequenceGuard:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._owner: int | None = None
        self._kv_ref: Any = None

    def enter(self, kv: Any, begin_sequence: Callable[[], None], new: bool | None = None) -> bool:
        """Called (under `lock`) before a forward with its KV cache; returns whether it
        begins a new sequence (after calling `begin_sequence`). `new`: the caller knows
        (a static cache is reused across sequences, so its length cannot tell)."""
        if new is None:
            new = kv is None or (hasattr(kv, "get_seq_length") and kv.get_seq_length() == 0)
        if new:
            begin_sequence()
            self._owner = threading.get_ident()
            try:
                self._kv_ref = None if kv is None else weakref.ref(kv)
            except TypeError:  # a cache type without weakref support: thread check only
                self._kv_ref = None
            return True
        if self._owner is None:
            raise RuntimeError(
                "psr: this forward continues a sequence the runtime never began "
                "(start decoding with an empty KV cache)"
            )
        if self._owner != threading.get_ident():
            raise RuntimeError(
                "psr: this model's current sequence belongs to another thread; psr decodes "
                "one sequence at a time: serialise calls (OffloadedModel methods wait for "
                "each other) or use one model per thread"
            )
        if self._kv_ref is not None and self._kv_ref() is not kv:
            raise RuntimeError(
                "psr: this forward's KV cache is not the current sequence's; psr decodes "
                "one sequence at a time (finish or restart the other sequence)"
            )
        return False

    def exit(self, output: Any) -> None:
        """After a forward: a sequence begun without a cache object adopts the one the
        model returned (what the next forward must pass back)."""
        if self._kv_ref is None and self._owner is not None:
            kv = output_cache(output)
            if kv is not None:
                try:
                    self._kv_ref = weakref.ref(kv)
                except TypeError:
                    pass

    def end(self) -> None:
        """The sequence cannot be continued (a scored window is complete in one forward)."""
        self._owner = None
