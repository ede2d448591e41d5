"""psr: Prefetch-Steered Routing for offloaded Mixture-of-Experts decoding."""

from psr._backend import backend_info, current_backend, set_backend
from psr.cache import LogicalCache, prefill_state
from psr.checkpoint import CheckpointError
from psr.demo import DEFAULT_MODEL
from psr.model import OffloadedModel, load, offload
from psr.policy import POLICIES, Policy, make_policy
from psr.store import CopyError, ExpertStore, LayerSpec, StoreError

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "POLICIES",
    "CheckpointError",
    "CopyError",
    "ExpertStore",
    "LayerSpec",
    "LogicalCache",
    "OffloadedModel",
    "Policy",
    "StoreError",
    "backend_info",
    "current_backend",
    "load",
    "make_policy",
    "offload",
    "prefill_state",
    "set_backend",
]
