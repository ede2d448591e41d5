"""psr.eval.ttft, the modeled time to first token (issue 36 item 5): the expected union of
uniform routing against enumeration, a one-layer case worked out by hand for every
schedule, the second turn's resume point, the recorded union, the CPU split's expected
counts against enumeration, and the report."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from psr.eval import ttft
from psr.eval.latency import PROFILES


def test_uniform_union_against_enumeration() -> None:
    E, k = 5, 2
    sets = list(itertools.combinations(range(E), k))
    for n in (1, 2, 3):
        mean = sum(len(set().union(*c)) for c in itertools.product(sets, repeat=n))
        mean /= len(sets) ** n
        assert ttft.uniform_union(E, k)(n) == pytest.approx(mean)


def _unit() -> tuple[ttft.MoEShape, object]:
    # one MoE layer of 2 experts, top-2: every chunk uses both (u = 2); 3 MB experts
    shape = ttft.MoEShape("unit", 1, 2, 2, 1000, 1000, 8, "int8", 0.0, 0)
    prof = replace(
        PROFILES["rtx4090"], h2d_gbps=3.0, copy_overhead_us=0.0, hbm_gbps=3000.0,
        expert_overhead_us=0.0, dense_ms_per_layer=0.5, cpu_gbps=3.0, cpu_expert_us=0.0,
    )  # fmt: skip
    return shape, prof


def test_one_layer_worked_by_hand() -> None:
    shape, prof = _unit()
    r = ttft.model_ttft(shape, prof, 20, chunk=10)
    # a copy 1 ms; an expert's compute: max(2 x 1 us read, 6e6 x 20 flops / (165.2e12 x
    # 0.5)) = 2 us over 2 experts, 1 us each; dense 0.5 ms (no dense flops).
    # per chunk: 0.5 + (1 + 1 x max(1, 0.001) + 0.001) ms = 2.501 ms; two chunks
    assert r.today_s == pytest.approx(2 * 2.501e-3)
    assert r.threshold == 1 and r.split_s == r.today_s  # a token on the CPU costs a copy
    assert r.copy_s == pytest.approx(2e-3) and r.compute_s == pytest.approx(2 * 0.502e-3)
    assert r.bound_s == pytest.approx(2e-3)
    # prefetch: per chunk max(2 ms copies, 0.502 ms work) + 0.502 fill
    assert r.prefetch_s == pytest.approx(2 * 2.502e-3)
    # layer-major: copies once (2 ms) against 1.004 ms of work, plus the fill
    assert r.layer_s == pytest.approx(2e-3 + 1.004e-3)
    assert r.ratio == pytest.approx(5.002 / 2)


def test_the_cpu_split_takes_the_expected_few_token_experts() -> None:
    shape, prof = _unit()
    prof = replace(prof, cpu_gbps=12.0)  # a token on the CPU: 0.25 ms, threshold 4
    shape = replace(shape, experts=4, top_k=1)
    r = ttft.model_ttft(shape, prof, 3, chunk=3)
    assert r.threshold == 4
    # 3 tokens each on one of 4 experts: every used expert has < 4 tokens: all on the CPU
    assert r.split_s == pytest.approx(0.5e-3 + prof.cpu_layer_us * 1e-6 + 3 * 0.25e-3)
    # the expected CPU experts against enumeration
    c = ttft.Costs.of(shape, prof)
    st = ttft._stage(shape, c, 0, 3, ttft.uniform_union(4, 1)(3), True)
    assert st.cpu == pytest.approx(c.cpu_fixed + 3 * c.cpu_token)
    assert math.isclose(sum(ttft.binom_pmf(3, 0.25, j) for j in range(4)), 1.0)


def test_second_turn_resumes_from_the_last_boundary() -> None:
    r = ttft.second_turn("olmoe-1b-7b", "rtx4090", 1000, chunk=512)
    assert (r.context, r.prompt) == (512, 588)
    r = ttft.second_turn("olmoe-1b-7b", "rtx4090", 1024, chunk=512)
    assert (r.context, r.prompt) == (1024, 100)
    first = ttft.model_ttft("olmoe-1b-7b", "rtx4090", 16384)
    assert ttft.second_turn("olmoe-1b-7b", "rtx4090", 16384).today_s < first.today_s / 10


def test_recorded_union_interpolates_and_holds() -> None:
    u = ttft.recorded_union({1: 8.0, 4: 20.0, 16: 50.0}, 64)
    assert u(1) == 8.0 and u(2) == pytest.approx(12.0) and u(16) == 50.0 and u(999) == 50.0
    with pytest.raises(ValueError, match="recorded_union"):
        ttft.recorded_union({}, 64)


def test_report_goal_and_bad_input() -> None:
    rows = ttft.ttft_rows(("rtx4090",), ("olmoe-1b-7b",), (512, 4096))
    g = ttft.goal(rows)
    # one chunk: copy-bound within the goal; 8 chunks each copying every expert: not
    assert rows[0]["ratio"] <= ttft.GOAL_RATIO < rows[1]["ratio"]
    assert not g["today_met"] and g["layer_major_met"]
    text = ttft.ttft_report()
    assert "2,091" in text and "RTX 5090" in text and "layer-major" in text
    with pytest.raises(ValueError, match="must be >= 1"):
        ttft.model_ttft("olmoe-1b-7b", "rtx4090", 0)
    with pytest.raises(ValueError, match="no GPU FLOP/s"):
        ttft.model_ttft("olmoe-1b-7b", replace(PROFILES["h200"], name="x"), 10)


def test_a_schedule_priced_by_hand() -> None:
    from psr.runtime.stream_plan import Event, LayerSchedule

    shape, prof = _unit()
    c = ttft.Costs.of(shape, prof)
    s = LayerSchedule(0, (10,))
    s.events = [Event("copy", 0, 0), Event("copy", 1, 1)]
    s.events += [Event("read", 0, 0, (10,)), Event("read", 1, 1, (4,))]
    # dense 0.5 ms; the copies issued then, 1 ms each on the link (done at 1.5, 2.5 ms);
    # each read waits for its copy and takes max(1 us HBM read, its flops) = 1 us
    t, copies, waits = ttft.price_schedules(shape, c, [(s, [0])])
    assert t == pytest.approx(2.501e-3) and copies == 2 and waits == 2


def test_built_schedules_copy_once_per_prompt_layer_major() -> None:
    sh = ttft.SHAPES["olmoe-1b-7b"]
    c = ttft.Costs.of(sh, PROFILES["rtx4090"])
    lm = ttft.built_schedules(sh, c, 2048, 512, True)
    cm = ttft.built_schedules(sh, c, 2048, 512, False)
    assert len(lm) == sh.moe_layers and len(cm) == 4 * sh.moe_layers
    # every expert used (uniform, 2048 tokens): read once per layer, crossing the link once
    # (a copy or a prefetch by an earlier layer; the last layer prefetches nothing)
    reads = [ev.expert for s, _ in lm for ev in s.events if ev.kind == "read"]
    assert len(reads) == sh.moe_layers * sh.experts
    t_lm, n_lm, _ = ttft.price_schedules(sh, c, lm)
    t_cm, n_cm, _ = ttft.price_schedules(sh, c, cm)
    assert n_lm == sh.moe_layers * sh.experts
    # chunk-major: each chunk's used set again, less what its slots still held (<= 16)
    assert 4 * n_lm - 4 * sh.moe_layers * 16 <= n_cm < 4 * n_lm
    bound = ttft.model_ttft(sh, PROFILES["rtx4090"], 2048).bound_s
    assert bound <= t_lm <= ttft.GOAL_RATIO * bound < t_cm
