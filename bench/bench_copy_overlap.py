"""Copy engine vs plain copy, and copy/compute overlap.

Script:          python bench/bench_copy_overlap.py [--backend cuda] [--repeats N]
pytest-benchmark: pytest bench/bench_copy_overlap.py --benchmark-enable
(`psr bench copy` runs the same benchmark with every option: shape, experts, slots, JSON.)
"""

from __future__ import annotations

import argparse

import pytest

from psr.eval.microbench import CopyOverlapBench, run_copy_overlap


@pytest.fixture(scope="module")
def bench() -> CopyOverlapBench:
    b = CopyOverlapBench()
    b.calibrate(0.02)
    return b


def test_copy_engine(benchmark, bench: CopyOverlapBench) -> None:
    benchmark(bench.copy_round)


def test_reference_copy(benchmark, bench: CopyOverlapBench) -> None:
    benchmark(bench.reference_round)


def test_compute_only(benchmark, bench: CopyOverlapBench) -> None:
    benchmark(bench.compute)


def test_copy_beside_compute(benchmark, bench: CopyOverlapBench) -> None:
    benchmark(bench.both_round)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="copy engine vs plain copy, copy/compute overlap")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default=None, help="store backend")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    # An OLMoE expert, 8 in the host store, 4 device slots: `psr bench copy`'s defaults.
    print(run_copy_overlap(backend=a.backend, repeats=a.repeats).table())
