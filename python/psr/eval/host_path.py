"""What psr's MoE path asks of the host during decode, counted exactly on any machine.

`HostProbe(model)` wraps the runtime's router and experts hooks; inside them it counts, per
decode forward and MoE layer:
  reads     host reads of device data (`item`, `tolist`, `__bool__`, `__int__`,
            `__float__`, `__index__`, `numpy`, `cpu`): each makes the host wait for the
            device queue on a GPU; recorded with the psr source line that made it;
  h2d       tensors built from host data (`torch.tensor`, `torch.as_tensor`), which on a
            GPU copy synchronously from pageable memory;
  kernels   device work launched: aten ops that are not views or allocations
            (a TorchDispatchMode), Triton kernel launches, and the store's gathers.
The same counts hold on a GPU: which calls read, copy or launch does not depend on the
device, only what each costs. `host_ms_per_layer(model, ...)` times the hooks without
the probe (the probe's own modes would inflate it).
"""

from __future__ import annotations

import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = frozenset(
    {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
)
H2D = frozenset({"tensor", "as_tensor"})
_ALLOC = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
_ROOT = Path(__file__).resolve().parents[2]  # python/


@dataclass
class LayerCounts:
    """One MoE layer's share of one decode forward."""

    reads: list[str] = field(default_factory=list)  # each read's psr source line
    h2d: int = 0
    aten: Counter[str] = field(default_factory=Counter)
    triton: Counter[str] = field(default_factory=Counter)
    gathers: int = 0

    @property
    def kernels(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values()) + self.gathers


def _where() -> str:
    """The innermost psr source line of the current call stack (file:line)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if "psr" in path.parts and path.name != "host_path.py":
            try:
                rel = path.relative_to(_ROOT)
            except ValueError:
                rel = path
            return f"{rel}:{frame.lineno}"
    return "?"


class _Reads(TorchFunctionMode):
    def __init__(self, probe: HostProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        cur = None if self.probe.inside_launch else self.probe.current
        if cur is not None and name in READS:
            cur.reads.append(f"{name} @ {_where()}")
        elif cur is not None and name in H2D:
            cur.h2d += 1
        return func(*args, **(kwargs or {}))


class _Kernels(TorchDispatchMode):
    def __init__(self, probe: HostProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        cur = None if self.probe.inside_launch else self.probe.current
        packet = func.overloadpacket.__name__
        if (
            cur is not None
            and not func.is_view
            and packet not in _ALLOC
            and packet != "_local_scalar_dense"  # a read, counted as such
        ):
            cur.aten[packet] += 1
        return func(*args, **(kwargs or {}))


class HostProbe:
    """Count a model's MoE-path host work per decode forward and MoE layer (module
    docstring). Use as a context manager around decoding; `steps` holds, per decode
    forward (layer 0 routing starts one), a list of LayerCounts by MoE layer."""

    def __init__(self, model: Any) -> None:
        self.rt = model.runtime
        self.steps: list[list[LayerCounts]] = []
        self.current: LayerCounts | None = None
        # Inside a Triton launch: the interpreter's own tensor traffic is not psr's work.
        self.inside_launch = False
        self._undo: list[Callable[[], None]] = []

    def _layer(self, index: int) -> LayerCounts:
        if index == 0 or not self.steps:
            self.steps.append([LayerCounts() for _ in self.rt.layers])
        return self.steps[-1][index]

    def _hook(self, name: str) -> None:
        inner = getattr(self.rt, name)

        def hooked(L: Any, *args: Any) -> Any:
            if not self.rt.decoding or self.current is not None:
                return inner(L, *args)
            self.current = self._layer(L.index) if name == "route" else self.steps[-1][L.index]
            try:
                with _Reads(self), _Kernels(self):
                    return inner(L, *args)
            finally:
                self.current = None

        setattr(self.rt, name, hooked)
        self._undo.append(lambda: delattr(self.rt, name))

    def _patch_class(self, cls: Any, attr: str, count: Callable[[Any], None]) -> None:
        orig = getattr(cls, attr)

        def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if self.current is None or self.inside_launch:
                return orig(obj, *args, **kwargs)
            count(obj)
            self.inside_launch = True
            try:
                return orig(obj, *args, **kwargs)
            finally:
                self.inside_launch = False

        setattr(cls, attr, wrapper)
        self._undo.append(lambda: setattr(cls, attr, orig))

    def __enter__(self) -> HostProbe:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        from psr.store import ExpertStore

        def launch(fn: Any) -> None:
            assert self.current is not None
            name = getattr(getattr(fn, "fn", fn), "__name__", "triton")
            self.current.triton[name] += 1

        def gather(_: Any) -> None:
            assert self.current is not None
            self.current.gathers += 1

        self._patch_class(JITFunction, "run", launch)
        self._patch_class(InterpretedFunction, "run", launch)
        self._patch_class(ExpertStore, "gather", gather)
        self._hook("route")
        self._hook("experts")
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    # --- summaries -------------------------------------------------------------------
    def per_token(self) -> dict[str, float]:
        """Means per decode forward: reads, h2d, kernels (and their split)."""
        n = max(len(self.steps), 1)
        cells = [c for step in self.steps for c in step]
        return {
            "tokens": len(self.steps),
            "reads": sum(len(c.reads) for c in cells) / n,
            "h2d": sum(c.h2d for c in cells) / n,
            "kernels": sum(c.kernels for c in cells) / n,
            "aten": sum(sum(c.aten.values()) for c in cells) / n,
            "triton": sum(sum(c.triton.values()) for c in cells) / n,
            "gathers": sum(c.gathers for c in cells) / n,
        }

    def read_sites(self) -> Counter[str]:
        """Every read's kind and psr source line, with how often it happened."""
        return Counter(r for step in self.steps for c in step for r in c.reads)


@contextmanager
def _timed_hooks(rt: Any, sink: list[float]) -> Iterator[None]:
    inner = {name: getattr(rt, name) for name in ("route", "experts")}

    def wrap(name: str) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner[name](*args)
            finally:
                if rt.decoding:
                    sink.append(time.perf_counter() - t)

        return timed

    for name in inner:
        setattr(rt, name, wrap(name))
    try:
        yield
    finally:
        for name in inner:
            delattr(rt, name)


def host_ms_per_layer(model: Any, prompt: torch.Tensor, new_tokens: int) -> float:
    """Host time in psr's hooks per decode token and MoE layer (ms): wall time of the
    router and experts hooks while decoding, without the probe's modes."""
    sink: list[float] = []
    with _timed_hooks(model.runtime, sink):
        model.generate(prompt, max_new_tokens=new_tokens)
    tokens = max(new_tokens - 1, 1)
    return sum(sink) * 1e3 / tokens / len(model.runtime.layers)
