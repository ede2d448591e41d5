"""The offloaded MoE engine and generation (family-agnostic).

`engine` routes over the logical caches and mirrors them in the store; `prefill`
stages prompt experts through the slab; `modules` are the drop-in router / experts
modules; `model` is the public OffloadedModel; `generate` its decoding loop; `stats`
and `trace` record what happened. Imports only psr.cache, psr.policy, psr.store and
psr_kernels (never psr.models, psr.eval or the CLI).
"""

from psr.runtime.engine import MoELayer, OffloadRuntime
from psr.runtime.model import OffloadedModel
from psr.runtime.modules import OffloadedExperts, PSRRouter
from psr.runtime.spec import MoESpec, resolve_capacity
from psr.runtime.stats import COUNT_KEYS, REPORT_KEYS, TIMING_KEYS, Stats
from psr.runtime.trace import Trace, TraceRecorder

__all__ = [
    "COUNT_KEYS",
    "REPORT_KEYS",
    "TIMING_KEYS",
    "MoELayer",
    "MoESpec",
    "OffloadRuntime",
    "OffloadedExperts",
    "OffloadedModel",
    "PSRRouter",
    "Stats",
    "Trace",
    "TraceRecorder",
    "resolve_capacity",
]
