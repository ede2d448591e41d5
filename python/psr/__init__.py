"""psr: Prefetch-Steered Routing for offloaded Mixture-of-Experts decoding.

Exports load lazily: `import psr` imports nothing heavy (no torch, transformers,
evaluation or CLI code) until a name is used, e.g. `psr.load(...)`.

Layers, each importing only those below it:
  psr_kernels            Triton kernels + torch references (torch, triton only)
  psr.store              the only door to the C++ extension (expert store, backends)
  psr.cache, psr.policy  pure bookkeeping: the logical cache; policies and their defaults;
  psr.points, psr.vocab  operating points (files of tuned lam / n); the shared option words
  psr.runtime            the offloaded MoE engine, OffloadedModel, generation, stats, traces
  psr.models             family-specific: checkpoints, load / offload, the embedded model
  psr.eval               latency model, quality harness, demo / eval / sweep, lm-eval, benches
  psr.serve              the OpenAI-compatible server (`psr serve`)
  psr.cli                the command line
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_EXPORTS = {
    "psr.cache": ("LogicalCache", "prefill_state"),
    "psr.load_config": ("LoadConfig",),
    "psr.policy": (
        "DEFAULT_LAM",
        "DEFAULT_N",
        "POLICIES",
        "Policy",
        "make_policy",
        "parse_policies",
        "parse_policy",
    ),
    "psr.store": (
        "CopyError",
        "ExpertStore",
        "LayerSpec",
        "StoreError",
        "backend_info",
        "current_backend",
        "set_backend",
    ),
    "psr.runtime": ("MoESpec", "OffloadedModel", "PromptCache", "Stats", "Trace"),
    "psr.models": (
        "DEFAULT_MODEL",
        "CheckpointError",
        "Inspection",
        "inspect",
        "load",
        "offload",
        "restore",
    ),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = [
    "DEFAULT_LAM",
    "DEFAULT_MODEL",
    "DEFAULT_N",
    "POLICIES",
    "CheckpointError",
    "CopyError",
    "ExpertStore",
    "Inspection",
    "LayerSpec",
    "LoadConfig",
    "LogicalCache",
    "MoESpec",
    "OffloadedModel",
    "Policy",
    "PromptCache",
    "Stats",
    "StoreError",
    "Trace",
    "backend_info",
    "current_backend",
    "inspect",
    "load",
    "make_policy",
    "offload",
    "parse_policies",
    "parse_policy",
    "prefill_state",
    "restore",
    "set_backend",
]

if TYPE_CHECKING:
    from psr.cache import LogicalCache, prefill_state
    from psr.load_config import LoadConfig
    from psr.models import DEFAULT_MODEL, CheckpointError, load, offload, restore
    from psr.policy import (
        DEFAULT_LAM,
        DEFAULT_N,
        POLICIES,
        Policy,
        make_policy,
        parse_policies,
        parse_policy,
    )
    from psr.runtime import MoESpec, OffloadedModel, PromptCache, Stats, Trace
    from psr.store import (
        CopyError,
        ExpertStore,
        LayerSpec,
        StoreError,
        backend_info,
        current_backend,
        set_backend,
    )


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'psr' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
