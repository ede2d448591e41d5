"""ExpertStore: torch-facing wrapper of the C++ store (psr._C.Store), and the backend choice.

One of the two modules of `psr.store`, the package that touches the extension `psr._C`.

Every expert of every MoE layer is registered once into (pinned) host memory,
its matrices packed back to back. Each layer has a slab of `num_slots` device
slots; `slab(layer)` is a `[num_slots, expert_numel]` tensor view of it that
kernels read directly. Copies run asynchronously on the store's copy stream
(`enqueue_copies`); `acquire` makes the compute side wait only for the slots it
is about to read, `release` marks the end of that read (slots are rewritten
only after it).

Lifetime. `close()` (idempotent; also `with ExpertStore(...) as store:`)
finishes the queued copies, joins the CPU backend's copy thread (CUDA: destroys
its stream and events) and drops the store's host and device memory. After it
every method, and `expert_bytes`, raises `StoreError` ("the store is closed");
the plain attributes (`layers`, `dtype`, `backend`, `device`, `copy_retries`)
stay readable. Views already handed out by `slab()`/`host()` stay valid: each
holds a reference to its own buffer, so a buffer is freed when the store is
closed *and* its last view is gone (close never waits for views, never
invalidates them). The wrapper holds no reference cycle: dropping the last
reference to a store closes it at once, without the garbage collector; a
`weakref.finalize` closes it too, at the latest at interpreter exit.

Failures and retries. A copy that fails is found by `acquire`, which re-issues
it (same slot, same expert) up to `copy_retries` times (default 2, or
$PSR_COPY_RETRIES) before raising `CopyError`. The acquire is all or nothing:
on error no slot is held, and a slot whose copy failed for good is left empty
and can be loaded again.

Counters (`counters()`): every copy put on the copy stream counts once in
`copies` and its bytes in `bytes_copied`, *retries included*; `retried_copies`
counts the re-issues (a subset of `copies`); `failed_copies` counts every copy
that reported an error, whether it was retried or not. So
`failed_copies - retried_copies` is the number of copies given up on (raised as
CopyError). `waits` counts slots waited for, again after each retry; `stall_s`
includes the time spent waiting for retries.

Tiers. A layer may hold only `LayerSpec.num_held` rows in host memory; its other experts
are pageable (`register_pageable`: segments of checkpoint files, read with pread when a
copy or a gather needs them; CUDA: through a pinned staging ring). `tiers()` says which;
`host()` of such a layer is a fresh copy, `row()` reads one expert; a read error is a
CopyError naming the file and tensor (docs/design.md, "Memory tiers").

Threads. All methods may be called from several threads; the C++ store locks
its bookkeeping and releases the GIL while it waits. Concurrent calls on the
same slots are the caller's business: an acquire whose slot another thread
re-targets while it waits raises StoreError.
"""

from __future__ import annotations

import enum
import operator
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, SupportsIndex, TypeGuard

import torch
from torch.utils.dlpack import from_dlpack

import psr._C as _C
from psr.store.cpu_kernels import _INDEX_DTYPES, CPU_ACTIVATIONS, CPU_FLOAT_DTYPES

StoreError = _C.StoreError
CopyError = _C.CopyError

MAX_COPY_RETRIES: int = int(_C.max_copy_retries)
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_I64 = 1 << 63


class CopyReason(enum.StrEnum):
    """Why a copy is enqueued (`enqueue_copies(..., reason=)`): the caller says so, and
    the measurement probes (psr.eval.probe) count copies by it, never by who called."""

    MISS = "miss"  # a routed expert the slab did not hold (decode)
    PREFETCH = "prefetch"  # a predicted expert for a later layer (decode)
    PREFILL = "prefill"  # prefill staging its experts and seeding the cache
    DIRECT = "direct"  # asked for outside the runtime's bookkeeping (benchmarks, tools)


# The calls `ExpertStore.stub_native_calls` turns into no-ops on the native side: the
# copy engine's and the CPU hand-off's, which the latency model prices as store calls.
STUBBABLE_CALLS = frozenset(
    {"enqueue_copies", "acquire", "release", "gather", "join", "cpu_experts", "cpu_join"}
)


class _NativeStub:
    """What `ExpertStore._live` hands a stubbed call: every method does nothing."""

    def __getattr__(self, name: str) -> Any:
        return _do_nothing


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    return None


_NATIVE_STUB = _NativeStub()


# --- backends ----------------------------------------------------------------

_BACKENDS = ("cpu", "cuda")
_forced: str | None = None


def cuda_available() -> bool:
    """A CUDA device usable by both the extension and torch."""
    if not _C.cuda_compiled() or _C.cuda_device_count() == 0:
        return False
    return torch.cuda.is_available()


def set_backend(name: str | None) -> None:
    """Force the store backend ('cpu' or 'cuda'); None restores automatic choice."""
    global _forced
    if name is not None:
        _check_backend(name, where="set_backend")
    _forced = name


def _check_backend(name: str, where: str) -> None:
    if name not in _BACKENDS:
        raise ValueError(f"{where}: unknown backend {name!r}; expected one of {_BACKENDS}")
    if name == "cuda" and not _C.cuda_compiled():
        raise RuntimeError(
            f"{where}: the CUDA backend was not built into psr._C "
            "(reinstall with nvcc on PATH, or PSR_CUDA=1 to make that an error)"
        )
    if name == "cuda" and not cuda_available():
        raise RuntimeError(f"{where}: the CUDA backend is built but no CUDA device is available")


def current_backend() -> str:
    """The backend new stores use: set_backend(), else $PSR_BACKEND, else cuda if usable."""
    if _forced is not None:
        return _forced
    env = os.environ.get("PSR_BACKEND", "").strip().lower()
    if env:
        _check_backend(env, where="PSR_BACKEND")
        return env
    return "cuda" if cuda_available() else "cpu"


def backend_info() -> dict[str, Any]:
    """Build and run-time facts: cuda_compiled, cuda_available, backend, ..."""
    return {
        "cuda_compiled": bool(_C.cuda_compiled()),
        "cuda_available": cuda_available(),
        "cuda_device_count": int(_C.cuda_device_count()),
        "cuda_runtime_version": int(_C.cuda_runtime_version()),
        "cuda_archs": [a for a in str(_C.cuda_archs).split(",") if a],
        "backend": current_backend(),
        "extension": _C.__file__,
    }


# --- argument checks ---------------------------------------------------------


def _has_index(value: object) -> TypeGuard[SupportsIndex]:
    """Its type defines __index__ (where operator.index looks), and it is no bool."""
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _int_arg(name: str, value: object, lo: int, hi: int) -> int:
    """An int in [lo, hi]: TypeError for bools, floats and non-integers, ValueError outside."""
    if not _has_index(value):
        raise TypeError(
            f"{name} must be an int in [{lo}, {hi}], got {type(value).__name__} {value!r}"
        )
    index = operator.index(value)
    if not lo <= index <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {index}")
    return index


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    """$name as an int in [lo, hi] (ValueError naming the variable and the range), else default."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise ValueError(f"${name} must be an integer in [{lo}, {hi}], got {raw!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"${name} must be an integer in [{lo}, {hi}], got {raw!r}")
    return value


def _index(method: str, name: str, value: object) -> int:
    """One int index (a layer, slot or expert id); bools, floats and strings are a TypeError."""
    if type(value) is not int:
        if not _has_index(value):
            raise TypeError(
                f"{method}: {name} must be an int, got {type(value).__name__} {value!r}"
            )
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(
                f"{method}: {name} must be an int, got {type(value).__name__} {value!r}"
            ) from None
    if not -_I64 <= value < _I64:
        raise IndexError(f"{method}: {name} {value} out of range")
    return value


def _indices(method: str, name: str, values: object) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(
            f"{method}: {name} must be a sequence of ints, got {type(values).__name__} {values!r}"
        )
    return [_index(method, f"{name}[{i}]", v) for i, v in enumerate(values)]


# --- the store ---------------------------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    """One MoE layer of the store: its experts, slots, and elements per expert; `num_held`
    rows kept in host memory (None: all), the other experts pageable (`register_pageable`)."""

    num_experts: int
    num_slots: int
    expert_numel: int
    num_held: int | None = None


# A pageable row's segment: (file path, byte offset, bytes, tensor name); path "" means
# `bytes` zeros (padding between a GGUF row's parts).
Segment = tuple[str, int, int, str]


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
            seeded random 0..copy_delay_us microseconds (copy_delay_us in
            [0, 2**32-1], seed in [0, 2**64-1]). Default from
            $PSR_COPY_DELAY_US and $PSR_COPY_DELAY_SEED.
        copy_retries: how many times acquire re-issues a failed copy before
            raising CopyError, in [0, MAX_COPY_RETRIES]. Default from
            $PSR_COPY_RETRIES, else 2.

    Integer arguments that are bools, floats or other non-integers raise
    TypeError; integers out of range (and bad environment values) raise
    ValueError naming the argument (variable) and the accepted range. See the
    module docstring for close(), views, retries, counters and threads.
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
        copy_retries: int | None = None,
    ) -> None:
        self._store: _C.Store | None = None  # set last: a failed __init__ leaves nothing to close
        self._stubbed = False  # stub_native_calls
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        backend = current_backend() if backend is None else backend
        _check_backend(backend, where="ExpertStore")
        env_delay = _env_int("PSR_COPY_DELAY_US", 0, 0, _U32)
        if copy_delay_us is None:
            copy_delay_us = env_delay if backend == "cpu" else 0
        copy_delay_us = _int_arg("copy_delay_us", copy_delay_us, 0, _U32)
        if seed is None:
            seed = _env_int("PSR_COPY_DELAY_SEED", 0, 0, _U64)
        seed = _int_arg("seed", seed, 0, _U64)
        if copy_retries is None:
            copy_retries = _env_int("PSR_COPY_RETRIES", 2, 0, MAX_COPY_RETRIES)
        self.copy_retries = _int_arg("copy_retries", copy_retries, 0, MAX_COPY_RETRIES)
        if device is None:
            device = torch.cuda.current_device() if backend == "cuda" else 0
        self.layers = [s if isinstance(s, LayerSpec) else LayerSpec(*s) for s in layers]
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        store = _C.Store(
            [(s.num_experts, s.num_slots, s.expert_numel * itemsize) for s in self.layers],
            _dtype_name(dtype),
            itemsize,
            backend,
            device,
            copy_delay_us,
            seed,
            self.copy_retries,
            [-1 if s.num_held is None else s.num_held for s in self.layers],
        )
        # The finalizer holds the native store, never self: no cycle, and the
        # store closes when the wrapper's last reference goes (or at exit).
        self._finalizer = weakref.finalize(self, _C.Store.close, store)
        self.backend = backend
        self.device = torch.device("cuda", device) if backend == "cuda" else torch.device("cpu")
        n = len(self.layers)
        self._slabs: list[torch.Tensor] | None = [
            self._view(store.slab_dlpack(i)) for i in range(n)
        ]
        self._hosts: list[torch.Tensor] | None = [
            self._view(store.host_dlpack(i)) for i in range(n)
        ]
        self._store = store

    def _view(self, capsule: object) -> torch.Tensor:
        return from_dlpack(capsule).view(self.dtype)

    # --- lifetime -------------------------------------------------------------
    def close(self) -> None:
        """Finish queued copies, stop the copy engine, free the store's memory. Idempotent.

        Views from slab()/host() stay valid (each keeps its buffer alive until it is
        dropped); every other use of the store raises StoreError afterwards."""
        self._store = None
        self._slabs = self._hosts = None
        self._finalizer()  # closes the native store once, then drops it

    @property
    def closed(self) -> bool:
        return self._store is None

    def __enter__(self) -> ExpertStore:
        self._live("__enter__")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._store is None else f"{len(self.layers)} layers"
        return f"<psr.ExpertStore {self.backend} {_dtype_name(self.dtype)} {state}>"

    def _live(self, method: str) -> _C.Store:
        store = self._store
        if store is None:
            raise StoreError(f"ExpertStore.{method}: the store is closed")
        if self._stubbed and method in STUBBABLE_CALLS:
            return _NATIVE_STUB  # type: ignore[return-value]
        return store

    def stub_native_calls(self, on: bool) -> None:
        """While on, the native side of STUBBABLE_CALLS (copies, waits, releases, gathers,
        joins, the CPU experts' hand-off) does nothing; this wrapper's own checks still
        run. For timing a decode step's host Python without the work those calls start
        (psr.eval.host_probe.stubbed_launches): what they would write stays unwritten."""
        self._live("stub_native_calls")
        self._stubbed = bool(on)

    # --- memory -------------------------------------------------------------
    def slab(self, layer: int) -> torch.Tensor:
        """`[num_slots, expert_numel]` view of layer's device slots (no copy)."""
        self._live("slab")
        return self._slabs[self._layer("slab", layer)]  # type: ignore[index]

    def host(self, layer: int) -> torch.Tensor:
        """`[num_experts, expert_numel]` view of layer's host copies (read-only by contract).

        A layer with pageable experts has no such view: this returns a fresh copy of the
        whole layer (held rows copied, pageable rows read from their files; CopyError if a
        read fails), so callers that read whole layers keep working at one layer's memory.
        `row()` reads one expert; `tiers()` says which are held."""
        store = self._live("host")
        i = self._layer("host", layer)
        view = self._hosts[i]  # type: ignore[index]
        spec = self.layers[i]
        if spec.num_held is None or spec.num_held == spec.num_experts:
            return view
        out = torch.empty((spec.num_experts, spec.expert_numel), dtype=self.dtype)
        for e, r in enumerate(store.host_rows(i)):
            if r >= 0:
                out[e] = view[r]
            else:
                store.read_row(i, e, out[e].data_ptr())
        return out

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """Expert `expert`'s row `[expert_numel]`: a view of host memory if it is held,
        else read from its file now (a fresh tensor; CopyError naming the file and tensor
        if the read fails)."""
        store = self._live("row")
        i = self._layer("row", layer)
        e = _index("row", "expert", expert)
        if not 0 <= e < self.layers[i].num_experts:
            raise IndexError(f"expert {e} out of range [0, {self.layers[i].num_experts})")
        r = store.host_rows(i)[e]
        if r >= 0:
            return self._hosts[i][r]  # type: ignore[index]
        out = torch.empty(self.layers[i].expert_numel, dtype=self.dtype)
        store.read_row(i, e, out.data_ptr())
        return out

    def tiers(self, layer: int) -> list[str]:
        """Per expert of `layer`: 'held' (host memory; pinned on CUDA) or 'pageable'
        (read from its checkpoint file when copied)."""
        rows = self._live("tiers").host_rows(self._layer("tiers", layer))
        return ["held" if r >= 0 else "pageable" for r in rows]

    def register_pageable(self, layer: int, expert: int, segments: Sequence[Segment]) -> None:
        """Register an expert as pageable: its row is the segments' file bytes back to back
        (`Segment`: path, offset, bytes, tensor name; path '' for zeros), read with pread
        when a copy needs it (never through a mapping: a truncated file or an I/O error is
        then a CopyError naming the file and tensor, not a SIGBUS). The files are opened
        and mapped (for page-cache queries) now: a file that cannot be is a StoreError."""
        store = self._live("register_pageable")
        segs = []
        for k, sg in enumerate(segments):
            if not (isinstance(sg, tuple) and len(sg) == 4):
                raise TypeError(
                    f"register_pageable: segment {k} must be (path, offset, bytes, name)"
                )
            path, off, n, name = sg
            segs.append(
                (
                    str(path),
                    _int_arg(f"segment {k} offset", off, 0, _I64 - 1),
                    _int_arg(f"segment {k} bytes", n, 0, _I64 - 1),
                    str(name),
                )
            )
        store.register_pageable(
            self._layer("register_pageable", layer),
            _index("register_pageable", "expert", expert),
            segs,
        )

    def _layer(self, method: str, layer: object) -> int:
        layer = _index(method, "layer", layer)
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self.layers)})")
        return layer

    def register(
        self, layer: int, expert: int, parts: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:
        """Copy one expert's matrices, packed in the given order, into host memory."""
        store = self._live("register")
        layer = self._layer("register", layer)
        expert = _index("register", "expert", expert)
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
        store.register_expert(layer, expert, _dtype_name(self.dtype), [p[:2] for p in ptrs])

    def is_registered(self, layer: int, expert: int) -> bool:
        store = self._live("is_registered")
        return store.is_registered(
            self._layer("is_registered", layer), _index("is_registered", "expert", expert)
        )

    # --- copies -------------------------------------------------------------
    def enqueue_copies(
        self,
        layer: int,
        slots: Sequence[int],
        experts: Sequence[int],
        *,
        reason: CopyReason = CopyReason.DIRECT,
    ) -> None:
        """Start async copies experts[i] -> slots[i] of `layer` (one batch, validated whole),
        for `reason` (what the probes count them as; the copies do not depend on it).

        A slot still held by a reader is written once its last reader releases it."""
        if not isinstance(reason, CopyReason):
            raise TypeError(f"enqueue_copies: reason must be a CopyReason, got {reason!r}")
        store = self._live("enqueue_copies")
        store.enqueue_copies(
            self._layer("enqueue_copies", layer),
            _indices("enqueue_copies", "slots", slots),
            _indices("enqueue_copies", "experts", experts),
        )

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.backend == "cuda" else 0

    def acquire(
        self, layer: int, slots: Sequence[int], experts: Sequence[int] | None = None
    ) -> None:
        """Compute waits for these slots' copies and holds them (all or nothing).

        A failed copy is re-issued up to `copy_retries` times, then raised as CopyError
        (that slot is left empty). `experts`, if given, must be what the slots hold."""
        store = self._live("acquire")
        store.acquire(
            self._layer("acquire", layer),
            _indices("acquire", "slots", slots),
            [] if experts is None else _indices("acquire", "experts", experts),
            self._stream(),
        )

    def release(self, layer: int, slots: Sequence[int]) -> None:
        """The compute that read these slots is enqueued; they may be rewritten after it."""
        store = self._live("release")
        store.release(
            self._layer("release", layer), _indices("release", "slots", slots), self._stream()
        )

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

    # --- device-indexed copies (the sync-free decode step) -------------------------
    def gather(self, layer: int, rows: torch.Tensor, count: torch.Tensor, *, side: bool) -> None:
        """Copy host experts into slab slots by a copy list that kernels wrote: for the first
        `count` rows of `rows` (`[R, 3]` int32 (slot, expert, kind); `count` an int32 element,
        both on the store's device), host[expert] -> slab[slot]. Both are read when the copy
        runs, never by the host. `side=False`: in order on the current stream (the compute
        side; CPU: now, in this thread). `side=True`: on the copy stream after everything
        the current stream has enqueued (so after the last reads of the slots it rewrites),
        joined by `join(layer)` (CPU: the copy thread, with the seeded copy delays).
        Rows out of range are skipped on CUDA and raise StoreError on the CPU (a bug in
        the list's writer); a gather is never retried and cannot fail recoverably. These
        copies bypass the slot bookkeeping: `adopt_slots` re-synchronises it."""
        store = self._live("gather")
        for name, t in (("rows", rows), ("count", count)):
            if t.dtype != torch.int32 or t.device != self.device or not t.is_contiguous():
                raise ValueError(
                    f"gather: {name} must be a contiguous int32 tensor on {self.device}, got "
                    f"{t.dtype} on {t.device}"
                )
        if rows.dim() != 2 or rows.shape[1] != 3 or count.numel() != 1:
            raise ValueError(
                f"gather: rows must be [R, 3] and count one element, got {list(rows.shape)} and "
                f"{list(count.shape)}"
            )
        store.gather(
            self._layer("gather", layer),
            rows.data_ptr(),
            count.data_ptr(),
            rows.shape[0],
            side,
            self._stream(),
        )

    def join(self, layer: int) -> None:
        """The current stream waits for `layer`'s side gathers (CPU: blocks until they are
        done; time counted as stall). Raises StoreError for a CPU gather that failed."""
        self._live("join").join(self._layer("join", layer), self._stream())

    # --- the device step's CPU experts (experts_on cpu / hybrid) ------------------------
    def cpu_experts_setup(
        self,
        layer: int,
        layout: Sequence[int],
        *,
        x_dtype: torch.dtype,
        w_dtype: torch.dtype,
        id_dtype: torch.dtype,
        top_k: int,
        threads: int,
        activation: str = "swiglu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        """Prepare `layer`'s CPU experts for `cpu_experts`: `layout` the CPU kernels' layout
        of its host rows (`cpu_layout`; every expert held), the dtypes of x, of the routed
        weights (float32 / bfloat16 / float16) and of the routed ids (int32 / int64), top-k
        and the kernels' threads. Again with other arguments: the old one finishes first."""
        store = self._live("cpu_experts_setup")
        for name, dt in (("x", x_dtype), ("weights", w_dtype)):
            if dt not in CPU_FLOAT_DTYPES:
                raise ValueError(f"cpu_experts_setup: {name} must be float32/bfloat16/float16")
        if id_dtype not in _INDEX_DTYPES:
            raise ValueError("cpu_experts_setup: ids must be int32/int64")
        if activation not in CPU_ACTIVATIONS:
            raise ValueError(f"cpu_experts_setup: activation must be one of {CPU_ACTIVATIONS}")
        store.cpu_experts_setup(
            self._layer("cpu_experts_setup", layer), list(layout), int(threads),
            CPU_ACTIVATIONS.index(activation), float(alpha), float(limit),
            CPU_FLOAT_DTYPES.index(x_dtype), CPU_FLOAT_DTYPES.index(w_dtype),
            4 if id_dtype == torch.int32 else 8, int(top_k),
        )  # fmt: skip

    def cpu_experts(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        cpu_list: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        """The experts of one token that the cache kernel listed for the CPU, without a host
        sync: x `[1, H]`, the routed ids and weights `[1, k]` and the CPU list `[k]` (int32
        expert ids, -1 past its count; all contiguous, on the store's device, dtypes as set
        up) are handed to the host after the work the current stream has enqueued; the CPU
        kernels compute the listed experts from the host rows (routed order, weighted) and
        their sum lands in `y` `[1, H]` float32 on the device. `cpu_join(layer)` makes the
        current stream wait for y; kernels enqueued in between overlap the CPU's work (CUDA:
        a host stream and a host function, captured by CUDA graphs; CPU: now, in this
        thread). An error inside (an id out of range) zeroes y and raises StoreError on the
        layer's next call or `cpu_check`."""
        store = self._live("cpu_experts")
        for name, t in (("x", x), ("ids", ids), ("weights", weights), ("cpu_list", cpu_list)):
            if t.device != self.device or not t.is_contiguous():
                raise ValueError(f"cpu_experts: {name} must be contiguous on {self.device}")
        if y.dtype != torch.float32 or y.device != self.device or not y.is_contiguous():
            raise ValueError(f"cpu_experts: y must be a contiguous float32 tensor on {self.device}")
        if cpu_list.dtype != torch.int32 or y.numel() != x.numel():
            raise ValueError("cpu_experts: cpu_list must be int32 and y as large as x")
        store.cpu_experts(
            self._layer("cpu_experts", layer), x.data_ptr(), ids.data_ptr(), weights.data_ptr(),
            cpu_list.data_ptr(), y.data_ptr(), self._stream(),
        )  # fmt: skip

    def cpu_join(self, layer: int) -> None:
        """The current stream waits for `layer`'s last `cpu_experts` result (CPU: it is
        there already); raises StoreError for an error inside it."""
        self._live("cpu_join").cpu_join(self._layer("cpu_join", layer), self._stream())

    def cpu_check(self) -> None:
        """Raise StoreError for the first CPU-expert error of any layer since the last
        check (on CUDA, a task that ran after its layer's last call)."""
        self._live("cpu_check").cpu_check()

    def adopt_slots(self, layer: int, experts: Sequence[int]) -> None:
        """The slots hold `experts` now (-1: empty), as gathers left them: bookkeeping only,
        no copy, and the copy stream is fenced behind the current stream, so the store's
        own copies into these slots come after the device work that used them."""
        store = self._live("adopt_slots")
        store.adopt_slots(
            self._layer("adopt_slots", layer),
            _indices("adopt_slots", "experts", experts),
            self._stream(),
        )

    def slot_experts(self, layer: int) -> list[int]:
        """Expert each slot holds or is loading (-1: empty)."""
        return self._live("slot_experts").slot_experts(self._layer("slot_experts", layer))

    def readers(self, layer: int) -> list[int]:
        return self._live("readers").readers(self._layer("readers", layer))

    def ready(self, layer: int) -> list[bool]:
        """Per slot: loaded and its copy already finished (a non-blocking, timing-dependent
        query of physical state; psr's routing never reads it)."""
        return self._live("ready").ready(self._layer("ready", layer))

    def verify(self, layer: int, slot: int) -> bool:
        """Slot bytes equal its expert's host copy (synchronizes)."""
        store = self._live("verify")
        return store.verify(self._layer("verify", layer), _index("verify", "slot", slot))

    def synchronize(self) -> None:
        self._live("synchronize").synchronize()

    # --- counters and fault injection ----------------------------------------
    def counters(self) -> dict[str, float]:
        """copies, bytes_copied, retried_copies, failed_copies, waits, stalled_waits, stall_s
        (counting rule in the module docstring: retries count as copies and bytes); per
        tier, copies and device-step gathers alike, counted when read: bytes_pinned,
        bytes_pageable (= bytes_page_cache + bytes_disk, by mincore just before the read),
        read_errors, and stall_pageable_s (of stall_s, waits for pageable rows)."""
        return self._live("counters").counters()

    def reset_counters(self) -> None:
        self._live("reset_counters").reset_counters()

    def set_copy_delay(self, max_delay_us: int, seed: int = 0) -> None:
        """CPU backend: seeded random delay per copy."""
        store = self._live("set_copy_delay")
        store.set_copy_delay(
            _int_arg("max_delay_us", max_delay_us, 0, _U32), _int_arg("seed", seed, 0, _U64)
        )

    def fail_next_copies(self, n: int = 1) -> None:
        """The next n copies fail (both backends); acquire retries them, then raises CopyError."""
        store = self._live("fail_next_copies")
        store.fail_next_copies(_int_arg("n", n, 0, _I64 - 1))

    @property
    def expert_bytes(self) -> list[int]:
        store = self._live("expert_bytes")
        return [store.spec(i)[2] for i in range(len(self.layers))]
