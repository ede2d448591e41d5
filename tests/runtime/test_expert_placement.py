"""`make_placement`: one class per `experts_on`, its caps checked (the behaviour of each
placement is tested end to end in test_experts_on.py)."""

from __future__ import annotations

import pytest

from psr.runtime.expert_placement import (
    PLACEMENTS,
    CpuPlacement,
    GpuPlacement,
    HybridPlacement,
    make_placement,
)
from psr.vocab import EXPERTS_ON


def test_one_class_per_mode_and_what_it_says() -> None:
    assert set(PLACEMENTS) == set(EXPERTS_ON)
    gpu = make_placement("gpu", [None, 2], top_k=2, num_layers=2)
    cpu = make_placement("cpu", [0, 0], top_k=2, num_layers=2)
    hybrid = make_placement("hybrid", [1, 2], top_k=2, num_layers=2)
    assert type(gpu) is GpuPlacement and type(cpu) is CpuPlacement
    assert type(hybrid) is HybridPlacement
    assert [p.name for p in (gpu, cpu, hybrid)] == ["gpu", "cpu", "hybrid"]
    assert [p.capped for p in (gpu, cpu, hybrid)] == [False, True, True]
    assert gpu.caps == [None, None]  # gpu copies every miss, whatever caps it was given
    assert [hybrid.max_inserts(i) for i in range(2)] == [1, 2]
    assert cpu.max_inserts(1) == 0


@pytest.mark.parametrize(
    ("mode", "caps", "error"),
    [
        ("tpu", [0], "experts_on must be one of gpu, cpu, hybrid; got 'tpu'"),
        ("cpu", [0, 0], "2 miss-copy caps for 1 MoE layers"),
        ("hybrid", [3], "experts_on='hybrid': MoE layer 0's miss-copy cap 3 must be an int in"),
        ("cpu", [None], "experts_on='cpu': MoE layer 0's miss-copy cap None must be an int in"),
        ("hybrid", [True], "experts_on='hybrid': MoE layer 0's miss-copy cap True must be an"),
        ("gpu", [-1], "experts_on='gpu': MoE layer 0's miss-copy cap -1 must be an int"),
    ],
)
def test_bad_caps_are_refused(mode: str, caps: list, error: str) -> None:
    with pytest.raises(ValueError, match="^" + error.replace("(", r"\(")):
        make_placement(mode, caps, top_k=2, num_layers=1)
