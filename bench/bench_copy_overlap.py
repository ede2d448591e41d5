"""Copy engine vs plain copy, and copy/compute overlap.

Script:          python bench/bench_copy_overlap.py [--backend cuda]
pytest-benchmark: pytest bench/bench_copy_overlap.py --benchmark-enable
"""

from __future__ import annotations

import sys

import pytest

from psr.cli import main
from psr.eval.microbench import CopyOverlapBench


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
    sys.exit(main(["bench", "copy", *sys.argv[1:]]))
