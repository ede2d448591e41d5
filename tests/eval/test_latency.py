"""The latency model's two-stream schedule on hand-made traces, and traces from decoding."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.eval import modes
from psr.eval.harness import (
    EvalData,
    RunConfig,
    compare,
    measure_schedules,
    run_config,
    schedule_key,
    schedule_prompt,
)
from psr.eval.latency import PROFILES, Profile, calibrate, get_profile, simulate
from psr.eval.report import host_note, markdown_table
from psr.policy import make_policy
from psr.runtime.trace import Copy, HostOp, HostSchedule, LayerStep, Trace

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
    keys = ("tokens", "routed", "hits", "misses", "prefetches", "substituted")
    assert tuple(c[k] for k in keys) == tuple(s[k] for k in keys)
    assert all(len(st.slots) == 2 for tok in t.tokens for st in tok)
    t.save(tmp_path / "t.json")
    assert Trace.load(tmp_path / "t.json") == t
    r = simulate(t, "rtx4090")
    assert r.ms_per_token >= r.lower_bound_ms > 0


# --- the host-aware model ---------------------------------------------------------------
# Round host costs: every launch 0.1 ms, a sync 0.05 ms; store calls, Python and the
# routing kernels' GPU time free unless a test says otherwise.
H = replace(
    P,
    launch_us=100.0,
    triton_launch_us=100.0,
    sync_us=50.0,
    store_call_us=0.0,
    python_us_per_layer=0.0,
    device_python_us_per_layer=0.0,
    dense_python_us_per_layer=0.0,
    token_us=0.0,
    small_kernel_us=0.0,
)


def op(kind, what="", stream="compute"):
    return HostOp(kind, what, stream)


def sched(moe, last=None, dense=1.0, token=(), mode="device"):
    return HostSchedule(mode, list(moe), list(moe if last is None else last), dense, list(token))


FFN = op("launch", "_gate_up_kernel")
# The host-driven step: route, read the ids, copy, acquire, experts, release.
HOST_STEP = [
    op("launch", "mm"),
    op("sync", "tolist"),
    op("copy", "miss"),
    op("copy", "prefetch"),
    op("wait"),
    FFN,
    op("release"),
]
# The device step: the fused route/use/prefetch kernel, join, the gathers, the experts.
DEVICE_STEP = [
    op("launch", "_decode_kernel"),
    op("join"),
    op("gather", "miss"),
    op("gather", "prefetch", "side"),
    FFN,
]
DEVICE_LAST = [op("launch", "_decode_kernel"), op("join"), op("gather", "miss"), FFN]


def with_host(t, s):
    t.host = s
    return t


def test_host_false_and_unmeasured_traces_keep_the_host_free_model() -> None:
    traces = [
        trace([[step(0, [0]), step(1, [0])]]),
        trace([[step(0, [0], [(0, 0, 5, "miss")]), step(1, [0])]]),
        trace(
            [[step(0, [0]), step(1, [0])], [step(0, [0], [(1, 0, 9, "prefetch")]), step(1, [0])]]
        ),
    ]
    for t in traces:
        free = simulate(t, P)
        assert simulate(t, P, host=True) == free  # no schedule: host-free whatever asked
        assert free.host_model == "host-free" and free.host_ms == 0
        measured = with_host(copy.deepcopy(t), sched(HOST_STEP, mode="host"))
        assert simulate(measured, P) == free  # host=False ignores the schedule


def test_free_host_costs_give_the_host_free_figure() -> None:
    # With every host cost zero the host-driven schedule issues each copy when its layer
    # has routed and runs the experts after the acquire: the host-free model exactly.
    zero = replace(H, launch_us=0.0, triton_launch_us=0.0, sync_us=0.0)
    t = trace(
        [
            [step(0, [0], [(0, 0, 5, "miss"), (1, 0, 3, "prefetch")]), step(1, [0])],
            [step(0, [0], [(1, 1, 9, "prefetch")]), step(1, [1])],
        ]
    )
    free = simulate(t, P)
    aware = simulate(with_host(t, sched(HOST_STEP, mode="host", dense=0.0)), zero, host=True)
    assert aware.per_token_ms == pytest.approx(free.per_token_ms)
    assert aware.stall_ms == pytest.approx(free.stall_ms)
    assert aware.copy_ms == pytest.approx(free.copy_ms)


def test_device_bound_token_exposes_only_the_first_launch_and_the_read() -> None:
    # Dense launch issued at 0.1 (GPU 0.1-0.6); FFN launched at 0.2, runs 0.6-0.7; the
    # loop's read of the token waits for it: 0.75. The next token repeats from there.
    t = with_host(trace([[step(0, [0])]] * 2, layers=1), sched([FFN], token=[op("sync")]))
    r = simulate(t, H, host=True)
    assert r.per_token_ms == pytest.approx([0.75, 0.75])
    assert r.host_ms == pytest.approx(0.25)  # 2 launches + 1 sync
    assert r.compute_ms == pytest.approx(0.6)
    assert r.host_model == "host-aware(unit device: 100/100/50 µs)"


def test_host_bound_token_is_the_hosts_time() -> None:
    # 10 dense launches (0.1 ms host, 0.05 ms GPU each): the GPU finishes each before the
    # next is issued, last at 1.05; FFN launched at 1.1, done 1.2; read: 1.25.
    t = with_host(trace([[step(0, [0])]], layers=1), sched([FFN], dense=10, token=[op("sync")]))
    r = simulate(t, H, host=True)
    assert r.ms_per_token == pytest.approx(1.25)
    assert r.host_ms == pytest.approx(1.15)
    assert r.lower_bound_ms == pytest.approx(1.15)  # the host, not compute (0.6)
    assert simulate(t, H).ms_per_token == pytest.approx(0.6)  # host-free


def test_a_graph_costs_the_host_one_launch_and_the_read_per_token() -> None:
    # The host-bound token above as one graph: the GPU replays the 10 dense kernels and
    # the FFN back to back (0.5 + 0.1 ms) after one graph launch (0.01 ms) on top of the
    # loop's Python; the read waits for it. Graph mode needs the device step's schedule.
    g = replace(H, graph_launch_us=10.0, token_us=0.0)
    dev = sched([FFN], dense=10, token=[op("sync")])
    t = with_host(trace([[step(0, [0])]], layers=1), dev.as_graph())
    r = simulate(t, g, host=True)
    assert r.ms_per_token == pytest.approx(0.01 + 0.6 + 0.05)
    assert r.host_ms == pytest.approx(0.01 + 0.05)
    assert r.host_model == "host-aware(unit graph: 10/50 µs)"
    assert simulate(with_host(t, dev), g, host=True).ms_per_token > r.ms_per_token
    with pytest.raises(ValueError, match="only the device step is captured"):
        sched([FFN], mode="host").as_graph()


def test_a_sync_serialises_host_and_gpu() -> None:
    # Route launched at 0.2 (GPU queue busy until 0.6). Without a read the FFN is queued
    # at 0.3 and runs 0.6-0.7; with one the host waits to 0.6, reads to 0.65 and only
    # then launches the FFN (0.75-0.85): the GPU idles while the host works.
    t = trace([[step(0, [0])]], layers=1)
    route = op("launch", "mm")
    assert simulate(with_host(t, sched([route, FFN])), H, host=True).ms_per_token == (
        pytest.approx(0.7)
    )
    r = simulate(with_host(t, sched([route, op("sync"), FFN], mode="host")), H, host=True)
    assert r.ms_per_token == pytest.approx(0.85)
    # A host-built tensor is a launch, then a read. Host-bound (10 dense launches, the
    # route launched at 1.1 and done then): a read ends at 1.15, FFN 1.25-1.35; an h2d
    # launches first (to 1.2), reads to 1.25, FFN 1.35-1.45.
    busy = [route, op("sync"), FFN]
    r = simulate(with_host(t, sched(busy, dense=10, mode="host")), H, host=True)
    assert r.ms_per_token == pytest.approx(1.35)
    busy[1] = op("h2d")
    r = simulate(with_host(t, sched(busy, dense=10, mode="host")), H, host=True)
    assert r.ms_per_token == pytest.approx(1.45)


def test_a_miss_copy_starts_after_the_hosts_read() -> None:
    # The read ends at 0.65: the copy runs 0.65-1.65 (the host-free model starts it at
    # 0.5); the acquire holds the FFN launched at 0.75 until 1.65: done 1.75.
    t = trace([[step(0, [0], [(0, 0, 5, "miss")])]], layers=1)
    r = simulate(with_host(t, sched(HOST_STEP, mode="host")), H, host=True)
    assert r.ms_per_token == pytest.approx(1.75)
    assert r.stall_ms == pytest.approx(1.0)
    assert simulate(t, H).ms_per_token == pytest.approx(1.6)


def test_store_calls_and_python_are_host_time() -> None:
    # 0.04 ms per store call (copy, acquire, release) and 0.2 ms Python per layer (host
    # step), 0.1 ms per token of loop: all host time, none of it GPU time.
    costly = replace(H, store_call_us=40.0, python_us_per_layer=200.0, token_us=100.0)
    t = with_host(
        trace([[step(0, [0], [(0, 0, 5, "miss")])]], layers=1), sched(HOST_STEP, mode="host")
    )
    r = simulate(t, costly, host=True)
    # launches 0.3 (dense, route, FFN), read 0.05, 3 store calls 0.12, Python 0.2, loop 0.1
    assert r.host_ms == pytest.approx(0.3 + 0.05 + 0.12 + 0.2 + 0.1)
    assert r.compute_ms == pytest.approx(0.6)
    # The device step's Python is its own figure.
    dev = replace(costly, device_python_us_per_layer=0.0)
    assert simulate(t, dev, host=True).host_ms == pytest.approx(r.host_ms)
    t.host.mode = "device"
    assert simulate(t, dev, host=True).host_ms == pytest.approx(r.host_ms - 0.2)


def test_a_side_stream_prefetch_overlaps_the_ffn() -> None:
    # Layer 0: dense issued at 0.1 (GPU to 0.6); its side gather forks after everything
    # queued (0.6): the prefetch into layer 1 copies 0.6-1.6 while layer 0's FFN runs
    # (0.6-0.7) and layer 1's dense (0.7-1.2). Layer 1 joins: stall 1.2-1.6; FFN to 1.7.
    t = trace([[step(0, [0], [(1, 0, 3, "prefetch")]), step(1, [0])]])
    r = simulate(with_host(t, sched(DEVICE_STEP, DEVICE_LAST)), H, host=True)
    assert r.ms_per_token == pytest.approx(1.7)
    assert r.stall_ms == pytest.approx(0.4)
    assert r.copy_ms == pytest.approx(1.0)
    assert simulate(t, H).ms_per_token == pytest.approx(1.6)  # host-free: issued at 0.5


def test_join_orders_the_compute_streams_miss_gather_after_the_side_stream() -> None:
    # As above, and layer 1 also misses: joined at 1.6, its miss gathers inline 1.6-2.6,
    # FFN (2 experts) to 2.8. Were the join after the gather, the gather would run 1.3-2.3
    # beside the side stream's copy and the FFN end at 2.5: the schedule's order decides.
    t = trace(
        [[step(0, [0, 1], [(1, 0, 3, "prefetch")]), step(1, [0, 1], [(1, 1, 4, "miss")])]], k=2
    )
    r = simulate(with_host(t, sched(DEVICE_STEP, DEVICE_LAST)), H, host=True)
    # layer 0: FFN 0.6-0.8; layer 1 dense 0.8-1.3; join to 1.6 (stall 0.3), miss 1.6-2.6.
    assert r.ms_per_token == pytest.approx(2.8)
    assert r.stall_ms == pytest.approx(0.3 + 1.0)
    late_join = [op("launch", "_decode_kernel"), op("gather", "miss"), op("join"), FFN]
    r2 = simulate(with_host(t, sched(DEVICE_STEP, late_join)), H, host=True)
    assert r2.ms_per_token == pytest.approx(2.5)


def test_the_last_moe_layer_uses_its_own_ops() -> None:
    # dense launches free (0 per layer): layer 0's FFN at 0.1 runs 0.5-0.6, layer 1's
    # dense 0.6-1.1; the last layer reads first (to 1.15), its FFN launched at 1.25: 1.35.
    t = trace([[step(0, [0]), step(1, [0])]])
    r = simulate(with_host(t, sched([FFN], [op("sync"), FFN], dense=0.0)), H, host=True)
    assert r.ms_per_token == pytest.approx(1.35)
    same = simulate(with_host(t, sched([FFN], [FFN], dense=0.0)), H, host=True)
    assert same.ms_per_token == pytest.approx(1.2)


def test_host_schedule_errors_name_the_problem() -> None:
    t = trace([[step(0, [0], [(1, 0, 3, "prefetch")]), step(1, [0])]])
    with pytest.raises(ValueError, match="issues no prefetch copies at MoE layer 0"):
        simulate(with_host(t, sched(DEVICE_LAST)), H, host=True)
    with pytest.raises(ValueError, match="op kind 'fence' is not one of"):
        simulate(with_host(t, sched([op("fence")])), H, host=True)
    with pytest.raises(ValueError, match="host schedule token: op kind 'wait'"):
        simulate(with_host(t, sched(DEVICE_STEP, token=[op("wait")])), H, host=True)
    spec = trace([[step(0, [0]), step(1, [0])]])
    spec.emitted = [2]
    with pytest.raises(ValueError, match="verify blocks need a schedule measured from verify"):
        simulate(with_host(spec, sched([FFN])), H, host=True)


def test_a_schedule_measured_without_copies_still_issues_them_at_the_acquire() -> None:
    # The measured token had no miss: no copy op; the trace's miss is issued by the acquire
    # (after the read at 0.65): the same time as an explicit copy op there.
    t = trace([[step(0, [0], [(0, 0, 5, "miss")])]], layers=1)
    no_copy = [o for o in HOST_STEP if o.kind != "copy"]
    r = simulate(with_host(t, sched(no_copy, mode="host")), H, host=True)
    assert r.ms_per_token == pytest.approx(1.75)


def test_calibrate_takes_measured_host_figures() -> None:
    cal = calibrate("gpu", {"launch_us": 4.5, "sync_us": 20.0, "dense_ms_per_layer": 0.1})
    assert (cal.launch_us, cal.sync_us, cal.triton_launch_us) == (4.5, 20.0, 9.0)
    assert cal.host_label("device") == "host-aware(gpu device: 4.5/9/20 µs)"
    assert "host measured: launch_us, sync_us" in cal.notes
    with pytest.raises(ValueError, match=r"unknown measured figure\(s\) launch_ms"):
        calibrate("gpu", {"launch_ms": 0.005})
    with pytest.raises(ValueError, match="sync_us must be a number >= 0"):
        calibrate("gpu", {"sync_us": -1.0})


def test_tables_print_both_host_models() -> None:
    def result(policy, ms, aware=None):
        r = {
            "config": {"policy": policy, "residency": 0.5},
            "label": policy,
            "stats": {"misses_per_token": 1.0, "hit_rate": 0.5, "prefetches": 0},
            "latency": {p: {"ms_per_token": ms} for p in ("rtx4090", "h200")},
            "generated": [],
            "nll_items": [],
            "cloze_items": [],
        }
        if aware is not None:
            label = "host-aware({} device: 6/9/13 µs)"
            r["latency_host"] = {
                p: {"ms_per_token": aware, "host_model": label.format(p)}
                for p in ("rtx4090", "h200")
            }
        return r

    rs = [result("exact", 4.0, 5.0), result("psr", 2.0, 4.0)]
    compare(rs)
    assert rs[1]["speedup"]["h200"] == pytest.approx(2.0)
    assert rs[1]["speedup_host"]["h200"] == pytest.approx(1.25)
    md = markdown_table(rs).splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    assert head[5:11] == [
        "rtx4090 ms/tok (host-free)",
        "h200 ms/tok (host-free)",
        "rtx4090 ms/tok (host-aware)",
        "h200 ms/tok (host-aware)",
        "speedup (rtx4090, host-free)",
        "speedup (rtx4090, host-aware)",
    ]
    psr_row = [c.strip() for c in md[3].strip("|").split("|")]
    assert psr_row[5:11] == ["2.00", "2.00", "4.00", "4.00", "2.00x", "1.25x"]
    note = host_note(rs)
    assert "host-aware(h200 device: 6/9/13 µs)" in note and "host-free" in note
    # Without host-aware results the table says its figures are host-free, and no more.
    plain = markdown_table([result("exact", 4.0)]).splitlines()[0]
    assert "(host-aware)" not in plain and "rtx4090 ms/tok (host-free)" in plain
    assert host_note([result("exact", 4.0)]) == ""


def test_harness_measures_the_deployed_schedule_and_models_both_ways(tmp_path) -> None:
    # The tests run Triton's interpreter: the schedules are the Triton path's, in process.
    path = str(write_checkpoint(tiny_model("olmoe"), tmp_path / "m"))
    data = EvalData(windows=[[(7 * i) % 60 + 1 for i in range(30)]], prompt_len=10)
    exact, steer = RunConfig(make_policy("exact"), 0.5), RunConfig(make_policy("psr", 0.3, 1), 0.5)
    scheds = measure_schedules(path, [exact, steer], schedule_prompt(data))
    # The device step: one fused routing kernel, gathers, join; psr's prefetch gathers on
    # the side stream into the next layer, exact's not; no host read in the MoE path.
    for rc, side in ((exact, False), (steer, True)):
        s = scheds[rc]
        assert s.mode == "device"
        kinds = [o.kind for o in s.moe_layer]
        assert "sync" not in kinds and "h2d" not in kinds
        assert any(o.what == "_decode_kernel" for o in s.moe_layer)
        assert any(o.kind == "gather" and o.stream == "side" for o in s.moe_layer) is side
        assert not any(o.stream == "side" for o in s.last_moe_layer)
    # One measurement serves configurations whose step makes the same calls: in the device
    # step lam's value, zero or not, changes none (schedule_key).
    prior = RunConfig(make_policy("cache-prior", 0.2), 0.25)
    assert schedule_key(prior) == schedule_key(exact)
    assert measure_schedules(path, [prior], schedule_prompt(data))[prior] == scheds[exact]
    assert schedule_key(prior, "host") != schedule_key(exact, "host")  # a host-built mask
    res = [run_config(path, rc, data, schedule=scheds[rc]) for rc in (exact, steer)]
    compare(res)
    for rc, r in zip((exact, steer), res, strict=True):
        assert r["trace"].host is scheds[rc]
        for p in ("rtx4090", "h200"):
            free, aware = r["latency"][p], r["latency_host"][p]
            assert free["host_model"] == "host-free"
            assert aware["host_model"].startswith(f"host-aware({p} device: ")
            assert aware["tokens"] == free["tokens"] == 20
            assert aware["host_ms"] > 0 and aware["ms_per_token"] >= aware["lower_bound_ms"]
        # The h200's dense work is shorter than launching it: the host decides.
        assert r["latency_host"]["h200"]["ms_per_token"] > r["latency"]["h200"]["ms_per_token"]
    assert res[1]["speedup_host"]["h200"] == pytest.approx(
        res[0]["latency_host"]["h200"]["ms_per_token"]
        / res[1]["latency_host"]["h200"]["ms_per_token"]
    )
    # The schedule travels with the trace: a saved trace replays to the same figures.
    res[1]["trace"].save(tmp_path / "t.json")
    back = Trace.load(tmp_path / "t.json")
    assert simulate(back, "h200", host=True).as_dict() == res[1]["latency_host"]["h200"]
    # The graph figure beside the eager one (the device step captured).
    for r in res:
        assert set(r["latency_graph"]) == {"rtx4090", "h200"}
        assert r["speedup_graph"]["h200"] > 0
    # Exact routing keeps each window's caches: replayed uncapped, they give back the
    # recorded trace exactly; cpu / hybrid replays and their table follow (eval/modes.py).
    ms = res[0]["mode_starts"]
    assert "mode_starts" not in res[1]  # psr routes by the cache: no replay
    assert ms["window"] == 20 and len(ms["starts"]) == 1
    t = res[0]["trace"]
    assert modes.replay(t, ms["starts"], ms["window"], ms["capacity"], ms["num_experts"], None) == t
    cpu = modes.MODE_TRACES(res[0], "rtx4090")["cpu"]
    # cpu mode copies no miss: every miss is a CPU expert (Trace.counts counts both).
    assert not any(c.kind == "miss" for k in cpu.tokens for s in k for c in s.copies)
    assert cpu.counts()["misses"] == cpu.counts()["cpu_experts"] > 0
    text = modes.modes_appendix(res, ("rtx4090", "h200"))
    assert text.count("| rtx4090 |") == 3 and text.count("| h200 |") == 3
    assert "exact routing only" in text and "assumptions: rtx4090: CPU 50 GB/s" in text
