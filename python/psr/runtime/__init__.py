"""The offloaded MoE engine and generation (family-agnostic).

`engine` owns the MoE layers and picks, per forward, one step (`step`): `prefill`
(exact routing, prompt experts staged through the slab), `device_decode` (the sync-free
decode step on device-resident caches), `host_decode` (the host-driven decode step and
speculative verify blocks), `window` (teacher-forced scoring). Beside it: `guard` (one
sequence at a time), `accounting` (stats, traces, store counters), `compute` (expert
FFNs), `steering` (lam and predictions: the seam variants subclass), `bookkeeping` (host
logical caches mirrored by store copies), `layer`, `slots`, `kv`, `chunked` (chunked
prefill, the prompt cache). `modules` are the drop-in router / experts modules; `model`
is the public OffloadedModel; `generate` its decoding loop; `batch` batched decoding
(`BatchDecoder`: per-sequence caches and KV, each row as its solo run); `stats` and `trace` record
what happened. Imports only psr.cache, psr.policy, psr.vocab, psr.store and psr_kernels
(never psr.models, psr.eval or the CLI).

Exports load lazily (PEP 562), as `psr`'s do: importing the package, or its pure-data
modules `trace` and `stats`, imports neither torch nor triton (`spec` needs psr_kernels);
the engine loads when one of its names is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psr.lazy import lazy_exports

_EXPORTS = {
    "psr.runtime.batch": ("BatchDecoder",),
    "psr.runtime.chunked": ("PromptCache",),
    "psr.runtime.engine": ("DECODE_MODES", "OffloadRuntime"),
    "psr.runtime.layer": ("MoELayer",),
    "psr.runtime.steering": ("Steering",),
    "psr.runtime.model": ("OffloadedModel",),
    "psr.runtime.modules": ("OffloadedExperts", "PSRRouter"),
    "psr.runtime.spec": ("MoESpec", "resolve_capacity"),
    "psr.runtime.stats": ("COUNT_KEYS", "REPORT_KEYS", "TIMING_KEYS", "Stats"),
    "psr.runtime.trace": ("Trace", "TraceRecorder"),
}
__all__ = [
    "COUNT_KEYS",
    "DECODE_MODES",
    "REPORT_KEYS",
    "TIMING_KEYS",
    "BatchDecoder",
    "MoELayer",
    "MoESpec",
    "OffloadRuntime",
    "OffloadedExperts",
    "OffloadedModel",
    "PSRRouter",
    "PromptCache",
    "Stats",
    "Steering",
    "Trace",
    "TraceRecorder",
    "resolve_capacity",
]

if TYPE_CHECKING:
    from psr.runtime.batch import BatchDecoder
    from psr.runtime.chunked import PromptCache
    from psr.runtime.engine import DECODE_MODES, OffloadRuntime
    from psr.runtime.layer import MoELayer
    from psr.runtime.model import OffloadedModel
    from psr.runtime.modules import OffloadedExperts, PSRRouter
    from psr.runtime.spec import MoESpec, resolve_capacity
    from psr.runtime.stats import COUNT_KEYS, REPORT_KEYS, TIMING_KEYS, Stats
    from psr.runtime.steering import Steering
    from psr.runtime.trace import Trace, TraceRecorder


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
