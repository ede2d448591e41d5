"""Types of the C++ extension psr._C (csrc/bindings.cpp), for mypy; psr.store is its only user.

Keep in step with the bindings: `.ci/run` checks this stub against the built module
(`python -m mypy.stubtest psr._C`). Streams and copy-list pointers are raw addresses (int).
"""

from collections.abc import Sequence
from typing import type_check_only

class StoreError(RuntimeError): ...
class CopyError(StoreError): ...

max_copy_retries: int
cuda_archs: str  # comma-separated CUDA architectures built, "" without CUDA

def cuda_compiled() -> bool: ...
def cuda_device_count() -> int: ...
def cuda_runtime_version() -> int: ...

# CPU expert kernels (csrc/cpu/expert_gemv.h); psr.store.cpu_expert_ffn checks the tensors.
def cpu_isas() -> list[str]: ...
def cpu_max_threads() -> int: ...
def cpu_layout_fields() -> list[str]: ...
def cpu_formats() -> list[tuple[str, int]]: ...
def ggml_type_traits() -> list[tuple[str, int, int, int, int]]: ...
def cpu_quantize_act(act: int, x: int, n: int, out: int, isa: str) -> None: ...
def cpu_has_vnni() -> bool: ...
def set_cpu_dot(dot: str) -> None: ...
def cpu_expert_ffn(
    layout: Sequence[int],
    x: int,
    tokens: int,
    rows: int,
    num_rows: int,
    row_stride: int,
    ids: int,
    id_bytes: int,
    k: int,
    table: int,
    table_bytes: int,
    table_len: int,
    weights: int,
    y: int,
    threads: int,
    isa: str,
    act: int,
    alpha: float,
    limit: float,
    skip_absent: bool = False,
    dot: str = "f32",
) -> None: ...
def cpu_linear(
    x: int,
    tokens: int,
    in_features: int,
    weight: int,
    out_features: int,
    row_stride: int,
    fmt: int,
    ggml_type: int,
    bias: int,
    y: int,
    threads: int,
    isa: str,
    dot: str = "f32",
) -> None: ...
def cpu_tile_q4k(src: int, row_stride: int, rows: int, k: int, dst: int) -> None: ...
def cpu_triad(n: int, threads: int, reps: int) -> float: ...
def cpu_cache_use(
    row: int,
    offsets: int,
    n_offsets: int,
    ids: int,
    k: int,
    capped: bool,
    logits: int,
    n_logits: int,
) -> None: ...
def cpu_cache_prefetch(row: int, offsets: int, n_offsets: int, pred: int, n: int) -> None: ...
def cpu_rms_norm(
    x: int,
    rows: int,
    n: int,
    x_stride: int,
    weight: int,
    eps: float,
    y: int,
    y_stride: int,
) -> None: ...
def cpu_attention(
    q: int,
    tokens: int,
    q_heads: int,
    dk: int,
    k: int,
    k_fmt: int,
    k_sl: int,
    k_sh: int,
    v: int,
    v_fmt: int,
    v_sl: int,
    v_sh: int,
    dv: int,
    keys: int,
    kv_heads: int,
    q_start: int,
    window: int,
    scale: float,
    sinks: int,
    y: int,
    threads: int,
    isa: str,
) -> None: ...
def cpu_rope_attention(
    fmt: int,
    q_in: int,
    k_in: int,
    v_in: int,
    cos: int,
    sin: int,
    q: int,
    tokens: int,
    q_heads: int,
    dk: int,
    k: int,
    k_sl: int,
    k_sh: int,
    v: int,
    v_sl: int,
    v_sh: int,
    dv: int,
    kv_heads: int,
    q_start: int,
    window: int,
    scale: float,
    sinks: int,
    y: int,
    threads: int,
    isa: str,
) -> None: ...

@type_check_only
class _pybind11_type(type):
    """pybind11's metaclass of bound classes (pybind11_builtins.pybind11_type)."""

class Store(metaclass=_pybind11_type):
    def __init__(
        self,
        layers: Sequence[tuple[int, int, int]],
        dtype: str,
        itemsize: int,
        backend: str = "cpu",
        device: int = 0,
        copy_delay_us: int = 0,
        seed: int = 0,
        copy_retries: int = 2,
        held: Sequence[int] = ...,
    ) -> None: ...
    @property
    def backend(self) -> str: ...
    @property
    def device_index(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def copy_retries(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def spec(self, layer: int) -> tuple[int, int, int]: ...
    def register_expert(
        self, layer: int, expert: int, dtype: str, parts: Sequence[tuple[int, int]]
    ) -> None: ...
    def is_registered(self, layer: int, expert: int) -> bool: ...
    def register_pageable(
        self, layer: int, expert: int, segments: Sequence[tuple[str, int, int, str]]
    ) -> None: ...
    def host_rows(self, layer: int) -> list[int]: ...
    def read_row(self, layer: int, expert: int, dst: int) -> None: ...
    def enqueue_copies(self, layer: int, slots: Sequence[int], experts: Sequence[int]) -> None: ...
    def acquire(
        self, layer: int, slots: Sequence[int], experts: Sequence[int] = ..., stream: int = 0
    ) -> None: ...
    def release(self, layer: int, slots: Sequence[int], stream: int = 0) -> None: ...
    def gather(
        self, layer: int, rows: int, count: int, max_rows: int, side: bool, stream: int = 0
    ) -> None: ...
    def join(self, layer: int, stream: int = 0) -> None: ...
    def adopt_slots(self, layer: int, experts: Sequence[int], stream: int = 0) -> None: ...
    def cpu_experts_setup(
        self,
        layer: int,
        layout: Sequence[int],
        threads: int,
        act: int,
        alpha: float,
        limit: float,
        x_dtype: int,
        w_dtype: int,
        id_bytes: int,
        top_k: int,
    ) -> None: ...
    def cpu_experts(
        self, layer: int, x: int, ids: int, weights: int, list: int, y: int, stream: int = 0
    ) -> None: ...
    def cpu_join(self, layer: int, stream: int = 0) -> None: ...
    def cpu_check(self) -> None: ...
    def slot_experts(self, layer: int) -> list[int]: ...
    def readers(self, layer: int) -> list[int]: ...
    def ready(self, layer: int) -> list[bool]: ...
    def verify(self, layer: int, slot: int) -> bool: ...
    def synchronize(self) -> None: ...
    def counters(self) -> dict[str, float]: ...
    def reset_counters(self) -> None: ...
    def set_copy_delay(self, max_delay_us: int, seed: int = 0) -> None: ...
    def fail_next_copies(self, n: int) -> None: ...
    def close(self) -> None: ...
    # DLPack capsules ("dltensor", uint8 [rows, bytes]) for torch.from_dlpack.
    def slab_dlpack(self, layer: int) -> object: ...
    def host_dlpack(self, layer: int) -> object: ...
