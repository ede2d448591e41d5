"""What psr's decode step asks of the host, counted exactly on any machine.

`HostProbe(model)` is active for everything run inside its `with` block. Per decode
forward it records, in the order the host issues them, three kinds of cells:
  layers    per MoE layer, what psr's router and experts hooks do (the MoE path);
  dense     what the forward does outside those hooks (attention, norms, residual adds,
            embeddings, lm_head, the model's MoE-block glue, psr's forward wrapper);
  token     what ran between the previous forward and this one (the generation loop's
            argmax and cat, and its read of the new token).
Each cell counts, and logs as `HostOp`s (psr.runtime.trace.HOST_OP_KINDS):
  reads     ("sync") host reads of device data (`item`, `tolist`, `__bool__`, `__int__`,
            `__float__`, `__index__`, `numpy`, `cpu`): each makes the host wait for the
            device queue on a GPU; recorded with the place it was made in (`place`:
            the MoE hook, the forward or the loop; never a call stack);
  h2d       tensors built from host data (`torch.tensor`, `torch.as_tensor`), which on a
            GPU copy synchronously from pageable memory;
  launches  device work launched: aten ops that are not views or allocations (a
            TorchDispatchMode), Triton kernel launches;
  store     the expert store's calls: "copy" (enqueue_copies: its CopyReason, "miss" or
            "prefetch" in a decode forward),
            "wait" (acquire), "release", "gather" (its stream "compute" or "side"; a
            launch on CUDA, counted in `kernels`), "join", "cpu" (cpu_experts: the
            CPU list handed to the CPU) and "cpu_join".
The same counts hold on a GPU: which calls read, copy or launch does not depend on the
device, only what each costs. A forward counts as a decode forward when psr's hooks ran
in decode mode in it; the prefill forward and anything outside forwards are dropped.

`HostProbe.schedule()` turns a probe into the `HostSchedule` the latency model replays
(rule in its docstring); `measure_schedule(model, prompt)` decodes under a probe and
returns it. `host_ms_per_layer(model, ...)` times the hooks without the probe (the
probe's own modes would inflate it).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from psr.runtime.trace import HostOp, HostSchedule

READS = frozenset(
    {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
)
H2D = frozenset({"tensor", "as_tensor"})
# Not launches: allocations, the scalar read (counted as a read), and the alias that
# torch.tensor makes of its fresh tensor (counted as h2d).
_NOT_LAUNCHES = frozenset(
    {
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "_local_scalar_dense",
        "lift_fresh",
    }
)
STORE_KINDS = ("copy", "wait", "release", "gather", "join", "cpu", "cpu_join")
# ExpertStore method -> HostOp kind.
_STORE_METHODS = {
    "enqueue_copies": "copy",
    "acquire": "wait",
    "release": "release",
    "gather": "gather",
    "join": "join",
    "cpu_experts": "cpu",
    "cpu_join": "cpu_join",
}


def _replace_forward(hf: Any, forward: Any, undo: list[Any]) -> None:
    """Set `hf.forward` (an instance attribute) and register, in `undo`, putting back
    what the instance had (psr's forward wrapper is an instance attribute, or nothing)."""
    own = hf.__dict__.get("forward")
    hf.forward = forward

    def restore() -> None:
        if own is None:
            del hf.forward
        else:
            hf.forward = own

    undo.append(restore)


@dataclass
class LayerCounts:
    """One cell of one decode forward: a MoE layer's hooks, the dense part or the loop."""

    reads: list[str] = field(default_factory=list)  # each read's kind @ place (HostProbe.place)
    h2d: int = 0
    aten: Counter[str] = field(default_factory=Counter)
    triton: Counter[str] = field(default_factory=Counter)
    gathers: int = 0
    events: list[HostOp] = field(default_factory=list)  # everything above, in issue order

    @property
    def launches(self) -> int:
        """aten ops and Triton kernels (the store's gathers not included)."""
        return sum(self.aten.values()) + sum(self.triton.values())

    @property
    def kernels(self) -> int:
        """Device work launched: aten ops, Triton kernels and the store's gathers."""
        return self.launches + self.gathers

    @property
    def store_calls(self) -> int:
        return sum(e.kind in STORE_KINDS for e in self.events)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


class _Reads(TorchFunctionMode):
    def __init__(self, probe: HostProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        cur = self.probe.current
        if cur is not None and name in READS:
            site = f"{name} @ {self.probe.place}"
            cur.reads.append(site)
            cur.events.append(HostOp("sync", site))
        elif cur is not None and name in H2D:
            cur.h2d += 1
            cur.events.append(HostOp("h2d", f"{name} @ {self.probe.place}"))
        return func(*args, **(kwargs or {}))


class _Kernels(TorchDispatchMode):
    def __init__(self, probe: HostProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        cur = self.probe.current
        packet = func.overloadpacket.__name__
        if cur is not None and not func.is_view and packet not in _NOT_LAUNCHES:
            cur.aten[packet] += 1
            cur.events.append(HostOp("launch", packet))
        return func(*args, **(kwargs or {}))


# Counts a patched call: (the object, the cell it counts in, its args, its kwargs).
_Count = Callable[[Any, LayerCounts, tuple[Any, ...], dict[str, Any]], None]


@dataclass
class _Forward:
    layers: list[LayerCounts]
    dense: LayerCounts
    token: LayerCounts
    decoded: bool = False


def _scs(a: Sequence[HostOp], b: Sequence[HostOp]) -> list[HostOp]:
    """The shortest common supersequence of two op lists (ops equal by kind, what and
    stream), ties resolved toward `a`'s order."""
    m, n = len(a), len(b)
    lcs = [[0] * (n + 1) for _ in range(m + 1)]
    for i in range(m - 1, -1, -1):
        for j in range(n - 1, -1, -1):
            lcs[i][j] = lcs[i + 1][j + 1] + 1 if a[i] == b[j] else max(lcs[i + 1][j], lcs[i][j + 1])
    out: list[HostOp] = []
    i = j = 0
    while i < m and j < n:
        if a[i] == b[j]:
            out.append(a[i])
            i, j = i + 1, j + 1
        elif lcs[i + 1][j] >= lcs[i][j + 1]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + list(a[i:]) + list(b[j:])


def merge_ops(cells: Sequence[Sequence[HostOp]]) -> list[HostOp]:
    """One ordered op list that contains every cell's list as a subsequence (folded
    pairwise shortest common supersequences); the cells' common list when they agree."""
    out: list[HostOp] = []
    for ops in cells:
        out = _scs(out, ops) if out else list(ops)
    return [HostOp(o.kind, o.what, o.stream) for o in out]


def op_rates(merged: Sequence[HostOp], cells: Sequence[Sequence[HostOp]]) -> list[float]:
    """Per op of `merged` (merge_ops of `cells`), the fraction of cells that issued it
    (each cell matched as a subsequence, leftmost)."""
    hits = [0] * len(merged)
    for ops in cells:
        j = 0
        for op in ops:
            while j < len(merged) and merged[j] != op:
                j += 1
            if j == len(merged):
                raise ValueError(f"a cell's op {op} is not in the merged list in its order")
            hits[j] += 1
            j += 1
    return [h / max(len(cells), 1) for h in hits]


class HostProbe:
    """Count a model's host work per decode forward (module docstring). Use as a context
    manager around decoding. Per decode forward, `steps` holds a list of LayerCounts by
    MoE layer, `dense` and `token` one LayerCounts each, `modes` the step that ran
    ("device" or "host")."""

    def __init__(self, model: Any, switch: Callable[[bool], None] | None = None) -> None:
        self.model = model
        self.rt = model.runtime
        # stubbed_launches' switch: on from a decode forward's first MoE hook to its end
        # (the kernels and native store calls counted, not run); None: everything runs.
        self.switch = switch
        self.steps: list[list[LayerCounts]] = []
        self.dense: list[LayerCounts] = []
        self.token: list[LayerCounts] = []
        self.modes: list[str] = []
        # Inside a Triton launch or a store call: their own tensor traffic is not counted.
        self.inside_launch = False
        self._hooked: LayerCounts | None = None
        self._hook_name = ""  # the hook `_hooked` counts for: "route" or "experts"
        self._fwd: _Forward | None = None
        self._between = LayerCounts()  # ops since the last forward ended
        self._undo: list[Callable[[], None]] = []

    @property
    def current(self) -> LayerCounts | None:
        """The cell the op being made counts in (None: not counted)."""
        if self.inside_launch:
            return None
        if self._hooked is not None:
            return self._hooked
        if self._fwd is not None:
            return self._fwd.dense
        return self._between

    @property
    def place(self) -> str:
        """Where the op being made is, as read sites name it: the MoE hook it is in
        ("route" or "experts"), the rest of a forward ("forward") or the loop between
        forwards ("loop"). Named by the hook the probe entered, not by a call stack."""
        if self._hooked is not None:
            return self._hook_name
        return "forward" if self._fwd is not None else "loop"

    # --- patching --------------------------------------------------------------------
    def _hook(self, name: str) -> None:
        rt = self.rt
        inner = getattr(rt, name)

        def hooked(L: Any, *args: Any) -> Any:
            fwd = self._fwd
            if fwd is None or self._hooked is not None or not rt.decoding:
                return inner(L, *args)
            fwd.decoded = True
            if self.switch is not None:
                self.switch(True)
            self._hooked, self._hook_name = fwd.layers[L.index], name
            try:
                out = inner(L, *args)
            finally:
                self._hooked = None
            if self.switch is not None and name == "experts" and isinstance(out, torch.Tensor):
                self.inside_launch = True  # not the step's own op: not counted
                out.zero_()  # the stubbed FFN left it unwritten: finite numbers downstream
                self.inside_launch = False
            return out

        setattr(rt, name, hooked)
        self._undo.append(lambda: delattr(rt, name))

    def _wrap_forward(self) -> None:
        hf = self.model.hf
        inner = hf.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._fwd is not None:
                return inner(*args, **kwargs)
            fwd = _Forward([LayerCounts() for _ in self.rt.layers], LayerCounts(), self._between)
            self._fwd = fwd
            try:
                return inner(*args, **kwargs)
            finally:
                if self.switch is not None:
                    self.switch(False)
                self._fwd = None
                self._between = LayerCounts()
                if fwd.decoded:
                    self.steps.append(fwd.layers)
                    self.dense.append(fwd.dense)
                    self.token.append(fwd.token)
                    self.modes.append(self.rt.step_name)

        _replace_forward(hf, forward, self._undo)

    def _patch_class(self, cls: Any, attr: str, count: _Count) -> None:
        orig = getattr(cls, attr)

        def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            cur = self.current
            if cur is None:
                return orig(obj, *args, **kwargs)
            count(obj, cur, args, kwargs)
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

        from psr.store import CopyReason, ExpertStore

        def launch(fn: Any, cur: LayerCounts, args: Any, kwargs: Any) -> None:
            name = getattr(getattr(fn, "fn", fn), "__name__", "triton")
            cur.triton[name] += 1
            cur.events.append(HostOp("launch", name))

        def store_op(kind: str) -> _Count:
            def count(_: Any, cur: LayerCounts, args: Any, kwargs: Any) -> None:
                if kind == "gather":
                    cur.gathers += 1
                    side = bool(kwargs["side"])  # keyword-only
                    cur.events.append(
                        HostOp(
                            "gather", "prefetch" if side else "miss", "side" if side else "compute"
                        )
                    )
                elif kind == "copy":  # the reason the caller gave (CopyReason)
                    cur.events.append(HostOp(kind, kwargs.get("reason", CopyReason.DIRECT).value))
                else:
                    cur.events.append(HostOp(kind, ""))

            return count

        try:
            self._patch_class(JITFunction, "run", launch)
            self._patch_class(InterpretedFunction, "run", launch)
            for method, kind in _STORE_METHODS.items():
                self._patch_class(ExpertStore, method, store_op(kind))
            self._hook("route")
            self._hook("experts")
            self._wrap_forward()
            modes: list[Any] = [_Reads(self), _Kernels(self)]
            for mode in modes:
                mode.__enter__()
                self._undo.append(functools.partial(mode.__exit__, None, None, None))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    # --- summaries -------------------------------------------------------------------
    def _steady(self, first: int) -> list[int]:
        """The decode forwards after the first `first` (all of them if none is left)."""
        idx = list(range(first, len(self.steps)))
        return idx or list(range(len(self.steps)))

    def per_token(self, first: int = 0) -> dict[str, float]:
        """Means per decode forward (after the first `first`): the MoE path's reads, h2d,
        kernels (aten + Triton + gathers) and store calls; the dense part's launches, reads
        and h2d; the loop's launches and reads."""
        idx = self._steady(first)
        n = max(len(idx), 1)
        cells = [c for i in idx for c in self.steps[i]]
        dense = [self.dense[i] for i in idx]
        token = [self.token[i] for i in idx]
        return {
            "tokens": len(idx),
            "reads": sum(len(c.reads) for c in cells) / n,
            "h2d": sum(c.h2d for c in cells) / n,
            "kernels": sum(c.kernels for c in cells) / n,
            "aten": sum(sum(c.aten.values()) for c in cells) / n,
            "triton": sum(sum(c.triton.values()) for c in cells) / n,
            "gathers": sum(c.gathers for c in cells) / n,
            "store_calls": sum(c.store_calls for c in cells) / n,
            "dense_kernels": sum(c.kernels for c in dense) / n,
            "dense_reads": sum(len(c.reads) for c in dense) / n,
            "dense_h2d": sum(c.h2d for c in dense) / n,
            "token_kernels": sum(c.kernels for c in token) / n,
            "token_reads": sum(len(c.reads) for c in token) / n,
        }

    def read_sites(self, part: str = "moe", first: int = 0) -> Counter[str]:
        """Every read's kind and place (`place`), with how often it happened, in the MoE path
        (`part` "moe"), the dense part ("dense") or the loop ("token")."""
        idx = self._steady(first)
        if part == "moe":
            cells = [c for i in idx for c in self.steps[i]]
        elif part in ("dense", "token"):
            cells = [getattr(self, part)[i] for i in idx]
        else:
            raise ValueError(f"part must be 'moe', 'dense' or 'token', got {part!r}")
        return Counter(r for c in cells for r in c.reads)

    def role_cells(self, first: int = 1) -> dict[str, list[list[HostOp]]]:
        """The op lists a schedule merges, by role: "moe_layer" (every MoE layer but the
        last, per decode forward after the first `first`), "last_moe_layer", "token" (the
        loop's ops, then the dense part's reads, host-built tensors and store calls)."""
        if len(self.steps) <= first:
            raise ValueError(
                f"{len(self.steps)} decode forwards probed: a schedule needs one after the "
                f"first {first} (decode at least {first + 2} new tokens)"
            )
        idx = self._steady(first)
        n = len(self.rt.layers)
        last = [self.steps[i][n - 1].events for i in idx]
        inner = [self.steps[i][j].events for i in idx for j in range(n - 1)]
        token = [
            self.token[i].events + [e for e in self.dense[i].events if e.kind != "launch"]
            for i in idx
        ]
        return {"moe_layer": inner or last, "last_moe_layer": last, "token": token}

    def uniform(self, first: int = 1) -> dict[str, bool]:
        """Per role, whether every cell issued the same ops in the same order."""
        return {
            role: all(c == cells[0] for c in cells)
            for role, cells in self.role_cells(first).items()
        }

    def schedule(self, first: int = 1) -> HostSchedule:
        """The host's work per decode token, for the latency model.

        Tokens: the decode forwards after the first `first` (the first decode forward also
        hands the caches over to the device step). Per role (role_cells), the ops are the
        merge of its cells, one per layer and token (merge_ops): when every cell issued the
        same ops this is that list (the device step: always); otherwise an ordered list
        that contains each cell's, so every op that any token issued is priced every token.
        The host step skips a store copy call when a layer has nothing to copy: the
        schedule keeps that call, at most one store call per layer and token too many; how
        many copies each call issues comes from the trace. `op_rates` says how often each
        op happened. `moe_layer` is a MoE layer that predicts the next one when the policy
        predicts (n > 0; else any but the last), `last_moe_layer` the last one;
        `dense_launches` the dense part's launches per decode forward over the decoder
        layers; `token` the loop's ops (argmax, cat, its read of the token) and any read,
        host-built tensor or store call of the dense part."""
        idx = self._steady(first)
        cells = self.role_cells(first)
        modes = sorted({self.modes[i] for i in idx})
        if len(modes) != 1:
            raise ValueError(f"the probed decode forwards took different steps: {modes}")
        dense = sum(self.dense[i].launches for i in idx) / len(idx)
        return HostSchedule(
            modes[0],
            moe_layer=merge_ops(cells["moe_layer"]),
            last_moe_layer=merge_ops(cells["last_moe_layer"]),
            dense_launches=dense / self.rt.num_decoder_layers,
            token=merge_ops(cells["token"]),
        )


def measure_schedule(
    model: Any, prompt: torch.Tensor, new_tokens: int = 4, kernels: bool = True
) -> HostSchedule:
    """Decode `new_tokens` greedily under a HostProbe; its schedule (at least 3 new tokens:
    the first decode forward is not used). `kernels=False` (the device step only): in
    decode forwards the Triton launches and the store's native calls are counted but not
    run (stubbed_launches; the prefill runs for real). The device step's host reads
    nothing they write, so its calls, launches and syncs are the same, without the
    kernels' work (under Triton's interpreter, most of a measurement)."""
    if new_tokens < 3:
        raise ValueError(
            f"new_tokens must be >= 3 (two decode forwards after the first), got {new_tokens}"
        )
    if kernels:
        with HostProbe(model) as probe:
            model.generate(prompt, max_new_tokens=new_tokens)
        return probe.schedule()
    if model.runtime.decode_mode != "device":
        raise ValueError(
            "measure_schedule(kernels=False) needs the device step (decode='device'), not "
            f"{model.runtime.decode_mode!r}: the host-driven step reads what kernels write"
        )
    with stubbed_launches(model) as switch, HostProbe(model, switch) as probe:
        model.generate(prompt, max_new_tokens=new_tokens)
    return probe.schedule()


@contextmanager
def _timed_hooks(rt: Any, samples: list[float]) -> Iterator[None]:
    """Per decode MoE layer, the wall time of its route and experts hooks (seconds)."""
    inner = {name: getattr(rt, name) for name in ("route", "experts")}

    def wrap(name: str) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            decoding = rt.decoding  # before the call: prefill seeds the caches in it
            t = time.perf_counter()
            try:
                return inner[name](*args)
            finally:
                if decoding:
                    dt = time.perf_counter() - t
                    if name == "route":
                        samples.append(dt)
                    else:
                        samples[-1] += dt

        return timed

    for name in inner:
        setattr(rt, name, wrap(name))
    try:
        yield
    finally:
        for name in inner:
            delattr(rt, name)


def host_ms_samples(model: Any, prompt: torch.Tensor, new_tokens: int) -> list[float]:
    """Per decode token and MoE layer, the wall time (ms) in psr's router and experts
    hooks while decoding `new_tokens` greedily, without the probe's modes. On a shared
    machine their median is steadier than their mean."""
    samples: list[float] = []
    with _timed_hooks(model.runtime, samples):
        model.generate(prompt, max_new_tokens=new_tokens)
    return [x * 1e3 for x in samples]


def host_ms_per_layer(model: Any, prompt: torch.Tensor, new_tokens: int) -> float:
    """Host time in psr's hooks per decode token and MoE layer (ms): the mean of
    host_ms_samples."""
    samples = host_ms_samples(model, prompt, new_tokens)
    return sum(samples) / max(len(samples), 1)


# --- the host's own costs, timed with the launches stubbed ---------------------------
# The cost timer's clock: this thread's CPU time, not wall time. On a shared machine the
# wall time of a step swells with every other process's load (2x between runs here); the
# CPU time the step itself used does not (one thread: the store's calls are stubbed and
# torch runs one intra-op thread in bench/host_path.py).
_clock = time.thread_time


@contextmanager
def stubbed_launches(model: Any) -> Iterator[Callable[[bool], None]]:
    """While switched on (the yielded function: on(True)), Triton launches return at once
    (JITFunction.run, InterpretedFunction.run) and the store's native copy / acquire /
    release / gather / join / CPU-expert calls do nothing (ExpertStore.stub_native_calls),
    so what is left of a decode step's host time is Python and the aten ops (timed apart
    by `_AtenTimer`). Outputs the kernels would write stay unwritten: only decode forwards
    of a step whose host reads nothing they write (the device step) run so; the prefill
    that seeds the caches runs for real."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    store = model.runtime.store
    saved = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]
    on = [False]

    def switch(state: bool) -> None:
        on[0] = state
        store.stub_native_calls(state)

    def patched(run: Callable[..., Any]) -> Callable[..., Any]:
        def maybe(self: Any, *args: Any, **kwargs: Any) -> Any:
            return None if on[0] else run(self, *args, **kwargs)

        return maybe

    for cls, run in saved:
        cls.run = patched(run)  # type: ignore[method-assign]
    try:
        yield switch
    finally:
        store.stub_native_calls(False)
        for cls, run in saved:
            cls.run = run  # type: ignore[method-assign]


class _AtenTimer(TorchDispatchMode):
    """Seconds spent inside the aten ops the probe counts as launches (not views or
    allocations), added to the cost timer's current cell."""

    def __init__(self, timer: _CostTimer) -> None:
        super().__init__()
        self.timer = timer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.is_view or func.overloadpacket.__name__ in _NOT_LAUNCHES:
            return func(*args, **(kwargs or {}))
        t = _clock()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.timer.aten[self.timer.cell] += _clock() - t
            self.timer.launches[self.timer.cell] += 1


@dataclass
class _Forward1:
    """One decode forward's CPU times (`_clock`) (seconds): hooks per MoE layer, the whole forward,
    the loop before it; aten time and launches per cell ("moe", "dense", "token")."""

    hooks: list[float]
    forward: float
    token: float
    aten: dict[str, float]
    launches: dict[str, int]


class _CostTimer:
    """Times psr's MoE hooks, the rest of each forward and the loop between forwards (and
    the device step's `begin`), per decode forward."""

    def __init__(self, model: Any, switch: Callable[[bool], None]) -> None:
        self.model, self.rt = model, model.runtime
        self.switch = switch  # stubbed_launches' switch: on for decode forwards only
        self.forwards: list[_Forward1] = []
        self.begins: list[float] = []
        self.cell = "token"
        self.aten: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self._hooks: list[float] = []
        self._between_t0 = 0.0
        self._undo: list[Callable[[], None]] = []

    def _wrap_hook(self, name: str) -> None:
        rt = self.rt
        inner = getattr(rt, name)

        def timed(*args: Any) -> Any:
            if not rt.decoding:
                return inner(*args)
            self.switch(True)  # a decode forward: stubbed until it ends (the prefill is real)
            outer, self.cell = self.cell, "moe"
            t = _clock()
            try:
                out = inner(*args)
            finally:
                dt = _clock() - t
                self.cell = outer
                if name == "route":
                    self._hooks.append(dt)
                elif self._hooks:
                    self._hooks[-1] += dt
            if name == "experts" and isinstance(out, torch.Tensor):
                # The stubbed FFN left its output unwritten: zeros keep the rest of the
                # forward on finite numbers (garbage, denormals, NaN slow the CPU's ops).
                # One aten op, counted and subtracted in the dense part.
                out.zero_()
            return out

        setattr(rt, name, timed)
        self._undo.append(lambda: delattr(rt, name))

    def _wrap_forward(self) -> None:
        hf = self.model.hf
        inner = hf.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            t0 = _clock()
            token = t0 - self._between_t0
            self._hooks = []
            aten0, launches0 = Counter(self.aten), Counter(self.launches)
            self.cell = "dense"
            try:
                return inner(*args, **kwargs)
            finally:
                t1 = _clock()
                self.switch(False)
                self.cell = "token"
                if self._hooks and len(self._hooks) == len(self.rt.layers):  # a decode forward
                    aten = {k: self.aten[k] - aten0[k] for k in ("moe", "dense")}
                    aten["token"] = aten0["token"]
                    n = {k: self.launches[k] - launches0[k] for k in ("moe", "dense")}
                    n["token"] = launches0["token"]
                    self.forwards.append(_Forward1(self._hooks, t1 - t0, token, aten, n))
                self.aten["token"] = self.launches["token"] = 0
                self._between_t0 = _clock()

        _replace_forward(hf, forward, self._undo)

    def _wrap_begin(self) -> None:
        dev = self.rt.device_step
        inner = dev.begin

        def begin() -> None:
            t = _clock()
            try:
                inner()
            finally:
                self.begins.append(_clock() - t)

        dev.begin = begin
        self._undo.append(lambda: delattr(dev, "begin"))

    def __enter__(self) -> _CostTimer:
        self._wrap_hook("route")
        self._wrap_hook("experts")
        self._wrap_forward()
        self._wrap_begin()
        self._between_t0 = _clock()
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


@dataclass
class HostCosts:
    """The host's own costs of one decode step (µs), measured on this machine with the
    launches stubbed (`measure_host_costs`): what is left is the Python a GPU host runs
    beside its launches, syncs and store calls, which the latency model prices apart."""

    step: str  # the decode step timed: "device" | "host"
    moe_layer_us: float  # psr's MoE hooks per MoE layer, less their aten ops
    dense_layer_us: float  # per decoder layer: the forward outside psr's hooks, less its aten ops
    token_us: float  # the generation loop between forwards, less its aten ops
    begin_us: float  # the device step's cache hand-over at a sequence's first decode token
    first_token_moe_layer_us: float  # psr's hooks per MoE layer in the first decode forward
    raw: dict[str, float] = field(default_factory=dict)  # the medians subtracted from


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _low(xs: Sequence[float], q: float = 0.1) -> float:
    """The q-quantile (nearest rank): on a shared machine, preemption only adds time, so
    a low quantile estimates the uncontended cost better than the median."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def aten_op_us(batches: int = 7, loops: int = 400) -> float:
    """The host cost of one small eager aten op on this machine (µs): add, mul, a linear,
    a softmax and a sum on tiny CPU tensors (so nearly all of it is the Python binding and
    the dispatcher, what a GPU host pays per launch before the driver), the fastest of
    `batches` loops. The cost timer subtracts it per counted launch."""
    import torch.nn.functional as F

    x, y, w = torch.randn(1, 8), torch.randn(1, 8), torch.randn(8, 8)
    best = float("inf")
    for _ in range(batches):
        t = _clock()
        for _ in range(loops):
            torch.add(x, y)
            torch.mul(x, y)
            F.linear(x, w)
            torch.softmax(x, -1)
            torch.sum(x)
        best = min(best, (_clock() - t) / (5 * loops))
    return best * 1e6


def _timed_decode(
    model: Any, prompt: torch.Tensor, new_tokens: int, aten: bool, switch: Callable[[bool], None]
) -> tuple[list[_Forward1], list[float]]:
    with _CostTimer(model, switch) as timer:
        if aten:
            with _AtenTimer(timer):
                model.generate(prompt, max_new_tokens=new_tokens)
        else:
            model.generate(prompt, max_new_tokens=new_tokens)
    return timer.forwards, timer.begins


def measure_host_costs(
    model: Any, prompt: torch.Tensor, new_tokens: int = 16, repeats: int = 3
) -> HostCosts:
    """Time a decode's host work on this machine with the launches stubbed
    (`stubbed_launches`; the device step only: the host-driven one reads the routing the
    stubbed kernels would write). Per cell, the 10th percentile (`_low`; medians in `raw`)
    of its CPU time (`_clock`) over every decode forward after the first (and MoE layer) of
    `repeats` runs without any mode, less the cell's
    aten launches (counted in one run under `_AtenTimer`) at `aten_op_us` each (the model
    prices each launch apart). The time inside the aten ops under the mode is kept in
    `raw` (the mode's own cost inflates it). The first decode forward's hooks and the
    hand-over (`begin`) are reported apart."""
    if new_tokens < 3:
        raise ValueError(f"new_tokens must be >= 3, got {new_tokens}")
    if model.runtime.decode_mode != "device":
        raise ValueError(
            f"measure_host_costs times the device step (decode='device'), not "
            f"{model.runtime.decode_mode!r}: the host-driven step reads what stubbed kernels "
            "would write"
        )
    plain: list[_Forward1] = []
    timed: list[_Forward1] = []
    firsts: list[float] = []
    begins: list[float] = []
    n_dec = model.runtime.num_decoder_layers
    with stubbed_launches(model) as switch:
        for _ in range(repeats):
            fw, b = _timed_decode(model, prompt, new_tokens, False, switch)
            firsts += fw[0].hooks if fw else []
            plain += fw[1:]
            begins += b
        timed = _timed_decode(model, prompt, new_tokens, True, switch)[0][1:]
    if not plain or not timed:
        raise RuntimeError("no decode forward was timed (did the model decode on the device step?)")
    hooks_all = [h for f in plain for h in f.hooks]
    dense_all = [(f.forward - sum(f.hooks)) / n_dec for f in plain]
    token_all = [f.token for f in plain]
    hooks, dense, token = _low(hooks_all), _low(dense_all), _low(token_all)
    n_moe = len(plain[0].hooks)
    a_moe = _median([f.aten["moe"] / n_moe for f in timed])
    a_dense = _median([f.aten["dense"] / n_dec for f in timed])
    a_token = _median([f.aten["token"] for f in timed])
    op = aten_op_us()
    n_moe_l = _median([f.launches["moe"] / n_moe for f in timed])
    n_dense_l = _median([f.launches["dense"] / n_dec for f in timed])
    n_token_l = _median([f.launches["token"] for f in timed])
    raw = {
        "aten_op_us": op,
        "moe_hooks_us": hooks * 1e6,
        "moe_hooks_median_us": _median(hooks_all) * 1e6,
        "dense_median_us": _median(dense_all) * 1e6,
        "token_median_us": _median(token_all) * 1e6,
        "moe_aten_us": a_moe * 1e6,
        "moe_aten_launches": n_moe_l,
        "dense_us": dense * 1e6,
        "dense_aten_us": a_dense * 1e6,
        "dense_aten_launches": n_dense_l,
        "token_wall_us": token * 1e6,
        "token_aten_us": a_token * 1e6,
        "token_aten_launches": n_token_l,
        "forwards_timed": float(len(plain)),
    }
    return HostCosts(
        step="device",
        moe_layer_us=hooks * 1e6 - n_moe_l * op,
        dense_layer_us=dense * 1e6 - n_dense_l * op,
        token_us=token * 1e6 - n_token_l * op,
        begin_us=_low(begins) * 1e6,
        first_token_moe_layer_us=_low(firsts) * 1e6,
        raw=raw,
    )
