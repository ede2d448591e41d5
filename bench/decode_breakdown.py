"""Where psr's CPU decode token goes (issue 39): per-token CPU time split into the dense
kernel, the experts, the attention module's own work, the router + PSR bookkeeping, the
norms and the rest (embedding, LM head glue, sampling, the decoder layers' Python).

    PYTHONPATH=python:. OMP_NUM_THREADS=1 .venv/bin/python bench/decode_breakdown.py \
        /work/cache/gguf/olmoe-L16-Q4_K_M.gguf [--tokens 32] [--reps 3] [--out FILE.json] \
        [--trees BEFORE_ROOT,AFTER_ROOT --rounds 2]

FILE may be `default` (psr's embedded model). `--trees`: the same measurement of two
source trees (e.g. `git archive` of the base commit with its built extension, and this
one) side by side: one worker process per tree and round, the order alternating per round.

`psr.load(FILE, "exact", 1.0, device="cpu", threads=1)` as bench/llamacpp_side.py loads it;
a warm-up generation, then `--reps` generations of `--tokens` new tokens from an 8-token
prompt. Timers (thread CPU time, `time.thread_time`) wrap: the CPU kernels (`cpu_linear`
and the dense layers' `LinearPlan` calls, `cpu_expert_ffn`), the store's gathers, the
router module (psr's route: router logits, the decode kernel's torch path, the gathers),
the experts module, every attention module and every RMS norm module of the model. Each
part is counted exclusive of the parts it calls (a stack), so the parts sum to the span;
"other" is the span less them. Figures are per decode token (the prompt's forward
excluded) of the rep with the least total CPU time; the timers add a few microseconds per
call, so the parts' sum is a slight overestimate of the untimed token (the untimed CPU
ms/token is printed beside).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PARTS = (
    "dense kernel (cpu_linear)",
    "experts (cpu_expert_ffn)",
    "gathers (store copies)",
    "router + PSR bookkeeping",
    "experts module glue",
    "attention (but its projections)",
    "norms",
)


class _Timers:
    """Exclusive thread-CPU time per part, over a stack of nested timed calls."""

    def __init__(self) -> None:
        self.on = False
        self.total: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.stack: list[list[float]] = []  # [start, time spent in children]

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            if not self.on:
                return fn(*a, **kw)
            self.stack.append([time.thread_time(), 0.0])
            try:
                return fn(*a, **kw)
            finally:
                t0, child = self.stack.pop()
                spent = time.thread_time() - t0
                self.total[part] += spent - child
                self.calls[part] += 1
                if self.stack:
                    self.stack[-1][1] += spent

        return timed

    def reset(self) -> None:
        self.total = dict.fromkeys(PARTS, 0.0)
        self.calls = dict.fromkeys(PARTS, 0)


class _Clock:
    """A streamer: thread CPU time at each put (the first is the prompt's token); turns the
    timers on from the first new token, so they cover the decode span only."""

    def __init__(self, timers: _Timers) -> None:
        self.marks: list[float] = []
        self.timers = timers

    def put(self, _value: Any) -> None:
        self.marks.append(time.thread_time())
        if len(self.marks) == 2:
            self.timers.reset()
            self.timers.on = True

    def end(self) -> None:
        self.timers.on = False


def _instrument(model: Any, timers: _Timers) -> None:
    """Wrap the kernels, the store's gather, psr's router and experts modules, and every
    attention and RMS-norm module of `model` (instances' forwards: no class is patched)."""
    from psr.runtime import modules, store_ops
    from psr.store import cpu_kernels
    from psr.store.expert_store import ExpertStore

    cpu_kernels.cpu_linear = timers.wrap(PARTS[0], cpu_kernels.cpu_linear)  # type: ignore[assignment]
    plan = getattr(cpu_kernels, "LinearPlan", None)  # dense layers' prepared calls (not in
    if plan is not None:  # trees before them: --trees)
        plan.__call__ = timers.wrap(PARTS[0], plan.__call__)
    store_ops.cpu_expert_ffn = timers.wrap(PARTS[1], store_ops.cpu_expert_ffn)  # type: ignore[assignment]
    ExpertStore.gather = timers.wrap(PARTS[2], ExpertStore.gather)  # type: ignore[method-assign]
    for m in model.hf.modules():
        if isinstance(m, modules.PSRRouter):
            m.forward = timers.wrap(PARTS[3], m.forward)  # type: ignore[method-assign]
        elif isinstance(m, modules.OffloadedExperts):
            m.forward = timers.wrap(PARTS[4], m.forward)  # type: ignore[method-assign]
        elif type(m).__name__.endswith("Attention"):
            m.forward = timers.wrap(PARTS[5], m.forward)  # type: ignore[method-assign]
        elif type(m).__name__.endswith("RMSNorm"):
            m.forward = timers.wrap(PARTS[6], m.forward)  # type: ignore[method-assign]


def measure(path: str, tokens: int, reps: int) -> dict[str, Any]:
    import psr

    torch.set_num_threads(1)
    src = psr.DEFAULT_MODEL if path == "default" else path
    model = psr.load(src, "exact", 1.0, device="cpu", threads=1, progress=False)
    ids = torch.randint(0, 2048, (1, 8), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=tokens + 1)  # warm-up (pages the rows in)
    plain = []
    for _ in range(reps):  # untimed: the streamer only
        timers = _Timers()
        clock = _Clock(timers)
        model.generate(ids, max_new_tokens=tokens + 1, streamer=clock)
        plain.append(1e3 * (clock.marks[-1] - clock.marks[1]) / tokens)
    timers = _Timers()
    _instrument(model, timers)
    best: dict[str, Any] | None = None
    for _ in range(reps):
        clock = _Clock(timers)
        out = model.generate(ids, max_new_tokens=tokens + 1, streamer=clock)
        span = 1e3 * (clock.marks[-1] - clock.marks[1]) / tokens
        parts = {k: 1e3 * v / tokens for k, v in timers.total.items()}
        parts["other (layers' Python, embedding, LM head glue, sampling)"] = span - sum(
            parts.values()
        )
        if best is None or span < best["timed_ms_per_token"]:
            best = {
                "timed_ms_per_token": span,
                "parts_ms_per_token": parts,
                "calls_per_token": {k: v / tokens for k, v in timers.calls.items()},
                "tokens": out[0, -tokens:].tolist() if torch.is_tensor(out) else None,
            }
    assert best is not None
    return {"file": path, "untimed_ms_per_token": min(plain), "untimed_runs": plain, **best}


def _show(label: str, got: dict[str, Any]) -> None:
    print(
        f"{label}: untimed {got['untimed_ms_per_token']:.1f} CPU ms/token, "
        f"timed {got['timed_ms_per_token']:.1f}",
        flush=True,
    )
    for k, v in got["parts_ms_per_token"].items():
        print(f"  {k:58s} {v:7.2f} ms  ({got['calls_per_token'].get(k, 0):.0f} calls)")


def compare(a: argparse.Namespace) -> dict[str, Any]:
    """The measurement of each tree in `a.trees`, one worker process per tree and round
    (this script, the tree's python/ first on the path), the order alternating per round."""
    from common import tree_runs

    trees = [Path(t).resolve() for t in a.trees.split(",")]
    runs: list[dict[str, Any]] = []
    cmd = [sys.executable, __file__, a.file, "--tokens", str(a.tokens)]
    cmd += ["--reps", str(a.reps), "--json"]
    for r, tree, got in tree_runs(trees, a.rounds, cmd):
        runs.append({"round": r, "tree": str(tree), "load": os.getloadavg()[0], **got})
        _show(f"round {r} {tree}", got)
    return {"file": a.file, "trees": [str(t) for t in trees], "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--trees", default="", help="ROOT,ROOT: two source trees side by side")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trees:
        got = compare(a)
    else:
        got = measure(a.file, a.tokens, a.reps)
        if a.json:
            print(json.dumps(got))
            return
        _show(Path(a.file).name, got)
    if a.out:
        a.out.write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
