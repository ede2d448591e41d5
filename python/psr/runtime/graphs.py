"""The whole decode token as one graph: a static KV cache and the decode forward captured
once, replayed per token.

The device decode step (device_decode.py) leaves nothing for the host to do inside a
decode forward: no reads, copies chosen on the device, the side stream forked and joined
with events. So the forward can be captured:
  CUDA  a `torch.cuda.CUDAGraph` of the eager decode forward (transformers' layers, psr's
        MoE steps with their gathers and side-stream prefetches, the logits), replayed
        per token after its inputs (token id, cache position) are copied into place;
  CPU   `torch.compile(fullgraph=True)` of the same forward (inductor): the same
        property, proved where CI runs: it compiles only if nothing in the forward needs
        the host.
The first decode token of a sequence runs eagerly (it hands the caches over to the device
step and warms up the kernels); every later one replays. A capture is kept per static
cache length (`bucket`; the MAX_GRAPHS most recently used lengths) and model state; a new
length, or a reconfigured runtime, captures again (`captures` counts them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from psr.runtime.kv import cache_kwarg

if TYPE_CHECKING:
    from psr.runtime.engine import OffloadRuntime

MIN_BUCKET = 64  # static caches come in powers of two from here (fewer captures)
# Static caches (and captures) kept per model, one per length, least recently used dropped:
# requests of mixed lengths (a server's) capture once per length, not once per switch.
# Each holds a KV cache of its length; together at most ~2x the longest one's.
MAX_GRAPHS = 4
SPECULATIVE = "speculative verify blocks (host-driven step)"


def bucket(length: int, limit: int | None) -> int:
    """The static cache length for a sequence of `length` tokens: the next power of two
    (at least MIN_BUCKET), capped at the model's context `limit`."""
    n = MIN_BUCKET
    while n < length:
        n *= 2
    return n if limit is None else max(length, min(n, limit))


def graphs_unavailable(runtime: OffloadRuntime) -> str | None:
    """Why a decode token cannot be one graph with this runtime now (None: it can)."""
    reasons = [*runtime.host_step_reasons(), (runtime.verify is not None, SPECULATIVE)]
    why = next((why for bad, why in reasons if bad), None)
    return why or runtime.placement.graphs_blocker(runtime.device_step)


class DecodeGraph:
    """A static KV cache of `max_len` tokens and the captured decode forward over it."""

    def __init__(self, hf: nn.Module, runtime: OffloadRuntime, max_len: int) -> None:
        from transformers import StaticCache

        fmt = getattr(hf, "psr_kv_format", "auto")  # runtime/kv_quant.py
        if fmt != "auto":
            raise ValueError(f"kv_format={fmt!r} has no static cache layer; graphs need 'auto'")
        self.hf = hf
        self.rt = runtime
        self.max_len = max_len
        self.device = next(hf.parameters()).device
        config: Any = hf.config
        self.cache = StaticCache(config=config, max_cache_len=max_len)
        self._kv_name = cache_kwarg(hf)
        self._forward = type(hf).forward  # the model's own, without psr's boundary wrapper
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self._replay: Callable[[], torch.Tensor] | None = None
        self._owner: Any = None  # the device step the capture was made against
        self.captures = 0

    # --- the forward boundary ----------------------------------------------------------
    def _run(self, fn: Callable[[], torch.Tensor], begins: bool, tokens: int) -> torch.Tensor:
        """One forward under the runtime's boundary (sequence guard, step choice, counts)."""
        rt = self.rt
        rt.enter_forward(self.cache, new=begins)
        t0 = time.perf_counter()
        out = fn()
        rt.exit_forward(None, time.perf_counter() - t0, tokens)
        return out

    def _eager(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self._forward(
            self.hf,
            input_ids=ids,
            cache_position=positions,
            use_cache=True,
            **{self._kv_name: self.cache},
        )
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def prefill(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """A prefill chunk `ids [1, n]` at positions start.., run eagerly: `start` 0 begins a
        new sequence (the static cache cleared), a later chunk continues it. Returns the
        last position's logits `[1, V]`."""
        n = ids.shape[1]
        if start + n > self.max_len:
            raise ValueError(f"prompt of {start + n} tokens exceeds the static cache")
        if start == 0:
            self.cache.reset()
        positions = torch.arange(start, start + n, device=self.device)
        return self._run(lambda: self._eager(ids, positions), start == 0, n)

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """One decode token (`token` `[1, 1]` on the device) at `position`: eager for the
        sequence's first, a replay of the captured forward after. Returns logits `[1, V]`
        (valid until the next step)."""
        if position >= self.max_len:
            raise ValueError(f"position {position} is past the static cache of {self.max_len}")
        first = not self.rt.device_live
        self.tok.copy_(token.view(1, 1))
        self.pos.fill_(position)
        if first or self._replay is None or self._owner is not self.rt.device_step:
            if first:  # hands the caches over, warms the kernels up
                return self._run(lambda: self._eager(self.tok, self.pos), False, 1)
            self._capture()
        replay = self._replay
        assert replay is not None
        return self._run(replay, False, 1)

    # --- capture -----------------------------------------------------------------------
    def _capture(self) -> None:
        """Capture the decode forward over the static buffers (module docstring)."""
        self.captures += 1
        self._owner = self.rt.device_step
        if self.device.type == "cuda":
            self._replay = self._cuda_graph()
        else:
            compiled = torch.compile(
                lambda: self._eager(self.tok, self.pos), fullgraph=True, dynamic=False
            )
            self._replay = compiled

    def _cuda_graph(self) -> Callable[[], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # Every copy issued before the capture finished: the store's joins inside it wait
        # only on the capture's own side gathers (a wait on earlier work would invalidate it).
        self.rt.store.synchronize()
        # Capturing runs psr's Python once (its per-token host work is in the runtime's
        # boundary, outside the graph) and launches nothing: the caches do not move.
        with torch.cuda.graph(graph):
            out = self._eager(self.tok, self.pos)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
