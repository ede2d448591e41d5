"""This machine's costs of computing a miss where it lives against copying it (issue 27):
the profile `psr bench machine` measures, where it is kept, and the choice of `hybrid`'s
miss-copy cap per MoE layer from it.

Pure bookkeeping (no torch, no store): the profile is a JSON file beside the operating
points ($PSR_HOME/machine.json, else the user data folder), written by
`psr.eval.machine_profile.measure_profile`. A profile records where it was measured (the
fingerprint: CPU model, cores, threads, GPU name or "none", psr version); read on another
machine it gives a one-line warning naming that machine, and is still used.

The choice (`choose_inserts`): a layer step with M misses of which m are copied costs
    copy(m) = min(m, M) * copy_s                 (the copy engine, per expert)
    cpu(m)  = cpu_fixed_s + (M - m) * cpu_expert_s   if M > m, else 0
and the two overlap (the copies run on the copy engine while the CPU computes), so the
layer's miss time is max(copy(m), cpu(m)); m is the smallest in [0, k] minimising it for
the expected misses M of the layer. The per-call fixed cost (hand-over of the hidden state
and ids, the CPU pool's wake-up, the merge of the result) is what made a mispriced hybrid
slower than plain offload elsewhere (FreeToken #151): it is measured, not assumed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MACHINE_FILE = "machine.json"
PROFILE_VERSION = 1
# experts_on="hybrid" on the CPU backend without a profile: copying a miss into the slab
# is a memcpy between two places in the same RAM, which the CPU kernels read alike, so a
# copy only adds time: every miss is computed from its host row (m = 0).
CPU_BACKEND_DEFAULT_M = 0

log = logging.getLogger("psr")


def shape_key(hidden: int, ffn: int, fmt: str) -> str:
    """The profile's key of one expert shape and format ('bf16', 'float32', 'int8', ...)."""
    return f"H{hidden}xF{ffn}:{fmt}"


@dataclass
class ShapeCosts:
    """Measured per-expert times of one expert shape and format."""

    row_bytes: int
    cpu_expert_s: float  # one routed expert on the CPU kernels (threads = the profile's)
    copy_s: float | None = None  # one expert's host-to-device copy (None: no GPU measured)


@dataclass
class MachineProfile:
    fingerprint: dict[str, Any]
    cpu_fixed_s: float  # one CPU-experts call of one tiny expert: hand-over, wake, merge
    triad_bytes_per_s: float  # STREAM-style triad at the same threads
    shapes: dict[str, ShapeCosts] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> MachineProfile:
        shapes = {k: ShapeCosts(**v) for k, v in dict(raw.get("shapes", {})).items()}
        return cls(
            dict(raw["fingerprint"]),
            float(raw["cpu_fixed_s"]),
            float(raw["triad_bytes_per_s"]),
            shapes,
            int(raw.get("version", PROFILE_VERSION)),
        )


def profile_path() -> Path:
    """Where the profile lives: beside the operating points' folder (psr.points)."""
    home = os.environ.get("PSR_HOME", "").strip()
    if home:
        return Path(home) / MACHINE_FILE
    import platformdirs

    return Path(platformdirs.user_data_dir("psr")) / MACHINE_FILE


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else the platform's word)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def psr_version() -> str:
    """The installed psr's version (the package root is above every layer: not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("psr")
    except PackageNotFoundError:
        return "unknown"


def fingerprint(threads: int, gpu: str, version: str) -> dict[str, Any]:
    """What identifies the machine a profile was measured on."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "threads": int(threads),
        "gpu": gpu or "none",
        "psr": version,
    }


# ------------------------------------------------------------------ threads (issue 42)

THREADS_ENV = "PSR_THREADS"
_SYS_CPU = Path("/sys/devices/system/cpu")


def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity mask; all of them where the
    platform has no mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int] | None = None, sys_cpu: Path = _SYS_CPU) -> int:
    """The physical cores among `cpus` (default: `allowed_cpus()`): distinct (package, core)
    pairs of their sysfs topology, so SMT siblings count once; where the topology cannot be
    read, the logical CPUs themselves."""
    cpus = allowed_cpus() if cpus is None else cpus
    cores = set()
    for c in cpus:
        topo = sys_cpu / f"cpu{c}" / "topology"
        try:
            pkg = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return max(len(cpus), 1)
        cores.add((pkg, core))
    return max(len(cores), 1)


def resolve_threads(threads: int | None) -> int:
    """The CPU threads psr computes with (torch's intra-op pool and psr's CPU expert
    kernels): `threads`, else $PSR_THREADS, else $OMP_NUM_THREADS, else the physical cores
    available to the process. More than the logical CPUs the process may use is refused
    (ValueError, one line), as are values that are not integers >= 1."""
    source = "threads"
    value: object = threads
    for env in (THREADS_ENV, "OMP_NUM_THREADS"):
        if value is None and os.environ.get(env, "").strip():
            value, source = os.environ[env].strip(), f"${env}"
    if value is None:
        return physical_cores()
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{source}={value!r}: expected an integer >= 1")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{source}={value!r}: expected an integer >= 1") from None
    return check_cpus(n, source)


def check_cpus(n: int, source: str) -> int:
    """`n` (threads or processes, named `source` in the error), if at least 1 and at most
    the logical CPUs the process may use; else ValueError, one line."""
    cpus = len(allowed_cpus())
    if n < 1:
        raise ValueError(f"{source}={n}: expected an integer >= 1")
    if n > cpus:
        raise ValueError(
            f"{source}={n}: only {cpus} CPUs are available to this process (its affinity "
            f"mask; the default is its {physical_cores()} physical cores)"
        )
    return n


def describe(fp: dict[str, Any]) -> str:
    return (
        f"{fp.get('cpu', '?')} ({fp.get('cores', '?')} cores, {fp.get('threads', '?')} "
        f"threads), GPU {fp.get('gpu', '?')}, psr {fp.get('psr', '?')}"
    )


def mismatch(profile: MachineProfile, here: dict[str, Any]) -> str | None:
    """A one-line warning if `profile` was measured elsewhere than `here`, else None."""
    if profile.fingerprint == here:
        return None
    return (
        f"machine profile measured on {describe(profile.fingerprint)}, not on this machine "
        f"({describe(here)}): run `psr bench machine` here"
    )


def read_profile(path: Path | None = None) -> MachineProfile | None:
    """The saved profile, or None when there is none."""
    f = profile_path() if path is None else path
    if not f.is_file():
        return None
    try:
        return MachineProfile.from_json(json.loads(f.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{f}: not a psr machine profile ({e})") from None


def write_profile(profile: MachineProfile, path: Path | None = None) -> Path:
    f = profile_path() if path is None else path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    return f


def layer_time(m: int, misses: int, copy_s: float, cpu_fixed_s: float, cpu_s: float) -> float:
    """Modeled miss time of a layer step with `misses` misses, `m` of them copied."""
    copied = min(m, misses)
    on_cpu = misses - copied
    return max(copied * copy_s, cpu_fixed_s + on_cpu * cpu_s if on_cpu else 0.0)


def choose_inserts(
    misses: float, top_k: int, copy_s: float, cpu_fixed_s: float, cpu_expert_s: float
) -> int:
    """The smallest m in [0, top_k] minimising `layer_time` at the expected `misses`
    (rounded up: pricing one miss too many errs toward the fixed cost being paid)."""
    for name, v in (("copy_s", copy_s), ("cpu_fixed_s", cpu_fixed_s), ("cpu", cpu_expert_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"choose_inserts: {name} must be a finite time >= 0, got {v!r}")
    if not 0 <= misses <= top_k:
        raise ValueError(f"choose_inserts: expected misses {misses} not in [0, {top_k}]")
    M = math.ceil(misses)
    costs = [layer_time(m, M, copy_s, cpu_fixed_s, cpu_expert_s) for m in range(top_k + 1)]
    return costs.index(min(costs))


def expected_misses(top_k: int, capacity: int, num_experts: int) -> float:
    """The prior for a layer's misses per step: k (1 - C / E), routing independent of the
    cache (reuse between tokens only lowers it)."""
    return top_k * (1.0 - capacity / num_experts)


def hybrid_caps(
    profile: MachineProfile | None,
    keys: list[str],
    *,
    top_k: int,
    capacity: int,
    num_experts: int,
    backend: str,
) -> list[int]:
    """`hybrid`'s miss-copy cap per MoE layer (`keys`: each layer's `shape_key`)."""
    M = expected_misses(top_k, capacity, num_experts)
    caps = []
    for k in keys:
        c = None if profile is None else profile.shapes.get(k)
        if c is None or c.copy_s is None:
            if backend == "cpu":  # nothing measured for this shape: the CPU backend's default
                caps.append(CPU_BACKEND_DEFAULT_M)
                continue
            raise ValueError(
                f"experts_on='hybrid' needs this machine's copy and CPU times for experts {k}: "
                "run `psr bench machine` for this shape and format, or pass hybrid_m="
            )
        assert profile is not None
        caps.append(choose_inserts(M, top_k, c.copy_s, profile.cpu_fixed_s, c.cpu_expert_s))
    return caps


# ------------------------------------------------------------------ prefill (issue 36)

# No measured costs for a layer's experts: prefill copies every expert it uses (CUDA) or
# reads every one from the host rows (the CPU backend, which copies nothing anyway).
DEFAULT_PREFILL_CPU_BELOW = 0


def prefill_threshold(copy_s: float, cpu_expert_s: float) -> int:
    """The tokens per expert below which computing an expert on the CPU from its host row
    is cheaper than copying it: the smallest t with t * cpu_expert_s >= copy_s (the CPU
    kernels read the row once per token, so t tokens cost t times one; ties go to the
    copy, which also leaves the expert in a slot). 1: never on the CPU."""
    for name, v in (("copy_s", copy_s), ("cpu_expert_s", cpu_expert_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"prefill_threshold: {name} must be a finite time >= 0, got {v!r}")
    if cpu_expert_s <= 0:
        raise ValueError("prefill_threshold: cpu_expert_s must be > 0 (a measured CPU time)")
    t = max(1, math.ceil(copy_s / cpu_expert_s))
    while t > 1 and (t - 1) * cpu_expert_s >= copy_s:  # float ratios a hair above an int
        t -= 1
    return t


@dataclass(frozen=True)
class PrefillSplit:
    """Where a prefill chunk computes each expert it uses, per MoE layer: an expert
    chosen by fewer than `cpu_below[layer]` of the chunk's tokens on the CPU from its
    host row, every other one copied into a slot and computed on the device (0 or 1: all
    copied). Hashable: part of a model's configuration (the two paths round differently)."""

    cpu_below: tuple[int, ...]

    def __post_init__(self) -> None:
        for t in self.cpu_below:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"PrefillSplit: cpu_below {t!r} must be an int >= 0 (tokens)")

    @classmethod
    def off(cls, layers: int) -> PrefillSplit:
        """Every expert copied (the default without measured costs)."""
        return cls((DEFAULT_PREFILL_CPU_BELOW,) * layers)

    @property
    def active(self) -> bool:
        return any(t > 1 for t in self.cpu_below)

    def on_cpu(self, layer: int, tokens: int) -> bool:
        """Whether MoE layer `layer` computes an expert used by `tokens` tokens on the CPU."""
        return 0 < tokens < self.cpu_below[layer]


def prefill_split(profile: MachineProfile | None, keys: list[str]) -> PrefillSplit:
    """The split per MoE layer (`keys`: each layer's `shape_key`) from the profile's costs:
    `prefill_threshold(copy_s, cpu_expert_s)` where both were measured, else every expert
    copied (DEFAULT_PREFILL_CPU_BELOW: a guess could only slow prefill down)."""
    below = []
    for k in keys:
        c = None if profile is None else profile.shapes.get(k)
        if c is None or c.copy_s is None or c.cpu_expert_s <= 0:
            below.append(DEFAULT_PREFILL_CPU_BELOW)
        else:
            below.append(prefill_threshold(c.copy_s, c.cpu_expert_s))
    return PrefillSplit(tuple(below))
