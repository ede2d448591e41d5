"""psr: Prefetch-Steered Routing for offloaded Mixture-of-Experts decoding."""

from psr._backend import backend_info, current_backend, set_backend
from psr.store import CopyError, ExpertStore, LayerSpec, StoreError

__version__ = "0.1.0"

__all__ = [
    "CopyError",
    "ExpertStore",
    "LayerSpec",
    "StoreError",
    "backend_info",
    "current_backend",
    "set_backend",
]
