"""psr.store: the one door to the C++ extension `psr._C` (the only package that imports it).

expert_store  ExpertStore (host rows, device slabs, copies, tiers, the CPU hand-off),
              LayerSpec, CopyReason, the backend choice, StoreError / CopyError
cpu_kernels   the CPU kernels: cpu_expert_ffn, cpu_linear (LinearPlan), cpu_rms_norm,
              cpu_attention, cpu_rope_attention, cpu_layout, cpu_isas, cpu_triad, the
              GGML rows' dot path (CPU_DOTS, set_cpu_dot)
cpu_router    the CPU decode step's logical-cache `use` in one call: cpu_cache_use
"""

from psr.store.cpu_kernels import (
    CPU_ACTIVATIONS,
    CPU_FLOAT_DTYPES,
    cpu_attention,
    cpu_dot,
    cpu_expert_ffn,
    cpu_isas,
    cpu_layout,
    cpu_linear,
    cpu_max_threads,
    cpu_rms_norm,
    cpu_rope_attention,
    cpu_triad,
    set_cpu_dot,
)
from psr.store.expert_store import (
    MAX_COPY_RETRIES,
    CopyError,
    CopyReason,
    ExpertStore,
    LayerSpec,
    Segment,
    StoreError,
    backend_info,
    cuda_available,
    current_backend,
    set_backend,
)
from psr.vocab import CPU_DOTS

__all__ = [
    "CPU_ACTIVATIONS",
    "CPU_DOTS",
    "CPU_FLOAT_DTYPES",
    "MAX_COPY_RETRIES",
    "CopyError",
    "CopyReason",
    "ExpertStore",
    "LayerSpec",
    "Segment",
    "StoreError",
    "backend_info",
    "cpu_attention",
    "cpu_dot",
    "cpu_expert_ffn",
    "cpu_isas",
    "cpu_layout",
    "cpu_linear",
    "cpu_max_threads",
    "cpu_rms_norm",
    "cpu_rope_attention",
    "cpu_triad",
    "cuda_available",
    "current_backend",
    "set_backend",
    "set_cpu_dot",
]
