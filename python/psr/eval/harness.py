"""Evaluation runs: one policy at one residency on held-out text -> counts, modeled
latency and likelihood items; then quality and speed compared with exact (paired
bootstrap intervals). Reports: tables and JSON in `report.py`, figures in `plots.py`.

Used by `psr demo`, `psr eval` and `psr bench sweep` (`runs.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from psr.eval import modes
from psr.eval.defaults import DEFAULT_PROFILES
from psr.eval.latency import simulate
from psr.eval.quality import (
    ClozeItem,
    chunks,
    cloze_items,
    cloze_scores,
    greedy_agreement,
    paired_bootstrap,
    perplexity_items,
)
from psr.eval.shared import RoutingTap, replay
from psr.models.embedded import heldout_sets, tokenizer_of
from psr.models.loader import load
from psr.policy import Policy, parse_policy
from psr.runtime.trace import HostSchedule, Trace

if TYPE_CHECKING:
    from psr.runtime.model import OffloadedModel


@dataclass(frozen=True)
class RunConfig:
    """One evaluated configuration: a policy at a residency."""

    policy: Policy
    residency: float
    expert_format: str | None = None  # None: the model's dtype; else psr.load's formats

    @property
    def label(self) -> str:
        fmt = f" + {self.expert_format}" if self.expert_format else ""
        return self.policy.describe() + fmt

    def load(self, path: str, **kw: Any) -> OffloadedModel:
        """This configuration of the checkpoint at `path`, as every evaluation loads it
        (float32, no progress bars); `kw`: further `psr.load` options."""
        return load(
            path,
            self.policy,
            self.residency,
            dtype="float32",
            expert_format=self.expert_format,
            progress=False,
            **kw,
        )

    @property
    def routing_class(self) -> tuple[Any, ...] | None:
        """What decides this configuration's routed ids when its routing reads no cache
        (`Policy.routes_by_cache` False, logical cache): its expert format alone, not the
        residency or `n`; such configurations are measured with one forward
        (`run_class`). None: routing that reads the cache (or timing): measured alone."""
        p = self.policy
        if p.routes_by_cache or p.mask != "logical":
            return None
        return ("exact routing", self.expert_format)

    def as_dict(self) -> dict[str, Any]:
        """`{policy, residency, lam, n, expert_format}` (None where it has none)."""
        p = self.policy.params()
        return {
            "policy": p["policy"],
            "residency": self.residency,
            "lam": p["lam"],
            "n": p["n"],
            "expert_format": self.expert_format,
        }


@dataclass
class EvalData:
    """Token-level benchmark material cut from one held-out set.

    `windows`: teacher-forced windows; the first `prompt_len` tokens of each are
    prefilled, every later one is scored as a decode step under the policy. Counts,
    misses and modeled latency come from this same stream. `prompts` feed greedy
    generation (agreement with exact, reported separately); `cloze` items are scored as
    decode steps too.
    """

    windows: list[list[int]]
    prompt_len: int
    prompts: list[list[int]] = field(default_factory=list)
    gen_tokens: int = 0
    cloze: list[ClozeItem] = field(default_factory=list)
    source: str = ""

    @property
    def scored_tokens(self) -> int:
        return sum(len(w) - self.prompt_len for w in self.windows)

    @classmethod
    def from_text(
        cls,
        tokenizer: Any,
        text: str,
        *,
        windows: int = 160,
        window_tokens: int = 160,
        prompt_tokens: int = 32,
        prompts: int = 4,
        gen_tokens: int = 48,
        cloze: int = 0,
        seed: int = 0,
        source: str = "",
    ) -> EvalData:
        if not 1 <= prompt_tokens < window_tokens:
            raise ValueError(
                f"prompt_tokens must be in [1, window_tokens={window_tokens}), got {prompt_tokens}"
            )
        ids = tokenizer(text)["input_ids"]
        return cls(
            windows=chunks(ids, window_tokens, windows, seed) if windows else [],
            prompt_len=prompt_tokens,
            prompts=chunks(ids, prompt_tokens, prompts, seed + 1) if prompts else [],
            gen_tokens=gen_tokens,
            cloze=cloze_items(ids, cloze, seed=seed + 2) if cloze else [],
            source=source,
        )

    @classmethod
    def from_heldout(cls, path: str, split: str = "A", **kw: Any) -> EvalData:
        """From held-out set `split` ('A': selection, 'B': replication) of a model."""
        return cls.from_sets(path, heldout_sets(path), split, **kw)

    @classmethod
    def from_sets(
        cls, path: str, sets: dict[str, tuple[str, str]], split: str = "A", **kw: Any
    ) -> EvalData:
        """From set `split` of `sets` (`{"A": (description, text), "B": ...}`: a model's
        held-out sets, or the user's text's, psr.eval.text.text_sets), in `path`'s tokens."""
        if split not in sets:
            raise ValueError(f"held-out split must be one of {sorted(sets)}, got {split!r}")
        desc, text = sets[split]
        return cls.from_text(tokenizer_of(path), text, source=desc, **kw)


def run_config(
    path: str,
    rc: RunConfig,
    data: EvalData,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    *,
    progress: bool = False,
    schedule: HostSchedule | None = None,
    modes_recorded: bool = False,
    modes_replayed: bool = True,
    tap: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One config: score the windows (teacher forced, decode path: NLL, counts and the
    trace the latency model replays), generate greedily from the prompts, score cloze.
    `tap`: the windows' routing recorded for the prefetch counts given (`routing`, not
    saved: the input of `run_class`'s replays).
    Modeled latency host-free (`latency`) and, given the configuration's measured decode
    schedule (`measure_schedules`), host-aware too (`latency_host`). `modes_recorded`: a policy
    that `modes.replay` cannot take (biased, or prefetching) scores the windows again in
    experts_on cpu and hybrid (`record_modes`: `mode_traces`, for the modes table).
    `modes_replayed=False`: exact routing's window starts are not watched (no input for the
    modes table's replay; the scores and trace are the same)."""
    model = rc.load(path)
    total = len(data.windows) + len(data.prompts) + len(data.cloze)
    bar = tqdm(total=total, desc=rc.label, leave=False, disable=not progress or total == 0)
    rec = model.record_trace()
    # Exact routing: each window's caches, for the cpu / hybrid replays (eval/modes.py).
    watch = (
        modes.StartWatch(model)
        if modes_replayed and modes.replayable(rc.policy) and data.windows
        else None
    )
    rt, routing = model.runtime, None
    steering = rt.steering
    if tap is not None:  # the spec's steering, recording (only while windows are scored)
        routing = RoutingTap(rt, tap)
        rt.set_steering(routing)
    try:
        nll = perplexity_items(model, data.windows, data.prompt_len, bar) if data.windows else []
    finally:
        rt.set_steering(steering)
    starts = None
    if watch is not None:
        watch.close()
        starts = {
            **watch.starts(len(rec.trace.tokens), len(data.windows)),
            "capacity": model.runtime.capacity,
            "num_experts": model.runtime.spec.num_experts,
        }
    stats = model.stats.report()
    model.runtime.recorder = None
    recorded = None
    if modes_recorded and watch is None and data.windows:
        recorded = record_modes(model, data, profiles)
    gens = []
    for p in data.prompts:
        gens.append(model.generate(p, data.gen_tokens)[0, len(p) :].tolist())
        bar.update()
    cz = cloze_scores(model, data.cloze, bar) if data.cloze else []
    bar.close()
    model.close()
    out = _result(rc, stats, rec.trace, profiles, gens, nll, cz, starts)
    if recorded is not None:
        out["mode_traces"] = recorded  # not saved (report.save): the modes table's input
    if routing is not None:
        out["routing"] = routing.windows  # not saved: run_class's replay input
    if schedule is not None:
        add_host_latency(out, schedule, profiles)
    return out


def _result(
    rc: RunConfig,
    stats: dict[str, float],
    trace: Trace,
    profiles: Sequence[str],
    generated: list[list[int]],
    nll: list[float],
    cloze: list[float],
    starts: dict[str, Any] | None,
) -> dict[str, Any]:
    """A configuration's result as `run_config` returns it."""
    out = {
        "config": rc.as_dict(),
        "label": rc.label,
        "stats": stats,
        "latency": {p: simulate(trace, p).as_dict() for p in profiles},
        "generated": generated,
        "nll_items": nll,
        "cloze_items": cloze,
        "trace": trace,  # serialised only when a report keeps traces (seconds per run)
    }
    if starts is not None:
        out["mode_starts"] = starts  # not saved (report.save): replay input only
    return out


def run_class(
    path: str,
    configs: Sequence[RunConfig],
    data: EvalData,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    *,
    progress: bool = False,
    modes_replayed: bool = True,
) -> list[dict[str, Any]]:
    """`run_config` of each of `configs`, which share one `routing_class` (not None): the
    first measured, each other one's caches replayed over its routing (psr.eval.shared)
    and its scores and tokens taken from it: the same results as separate runs, with one
    forward (each other member's model is loaded, for its slots, but not run)."""
    if len({rc.routing_class for rc in configs}) != 1 or configs[0].routing_class is None:
        raise ValueError("run_class takes configurations of one routing class")
    lead = run_config(
        path,
        configs[0],
        data,
        profiles,
        progress=progress,
        modes_replayed=modes_replayed,
        tap=[rc.policy.n for rc in configs[1:]],
    )
    windows = lead.pop("routing")
    out = [lead]
    for rc in configs[1:]:
        model = rc.load(path)
        try:
            rep = replay(model, windows, lead["trace"])
            starts = None
            if modes_replayed and modes.replayable(rc.policy) and windows:
                starts = {
                    "window": windows[0][0].decode_tokens,
                    "starts": rep.starts,
                    "capacity": model.runtime.capacity,
                    "num_experts": model.runtime.spec.num_experts,
                }
        finally:
            model.close()
        gens, nll, cz = lead["generated"], lead["nll_items"], lead["cloze_items"]
        out.append(_result(rc, rep.stats, rep.trace, profiles, gens, nll, cz, starts))
    return out


def record_modes(
    model: OffloadedModel, data: EvalData, profiles: Sequence[str] = DEFAULT_PROFILES
) -> dict[str, Any]:
    """The windows scored again with experts_on "cpu" and "hybrid:m" for each m the
    profiles' costs choose (`modes.hybrid_caps`), a trace recorded per mode; the model is
    left in "gpu" mode (its stats count these runs too). Returns {"traces": {mode: Trace},
    "nll_items": {mode: [...]}, "capacity", "num_experts"} (run_config's `mode_traces`)."""
    rt = model.runtime
    if model.experts_on != "gpu":
        raise ValueError(f"record_modes starts from experts_on 'gpu', not {model.experts_on!r}")
    E, C = rt.spec.num_experts, rt.capacity
    caps = modes.hybrid_caps(profiles, rt.spec.top_k, C, E, rt.bytes_ratio)
    traces, nll = {}, {}
    try:
        for mode in ["cpu", *(f"hybrid:{m}" for m in sorted(set(caps.values())))]:
            where, _, m = mode.partition(":")
            model.set_experts_on(where, int(m) if m else None)
            rec = model.record_trace()
            nll[mode] = perplexity_items(model, data.windows, data.prompt_len)
            rt.recorder = None
            traces[mode] = rec.trace
    finally:
        rt.recorder = None
        model.set_experts_on("gpu")
    return {"traces": traces, "nll_items": nll, "capacity": C, "num_experts": E}


# --- host schedules ------------------------------------------------------------------
# New tokens a schedule measurement decodes (measure_schedule drops the first decode
# forward, which hands the caches over to the device step, and merges the others), and
# the prompt tokens it prefills: a few, the schedule does not depend on them.
SCHEDULE_TOKENS = 3
SCHEDULE_PROMPT_TOKENS = 8


def schedule_key(rc: RunConfig, decode: str = "device") -> tuple[Any, ...]:
    """What decides a configuration's decode schedule: whether its policy predicts
    (n > 0), what its bias reads, the expert format's kernels, and for the host-driven
    step whether it biases at all (lam > 0: a mask built on the host). Not the residency
    or lam's value, which change no call, launch or sync, nor, in the device step, whether
    lam is 0 (the fused routing kernel always reads the device membership; a policy whose
    bias reads the physical slots always takes the host-driven step)."""
    p = rc.policy
    biased = p.lam > 0 if decode == "host" or p.mask != "logical" else None
    return (decode, biased, p.n > 0, p.mask, rc.expert_format or "native")


def schedule_prompt(data: EvalData) -> list[int]:
    """The prompt a schedule measurement decodes from: the data's first prompt, else the
    first window's prompt part (a few tokens of either)."""
    if data.prompts:
        return data.prompts[0][:SCHEDULE_PROMPT_TOKENS]
    if data.windows:
        return data.windows[0][: min(data.prompt_len, SCHEDULE_PROMPT_TOKENS)]
    raise ValueError("no prompt or window to measure a decode schedule from")


def _triton_here() -> bool:
    """This process can run the Triton kernels: on CUDA, or under TRITON_INTERPRET=1."""
    import torch

    from psr_kernels.dispatch import resolve_compute

    try:
        resolve_compute("triton", "cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError:
        return False
    return True


def _measure_one(path: str, rc: RunConfig, prompt: list[int], decode: str) -> HostSchedule:
    import torch

    from psr.eval.host_probe import measure_schedule

    model = rc.load(path, compute="triton", decode=decode)
    # Without a GPU, the device step's kernels are counted, not run (under Triton's
    # interpreter they were most of the demo's schedule time): the same schedule.
    kernels = decode != "device" or torch.cuda.is_available()
    try:
        return measure_schedule(model, torch.tensor([prompt]), SCHEDULE_TOKENS, kernels=kernels)
    finally:
        model.close()


class ScheduleJob:
    """Each configuration's host schedule on psr's deployed GPU path (the Triton kernels,
    `decode` steps; the path a latency profile prices), from a real decode of `prompt`
    (psr.eval.host_probe.measure_schedule), measured once per schedule_key.

    A process that can run Triton measures them at once. One that cannot (a CPU without
    TRITON_INTERPRET=1) starts one child process that measures them under Triton's
    interpreter (the same calls, launches and syncs), beside the caller's own work until
    `result()` is asked for."""

    def __init__(
        self,
        path: str,
        configs: Sequence[RunConfig],
        prompt: list[int],
        decode: str = "device",
        progress: bool = False,
    ) -> None:
        self.configs, self.decode = list(configs), decode
        reps: dict[tuple[Any, ...], RunConfig] = {}
        for rc in configs:
            reps.setdefault(schedule_key(rc, decode), rc)
        self.todo = list(reps.values())
        self.got: list[HostSchedule] | None = None
        self.child: subprocess.Popen[bytes] | None = None
        if _triton_here():
            bar = tqdm(self.todo, desc="decode schedules", leave=False, disable=not progress)
            self.got = [_measure_one(path, rc, prompt, decode) for rc in bar]
            return
        request = {
            "path": path,
            "prompt": prompt,
            "decode": decode,
            "configs": [[rc.policy.spec(), rc.residency, rc.expert_format] for rc in self.todo],
        }
        # Files, not pipes: the child never blocks on output nobody reads yet.
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from psr.eval.harness import _schedule_child; _schedule_child()",
            ],
            stdin=subprocess.PIPE,
            stdout=self.out,
            stderr=self.err,
            env={**os.environ, "TRITON_INTERPRET": "1"},
        )
        assert self.child.stdin is not None
        self.child.stdin.write(json.dumps(request).encode())
        self.child.stdin.close()

    def cancel(self) -> None:
        """Stop the child process, if one is still measuring (the caller failed)."""
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()

    def done(self) -> bool:
        """Whether `result()` returns without waiting."""
        return self.got is not None or (self.child is not None and self.child.poll() is not None)

    def result(self) -> dict[RunConfig, HostSchedule]:
        """The schedules by configuration (waits for the child process, if any)."""
        if self.got is None:
            assert self.child is not None
            code = self.child.wait()
            self.out.seek(0)
            self.err.seek(0)
            out, err = self.out.read().decode(), self.err.read().decode()
            self.out.close()
            self.err.close()
            if code != 0:
                raise RuntimeError(
                    "measuring the decode schedules under Triton's interpreter failed "
                    f"(exit {code}):\n{err[-2000:]}"
                )
            self.got = [HostSchedule.from_json(d) for d in json.loads(out.strip().splitlines()[-1])]
        by_key = {
            schedule_key(rc, self.decode): s for rc, s in zip(self.todo, self.got, strict=True)
        }
        return {rc: by_key[schedule_key(rc, self.decode)] for rc in self.configs}


def measure_schedules(
    path: str,
    configs: Sequence[RunConfig],
    prompt: list[int],
    decode: str = "device",
    progress: bool = False,
) -> dict[RunConfig, HostSchedule]:
    """ScheduleJob(...).result(): each configuration's measured decode schedule."""
    return ScheduleJob(path, configs, prompt, decode, progress).result()


def add_host_latency(
    result: dict[str, Any], schedule: HostSchedule, profiles: Sequence[str] = DEFAULT_PROFILES
) -> None:
    """A run_config result's trace gets its measured schedule, and the result its
    host-aware modeled latency (`latency_host`)."""
    trace = result["trace"]
    trace.host = schedule
    result["latency_host"] = {p: simulate(trace, p, host=True).as_dict() for p in profiles}
    if schedule.mode == "device":  # CUDA's default: the step captured, one graph per token
        result["latency_graph"] = {
            p: simulate(trace, p, host=True, graph=True).as_dict() for p in profiles
        }


def _schedule_child() -> None:
    """measure_schedules' child process: a request as JSON on stdin, the schedules as one
    JSON line on stdout."""
    req = json.loads(sys.stdin.read())
    out = [
        asdict(
            _measure_one(
                req["path"], RunConfig(parse_policy(p), rho, fmt), req["prompt"], req["decode"]
            )
        )
        for p, rho, fmt in req["configs"]
    ]
    print(json.dumps(out))


def compare(results: list[dict[str, Any]], profiles: Sequence[str] = DEFAULT_PROFILES) -> None:
    """Add speedup, greedy agreement and quality deltas vs `exact` at the same residency,
    in the model's own expert format (the reference every other row is measured against)."""
    exact = {
        r["config"]["residency"]: r
        for r in results
        if r["config"]["policy"] == "exact" and not r["config"].get("expert_format")
    }
    any_exact = next(iter(exact.values()), None)
    for r in results:
        ref = exact.get(r["config"]["residency"], any_exact)
        if ref is None:
            continue
        r["speedup"] = {
            p: ref["latency"][p]["ms_per_token"] / r["latency"][p]["ms_per_token"] for p in profiles
        }
        for key in ("latency_host", "latency_graph"):
            if r.get(key) and ref.get(key):
                r[key.replace("latency", "speedup")] = {
                    p: ref[key][p]["ms_per_token"] / r[key][p]["ms_per_token"] for p in profiles
                }
        if r["generated"]:
            agree = [
                greedy_agreement(a, b)
                for a, b in zip(r["generated"], ref["generated"], strict=True)
            ]
            r["greedy_agreement"] = sum(a for a, _ in agree) / len(agree)
            r["first_divergence"] = [f for _, f in agree]
        if r["nll_items"]:
            r["nll"] = sum(r["nll_items"]) / len(r["nll_items"])
            r["delta_nll"] = paired_bootstrap(r["nll_items"], ref["nll_items"]).as_dict()
        if r["cloze_items"]:
            r["cloze_acc"] = sum(r["cloze_items"]) / len(r["cloze_items"])
            pts = [100 * x for x in r["cloze_items"]]
            r["delta_cloze_pts"] = paired_bootstrap(
                pts, [100 * x for x in ref["cloze_items"]]
            ).as_dict()
