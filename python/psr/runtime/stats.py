"""Decode statistics: totals over decode steps, per-token records, prefill counts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

COUNT_KEYS = (
    "routed",
    "hits",
    "misses",
    "prefetches",
    "prefetch_used",
    "substituted",  # routed experts not in the layer's own exact (unbiased) top-k
    "cpu_experts",  # routed experts computed on the CPU (experts_on cpu / hybrid: misses)
    "copies",
    "bytes_copied",
)
# The deterministic counts and rates that results files keep (Stats.report()) ...
REPORT_KEYS = (
    "tokens",
    "routed",
    "hits",
    "misses",
    "prefetches",
    "prefetch_used",
    "hit_rate",
    "misses_per_token",
    "prefetch_used_frac",
    "substituted",
    "substitution_rate",
    "copies",
    "bytes_copied",
)
# ... and the measured times that timing benchmarks add to them.
TIMING_KEYS = ("stall_s", "decode_s", "tokens_per_s")
# Memory tiers (the store's counters over decode steps, physical like stall_s): bytes read
# from held rows (pinned on CUDA) and from pageable ones (page cache + disk, by mincore
# before each read), and the stall spent waiting for pageable rows.
TIER_KEYS = ("bytes_pinned", "bytes_pageable", "bytes_page_cache", "bytes_disk", "stall_pageable_s")


class Stats(Mapping[str, float]):
    """Totals over decode steps (dict-like), plus per-token records and prefill counts."""

    def __init__(self) -> None:
        # The CPU threads decoding ran with (OffloadedModel.stats sets it; 0: unknown); not
        # a count, so `reset` keeps it.
        self.threads = 0
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {k: 0 for k in ("tokens", *COUNT_KEYS)}
        self.totals |= {
            "stall_s": 0.0,
            "decode_s": 0.0,
            "prefill_tokens": 0,
            "prefill_copies": 0,
            "prefill_bytes": 0,
            "prefill_stall_s": 0.0,
            "captures": 0,  # decode graphs captured (runtime/graphs.py)
        }
        self.totals |= {k: 0 for k in TIER_KEYS}
        self.per_token: list[dict[str, float]] = []

    def new_token(self) -> dict[str, float]:
        rec = {k: 0 for k in COUNT_KEYS} | {"stall_s": 0.0, "time_s": 0.0}
        self.per_token.append(rec)
        self.totals["tokens"] += 1
        return rec

    def add_record(self, counts: Mapping[str, float], time_s: float = 0.0) -> None:
        """A decode step's record whose counts are already in the totals (the device
        decode step's, made from its snapshots when the stats are read)."""
        rec = {k: 0 for k in COUNT_KEYS} | {"stall_s": 0.0, "time_s": time_s}
        rec.update(counts)
        self.per_token.append(rec)

    def count_token(self) -> None:
        """A decode step counted in the totals (the device decode step: its record is
        added when its counts are read, `add_record`)."""
        self.totals["tokens"] += 1

    def add(self, rec: dict[str, float] | None, key: str, value: float) -> None:
        self.totals[key] += value
        if rec is not None:
            rec[key] += value

    def summary(self) -> dict[str, float]:
        t = dict(self.totals)
        n = max(t["tokens"], 1)
        t["hit_rate"] = t["hits"] / t["routed"] if t["routed"] else 0.0
        t["misses_per_token"] = t["misses"] / n
        t["prefetch_used_frac"] = t["prefetch_used"] / t["prefetches"] if t["prefetches"] else 0.0
        t["substitution_rate"] = t["substituted"] / t["routed"] if t["routed"] else 0.0
        t["tokens_per_s"] = t["tokens"] / t["decode_s"] if t["decode_s"] > 0 else 0.0
        t["threads"] = self.threads
        return t

    def report(self, keys: tuple[str, ...] = REPORT_KEYS) -> dict[str, float]:
        """The summary restricted to `keys` (what results files keep)."""
        s = self.summary()
        return {k: s[k] for k in keys}

    def __getitem__(self, key: str) -> float:
        return self.summary()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.summary())

    def __len__(self) -> int:
        return len(self.summary())

    def table(self) -> str:
        s = self.summary()
        rows = [
            ("decode steps (tokens or verify blocks)", f"{s['tokens']:.0f}"),
            ("routed experts", f"{s['routed']:.0f}"),
            ("hits / misses", f"{s['hits']:.0f} / {s['misses']:.0f}"),
            ("hit rate", f"{s['hit_rate']:.3f}"),
            ("misses per decode step", f"{s['misses_per_token']:.2f}"),
            ("prefetch copies (used)", f"{s['prefetches']:.0f} ({s['prefetch_used']:.0f})"),
            (
                "substituted (rate)",
                f"{s['substituted']:.0f} ({s['substitution_rate']:.3f} of routed)",
            ),
            ("routed experts on the CPU", f"{s['cpu_experts']:.0f}"),
            ("bytes copied", f"{s['bytes_copied'] / 2**20:.1f} MiB"),
            ("stall time", f"{s['stall_s'] * 1e3:.1f} ms"),
            (
                "read: pinned / pageable (disk)",
                f"{s['bytes_pinned'] / 2**20:.1f} / {s['bytes_pageable'] / 2**20:.1f} "
                f"({s['bytes_disk'] / 2**20:.1f}) MiB, pageable stall "
                f"{s['stall_pageable_s'] * 1e3:.1f} ms",
            ),
            ("tokens / s", f"{s['tokens_per_s']:.1f}"),
            ("CPU threads", f"{s['threads']:.0f}"),
            ("prefill copies", f"{s['prefill_copies']:.0f} ({s['prefill_bytes'] / 2**20:.1f} MiB)"),
            ("decode graph captures", f"{s['captures']:.0f}"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
