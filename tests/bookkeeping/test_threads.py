"""psr.machine's thread count (issue 42): the physical cores of the affinity mask by
default (SMT siblings once), $PSR_THREADS / $OMP_NUM_THREADS / an explicit value otherwise,
and too many a one-line error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from psr import machine


def _sysfs(root: Path, topo: dict[int, tuple[int, int]]) -> Path:
    """A fake /sys/devices/system/cpu: cpu N -> (package, core)."""
    for cpu, (pkg, core) in topo.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{pkg}\n")
        (d / "core_id").write_text(f"{core}\n")
    return root


def test_smt_siblings_count_once_and_only_allowed_cpus_count(tmp_path) -> None:
    # 2 packages x 2 cores x 2 SMT threads: cpus 0-3 on package 0, 4-7 on package 1.
    topo = {c: (c // 4, (c // 2) % 2) for c in range(8)}
    root = _sysfs(tmp_path, topo)
    assert machine.physical_cores(list(range(8)), root) == 4
    assert machine.physical_cores([0, 1], root) == 1  # two siblings of one core
    assert machine.physical_cores([0, 2, 4], root) == 3  # core ids repeat across packages
    assert machine.physical_cores([0, 9], root) == 2  # no topology for cpu9: logical count


def test_resolve_threads_order_and_errors(monkeypatch) -> None:
    monkeypatch.delenv("PSR_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert machine.resolve_threads(None) == machine.physical_cores()
    monkeypatch.setattr(machine, "physical_cores", lambda *a: 1)  # the default follows it
    assert machine.resolve_threads(None) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(cpus))
    assert machine.resolve_threads(None) == cpus
    monkeypatch.setenv("PSR_THREADS", "1")  # PSR_THREADS before OMP_NUM_THREADS
    assert machine.resolve_threads(None) == 1
    assert machine.resolve_threads(cpus) == cpus  # the argument before both
    with pytest.raises(ValueError, match=rf"^threads={cpus + 1}: only {cpus} CPUs are avail"):
        machine.resolve_threads(cpus + 1)
    with pytest.raises(ValueError, match=r"^threads=0: expected an integer >= 1$"):
        machine.resolve_threads(0)
    monkeypatch.setenv("PSR_THREADS", "two")
    with pytest.raises(ValueError, match=r"^\$PSR_THREADS='two': expected an integer >= 1$"):
        machine.resolve_threads(None)
