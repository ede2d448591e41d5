"""The latency model's two-stream schedule on hand-made traces, and traces from decoding."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.eval.latency import PROFILES, Profile, calibrate, get_profile, simulate
from psr.runtime.trace import Copy, LayerStep, Trace

# Round numbers: copy 1.0 ms, expert 0.1 ms, dense 0.5 ms per layer.
P = Profile(
    "unit",
    h2d_gbps=1.0,
    copy_overhead_us=0.0,
    hbm_gbps=10.0,
    expert_overhead_us=0.0,
    dense_ms_per_layer=0.5,
    expert_bytes=1_000_000,
)


def step(layer, slots, copies=(), hits=0):
    return LayerStep(layer, list(slots), list(slots), hits, [Copy(*c) for c in copies])


def trace(tokens, layers=2, moe=None, k=1):
    return Trace(layers, list(range(layers)) if moe is None else moe, k, 1_000_000, "", tokens)


def test_all_hits_cost_only_compute() -> None:
    r = simulate(trace([[step(0, [0]), step(1, [0])]]), P)
    assert r.ms_per_token == pytest.approx(2 * 0.5 + 2 * 0.1)
    assert r.stall_ms == 0 and r.copy_ms == 0
    assert r.lower_bound_ms == pytest.approx(r.compute_ms)


def test_a_miss_is_on_the_critical_path() -> None:
    # Layer 0 misses (copy issued after its 0.5 ms dense part, done at 1.5 ms).
    r = simulate(trace([[step(0, [0], [(0, 0, 5, "miss")]), step(1, [0])]]), P)
    assert r.stall_ms == pytest.approx(1.0)
    assert r.ms_per_token == pytest.approx(0.5 + 1.0 + 0.1 + 0.5 + 0.1)
    assert r.copy_ms == pytest.approx(1.0)


def test_a_prefetch_overlaps_the_next_layers_dense_work() -> None:
    # Prefetch into layer 1 issued at 0.5 ms, done 1.5 ms; layer 1 needs it at 1.1 ms.
    t = trace([[step(0, [0], [(1, 0, 3, "prefetch")]), step(1, [0])]])
    r = simulate(t, P)
    assert r.stall_ms == pytest.approx(0.4)
    assert r.ms_per_token == pytest.approx(1.5 + 0.1)


def test_copy_stream_is_serial_and_in_issue_order() -> None:
    t = trace([[step(0, [0, 1], [(0, 0, 1, "miss"), (0, 1, 2, "miss")])]], layers=1, k=2)
    r = simulate(t, P)
    assert r.ms_per_token == pytest.approx(0.5 + 2.0 + 0.2)
    assert r.lower_bound_ms == pytest.approx(2.0)  # bytes / bandwidth dominates


def test_prefetch_into_a_slot_read_by_the_previous_token() -> None:
    # Token 0 ends at 1.2 ms, having read slot (1, 0). Token 1's layer 0 prefetches into
    # that slot: issued at 1.7 ms (after the reader finished), done 2.7; layer 1 needs it
    # at 2.3 ms -> 0.4 ms stall; token 1 = 2.8 - 1.2 = 1.6 ms.
    t = trace(
        [
            [step(0, [0]), step(1, [0])],
            [step(0, [0], [(1, 0, 9, "prefetch")]), step(1, [0])],
        ]
    )
    r = simulate(t, P)
    assert r.per_token_ms == pytest.approx([1.2, 1.6])
    assert r.stall_ms == pytest.approx(0.4 / 2)


def test_dense_layers_add_dense_time_only() -> None:
    t = Trace(3, [0, 2], 1, 1_000_000, "", [[step(0, [0]), step(1, [0])]])
    assert simulate(t, P).ms_per_token == pytest.approx(3 * 0.5 + 2 * 0.1)


def test_profiles_and_calibration(tmp_path) -> None:
    assert PROFILES["rtx4090"].copy_s() == pytest.approx(0.508e-3, rel=0.02)  # spec's 0.5 ms
    cal = calibrate(
        "measured",
        {"h2d_gbps": 40.0, "expert_ms": 0.01, "dense_ms_per_layer": 0.2, "expert_bytes": 2_000_000},
    )
    assert cal.copy_s() == pytest.approx(2e6 / 40e9)
    assert cal.expert_s() == pytest.approx(1e-5)
    cal.save(tmp_path / "p.json")
    assert get_profile(str(tmp_path / "p.json")) == cal
    with pytest.raises(ValueError, match="unknown profile 'tpu'"):
        get_profile("tpu")


def test_trace_from_decoding_matches_stats_and_round_trips(tmp_path) -> None:
    path = write_checkpoint(tiny_model("deepseek_v3"), tmp_path / "ds")
    model = psr.load(path, "psr", residency=0.5, lam=0.3, n=1, progress=False)
    rec = model.record_trace()
    model.generate([1, 2, 3, 4, 5, 6], max_new_tokens=6)
    t = rec.trace
    assert t.moe_layers == [1, 2, 3] and t.num_decoder_layers == 4
    c = t.counts()
    s = model.stats
    assert (c["tokens"], c["routed"], c["hits"], c["misses"], c["prefetches"]) == (
        s["tokens"],
        s["routed"],
        s["hits"],
        s["misses"],
        s["prefetches"],
    )
    assert all(len(st.slots) == 2 for tok in t.tokens for st in tok)
    t.save(tmp_path / "t.json")
    assert Trace.load(tmp_path / "t.json") == t
    r = simulate(t, "rtx4090")
    assert r.ms_per_token >= r.lower_bound_ms > 0
