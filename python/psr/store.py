"""ExpertStore: torch-facing wrapper of the C++ store (psr._C.Store).

Every expert of every MoE layer is registered once into (pinned) host memory,
its matrices packed back to back. Each layer has a slab of `num_slots` device
slots; `slab(layer)` is a `[num_slots, expert_numel]` tensor view of it that
kernels read directly. Copies run asynchronously on the store's copy stream;
`acquire` makes the compute side wait only for the slots it is about to read,
`release` marks the end of that read (slots are rewritten only after it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from psr import _C
from psr._backend import _check_backend, current_backend

StoreError = _C.StoreError
CopyError = _C.CopyError


@dataclass(frozen=True)
class LayerSpec:
    """One MoE layer of the store: its experts, slots, and elements per expert."""

    num_experts: int
    num_slots: int
    expert_numel: int


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {raw!r}")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ExpertStore:
    """Host store + device slot slab + async copy engine for offloaded experts.

    Args:
        layers: one LayerSpec per MoE layer.
        dtype: storage dtype of the expert weights.
        backend: 'cpu' or 'cuda'; default: psr's current backend.
        device: CUDA device index (cuda backend).
        copy_delay_us, seed: CPU backend fault injection: each copy sleeps a
            seeded random 0..copy_delay_us microseconds. Default from
            $PSR_COPY_DELAY_US and $PSR_COPY_DELAY_SEED.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec | tuple[int, int, int]],
        dtype: torch.dtype = torch.bfloat16,
        *,
        backend: str | None = None,
        device: int | None = None,
        copy_delay_us: int | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        backend = current_backend() if backend is None else backend
        _check_backend(backend, where="ExpertStore")
        if copy_delay_us is None:
            copy_delay_us = _env_int("PSR_COPY_DELAY_US", 0) if backend == "cpu" else 0
        if seed is None:
            seed = _env_int("PSR_COPY_DELAY_SEED", 0)
        if copy_delay_us < 0 or seed < 0:
            raise ValueError("copy_delay_us and seed must be non-negative")
        if device is None:
            device = torch.cuda.current_device() if backend == "cuda" else 0
        self.layers = [s if isinstance(s, LayerSpec) else LayerSpec(*s) for s in layers]
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._store = _C.Store(
            [(s.num_experts, s.num_slots, s.expert_numel * itemsize) for s in self.layers],
            _dtype_name(dtype),
            itemsize,
            backend,
            device,
            copy_delay_us,
            seed,
        )
        self.backend = backend
        self.device = torch.device("cuda", device) if backend == "cuda" else torch.device("cpu")
        self._slabs = [self._view(self._store.slab_dlpack(i)) for i in range(len(self.layers))]
        self._hosts = [self._view(self._store.host_dlpack(i)) for i in range(len(self.layers))]

    def _view(self, capsule: object) -> torch.Tensor:
        return torch.from_dlpack(capsule).view(self.dtype)

    # --- memory -------------------------------------------------------------
    def slab(self, layer: int) -> torch.Tensor:
        """`[num_slots, expert_numel]` view of layer's device slots (no copy)."""
        return self._slabs[self._layer(layer)]

    def host(self, layer: int) -> torch.Tensor:
        """`[num_experts, expert_numel]` view of layer's host copies (read-only by contract)."""
        return self._hosts[self._layer(layer)]

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        return layer

    def register(
        self, layer: int, expert: int, parts: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:
        """Copy one expert's matrices, packed in the given order, into host memory."""
        if isinstance(parts, torch.Tensor):
            parts = [parts]
        ptrs = []
        for i, t in enumerate(parts):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"register: part {i} is {type(t).__name__}, not a tensor")
            if t.device.type != "cpu":
                raise ValueError(
                    f"register: part {i} is on {t.device}; expert weights load from CPU"
                )
            if t.dtype != self.dtype:
                raise TypeError(
                    f"register layer {layer} expert {expert}: part {i} has dtype {t.dtype}, "
                    f"store holds {self.dtype}"
                )
            if not t.is_contiguous():
                t = t.contiguous()
            ptrs.append((t.data_ptr(), t.numel() * t.element_size(), t))
        self._store.register_expert(layer, expert, _dtype_name(self.dtype), [p[:2] for p in ptrs])

    def is_registered(self, layer: int, expert: int) -> bool:
        return self._store.is_registered(layer, expert)

    # --- copies -------------------------------------------------------------
    def load(self, layer: int, slots: Sequence[int], experts: Sequence[int]) -> None:
        """Start async copies experts[i] -> slots[i] of `layer` (one batch)."""
        self._store.load(layer, list(slots), list(experts))

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.backend == "cuda" else 0

    def acquire(
        self, layer: int, slots: Sequence[int], experts: Sequence[int] | None = None
    ) -> None:
        """Compute waits for these slots' copies (CopyError if one failed) and holds them."""
        self._store.acquire(layer, list(slots), list(experts or []), self._stream())

    def release(self, layer: int, slots: Sequence[int]) -> None:
        """The compute that read these slots is enqueued; they may be rewritten after it."""
        self._store.release(layer, list(slots), self._stream())

    @contextmanager
    def reading(
        self, layer: int, slots: Sequence[int], experts: Sequence[int] | None = None
    ) -> Iterator[torch.Tensor]:
        """`with store.reading(l, slots) as slab:` acquire, compute, release."""
        self.acquire(layer, slots, experts)
        try:
            yield self.slab(layer)
        finally:
            self.release(layer, slots)

    def slot_experts(self, layer: int) -> list[int]:
        """Expert each slot holds or is loading (-1: empty)."""
        return self._store.slot_experts(layer)

    def readers(self, layer: int) -> list[int]:
        return self._store.readers(layer)

    def ready(self, layer: int) -> list[bool]:
        """Per slot: loaded and its copy already finished (a non-blocking, timing-dependent
        query of physical state; psr's routing never reads it)."""
        return self._store.ready(layer)

    def verify(self, layer: int, slot: int) -> bool:
        """Slot bytes equal its expert's host copy (synchronizes)."""
        return self._store.verify(layer, slot)

    def synchronize(self) -> None:
        self._store.synchronize()

    # --- counters and fault injection ----------------------------------------
    def counters(self) -> dict[str, float]:
        """copies, bytes_copied, failed_copies, waits, stalled_waits, stall_s."""
        return self._store.counters()

    def reset_counters(self) -> None:
        self._store.reset_counters()

    def set_copy_delay(self, max_delay_us: int, seed: int = 0) -> None:
        """CPU backend: seeded random delay per copy."""
        self._store.set_copy_delay(max_delay_us, seed)

    def fail_next_copies(self, n: int = 1) -> None:
        """CPU backend: the next n copies fail; CopyError surfaces at acquire."""
        self._store.fail_next_copies(n)

    @property
    def expert_bytes(self) -> list[int]:
        return [self._store.spec(i)[2] for i in range(len(self.layers))]
