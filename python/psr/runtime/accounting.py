"""What decoding did: the decode statistics (totals and per-token records), the trace
recorder, and the store's counters marked at sequence and token boundaries."""

from __future__ import annotations

from psr.runtime.stats import TIER_KEYS, Stats
from psr.runtime.trace import TraceRecorder
from psr.store import ExpertStore


class Accounting:
    """Counts go to the totals and to the open token's record; stall time is the store's
    counter read at token boundaries; prefill copies are the store's counters between the
    start of a sequence and the end of its prefill."""

    def __init__(self, store: ExpertStore, expert_bytes: list[int]) -> None:
        self.store = store
        self.expert_bytes = expert_bytes  # per MoE layer: one row's bytes (one copy)
        self.stats = Stats()
        self.recorder: TraceRecorder | None = None  # set to record decode traces
        self.token: dict[str, float] | None = None  # the open token's record
        self._stall_mark = 0.0
        self._prefill_mark: dict[str, float] = {}
        self._tier_mark: dict[str, float] = {}

    def count(self, **counts: int) -> None:
        for key, value in counts.items():
            self.stats.add(self.token, key, value)

    def count_copies(self, n: int, layer: int) -> None:
        self.count(copies=n, bytes_copied=n * self.expert_bytes[layer])

    # --- boundaries --------------------------------------------------------------
    def begin_sequence(self) -> None:
        self.close_token()
        self._prefill_mark = self.store.counters()

    def open_token(self) -> int:
        """A decode step begins: a record (and a trace token) for it; returns the trace
        token's index (-1 when not recording)."""
        if self.token is not None:  # normally closed by end_step already
            self.close_token()
        self.token = self.stats.new_token()
        return self.recorder.new_token() if self.recorder is not None else -1

    def _tiers(self, c: dict[str, float], count: bool = True) -> None:
        """The tier counters since the last mark to the totals (`count=False`: mark only,
        at the end of a prefill, whose reads are not decode reads)."""
        for k in TIER_KEYS:
            if count:
                self.stats.totals[k] += c[k] - self._tier_mark.get(k, 0)
            self._tier_mark[k] = c[k]

    def close_token(self) -> None:
        c = self.store.counters()
        stall = c["stall_s"]
        if self.token is not None:
            self.stats.add(self.token, "stall_s", stall - self._stall_mark)
            self._tiers(c)
        self._stall_mark = stall
        self.token = None

    def add_stall(self) -> None:
        """Stall time since the last mark to the totals (the device step's joins: it keeps
        no per-token record)."""
        c = self.store.counters()
        stall = c["stall_s"]
        self.stats.totals["stall_s"] += stall - self._stall_mark
        self._stall_mark = stall
        self._tiers(c)

    def end_step(self, seconds: float) -> None:
        """After a decode forward of `seconds`: closes the token's record."""
        self.stats.totals["decode_s"] += seconds
        if self.token is not None:
            self.token["time_s"] = seconds
            self.close_token()

    def end_prefill(self) -> None:
        c, m = self.store.counters(), self._prefill_mark
        self.stats.totals["prefill_copies"] += c["copies"] - m.get("copies", 0)
        self.stats.totals["prefill_bytes"] += c["bytes_copied"] - m.get("bytes_copied", 0)
        self.stats.totals["prefill_stall_s"] += c["stall_s"] - m.get("stall_s", 0.0)
        self._stall_mark = c["stall_s"]
        self._tiers(c, count=False)
