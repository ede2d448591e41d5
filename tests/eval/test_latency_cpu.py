"""The CPU as a latency-model resource, the graph figure and first token, the measured host
costs, and the gpu / cpu / hybrid replay and table (eval/modes.py): hand-computed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.eval import modes
from psr.eval.host_probe import measure_host_costs
from psr.eval.latency import MEASURED_HOST, PROFILES, Profile, simulate
from psr.runtime.trace import Copy, HostOp, HostSchedule, LayerStep, Trace

ROOT = Path(__file__).resolve().parents[2]
# Copy 1.0 ms, GPU expert 0.1 ms, dense 0.5 ms per layer; a CPU expert 1.0 ms (1 MB at
# 1 GB/s), 0.1 ms per layer hand-off.
P = Profile(
    "unit",
    h2d_gbps=1.0,
    copy_overhead_us=0.0,
    hbm_gbps=10.0,
    expert_overhead_us=0.0,
    dense_ms_per_layer=0.5,
    expert_bytes=1_000_000,
    cpu_gbps=1.0,
    cpu_layer_us=100.0,
    cpu_expert_us=0.0,
)
# Host costs: a launch 0.1 ms, a sync 0.05 ms, the rest free.
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
    begin_us=0.0,
)
FFN = HostOp("launch", "_gate_up_kernel")


def one(step: LayerStep, tokens: int = 1) -> Trace:
    return Trace(1, [0], 2, P.expert_bytes, tokens=[[step] for _ in range(tokens)])


def test_host_free_cpu_experts_run_beside_the_gpus_and_the_layer_waits_for_both() -> None:
    # Dense to 0.5; the CPU from 0.5: 0.1 + 1.0 -> 1.6; the GPU's two experts 0.5-0.7;
    # the output merges at 1.6 (0.9 ms waiting on the CPU).
    r = simulate(one(LayerStep(0, [0, 1, 2], [0, 1], 2, cpu_experts=1)), P)
    assert r.ms_per_token == pytest.approx(1.6)
    assert (r.cpu_ms, r.compute_ms, r.stall_ms) == pytest.approx((1.1, 0.7, 0.9))
    assert r.lower_bound_ms == pytest.approx(1.1)
    # A fast CPU (0.11 ms) hides under the GPU's 0.2 ms: no wait.
    fast = simulate(
        one(LayerStep(0, [0, 1, 2], [0, 1], 2, cpu_experts=1)), replace(P, cpu_gbps=100)
    )
    assert fast.ms_per_token == pytest.approx(0.7)
    assert fast.stall_ms == 0.0
    # No CPU experts: the GPU-only figure (three experts on the GPU).
    assert simulate(one(LayerStep(0, [0, 1, 2], [0, 1, 2], 3)), P).ms_per_token == pytest.approx(
        0.8
    )
    with pytest.raises(ValueError, match="cpu_experts 4 is not in"):
        simulate(one(LayerStep(0, [0, 1, 2], [0], 0, cpu_experts=4)), P)


def test_host_aware_cpu_starts_when_the_stream_has_routed() -> None:
    # Dense launch 0-0.1 (GPU to 0.6); route launch to 0.2 (no GPU time); the join finds
    # the stream routed at 0.6: the CPU runs 0.6-1.7; the FFN (launched at 0.3) runs
    # 0.6-0.7, then the stream waits for the CPU to 1.7; the token's read: 1.75.
    sched = HostSchedule(
        "device",
        [HostOp("launch", "_decode_kernel"), HostOp("join"), FFN],
        [HostOp("launch", "_decode_kernel"), HostOp("join"), FFN],
        1.0,
        [HostOp("sync")],
    )
    t = replace(one(LayerStep(0, [0, 1], [0], 1, cpu_experts=1)), host=sched)
    r = simulate(t, H, host=True)
    assert r.ms_per_token == pytest.approx(1.75)
    assert (r.cpu_ms, r.stall_ms) == pytest.approx((1.1, 1.0))


def test_graph_figure_and_the_first_token() -> None:
    sched = HostSchedule("device", [FFN], [FFN], 10.0, [HostOp("sync")])
    t = replace(one(LayerStep(0, [0], [0], 1), tokens=2), host=sched)
    g = replace(H, graph_launch_us=10.0, begin_us=200.0)
    eager = simulate(t, g, host=True)
    graph = simulate(t, g, host=True, graph=True)
    # The graph replay: one launch (0.01 ms), the 10 dense kernels and the FFN back to
    # back (0.6 ms), the read (0.05 ms); eager: 11 launches host-bound (1.25 ms).
    assert graph.ms_per_token == pytest.approx(0.66)
    assert eager.ms_per_token == pytest.approx(1.25)
    assert graph.ms_per_token == pytest.approx(
        simulate(replace(t, host=sched.as_graph()), g, host=True).ms_per_token
    )
    # A sequence's first token: the hand-over, then the eager token (graphs too).
    assert eager.first_token_ms == pytest.approx(0.2 + 1.25)
    assert graph.first_token_ms == pytest.approx(eager.first_token_ms)
    with pytest.raises(ValueError, match="pass host=True"):
        simulate(t, g, graph=True)


def test_model_python_per_decoder_layer_is_host_time() -> None:
    sched = HostSchedule("device", [FFN], [FFN], 1.0, [])
    t = replace(one(LayerStep(0, [0], [0], 1)), host=sched)
    base = simulate(t, H, host=True).host_ms
    assert simulate(t, replace(H, dense_python_us_per_layer=300.0), host=True).host_ms == (
        pytest.approx(base + 0.3)
    )


def test_old_traces_load_with_no_cpu_experts() -> None:
    d = one(LayerStep(0, [0], [0], 1)).to_json()
    for tok in d["tokens"]:
        for s in tok:
            del s["cpu_experts"], s["substituted"]
    assert Trace.from_json(d).tokens[0][0].cpu_experts == 0


def test_profiles_take_the_committed_host_measurement() -> None:
    d = json.loads((ROOT / "bench/results/host_path/host_costs.json").read_text())
    row = d["summary"]["psr"]
    got = {
        "device_python_us_per_layer": row["moe_layer_us"],
        "dense_python_us_per_layer": row["dense_layer_us"],
        "token_us": row["token_us"],
        "begin_us": row["begin_us"],
    }
    assert MEASURED_HOST == pytest.approx(got, abs=0.06)
    for p in PROFILES.values():
        assert p.device_python_us_per_layer == MEASURED_HOST["device_python_us_per_layer"]
        assert "launches stubbed" in p.notes and "CPU:" in p.notes


def test_measure_host_costs_times_the_stubbed_device_step(tmp_path) -> None:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    model = psr.load(path, "psr", 0.5, lam=0.5, n=2, compute="triton", progress=False)
    prompt = torch.tensor([[5, 17, 33, 2, 9, 41]])
    want = model.generate(prompt, max_new_tokens=4)
    c = measure_host_costs(model, prompt, new_tokens=3, repeats=1)
    assert c.step == "device"
    assert c.moe_layer_us > 0 and c.begin_us > 0 and c.raw["moe_aten_launches"] >= 1
    assert c.raw["forwards_timed"] == 1  # 3 new tokens: 2 decode forwards, less the first
    # Everything restored: the kernels run again and give the same tokens.
    assert torch.equal(model.generate(prompt, max_new_tokens=4), want)
    host = psr.load(path, "psr", 0.5, lam=0.5, n=2, decode="host", progress=False)
    with pytest.raises(ValueError, match="times the device step"):
        measure_host_costs(host, prompt)


# --- the replay ---------------------------------------------------------------------------
START = modes.CacheStart((0, 1), (0, 1), ((0, 0), (1, 1)))  # capacity 2 of 4 experts


def gpu_trace() -> Trace:
    """Routed [2, 0], [3, 2], [1, 3] from cache (0, 1): LRU by hand (a routed id is never
    evicted; routed ids become most recent, a lower id more recent)."""
    steps = [
        LayerStep(0, [2, 0], [1, 0], 1, [Copy(0, 1, 2, "miss")]),  # evicts 1 (slot 1)
        LayerStep(0, [3, 2], [0, 1], 1, [Copy(0, 0, 3, "miss")]),  # evicts 0 (slot 0)
        LayerStep(0, [1, 3], [1, 0], 1, [Copy(0, 1, 1, "miss")]),  # evicts 2 (slot 1)
    ]
    return Trace(1, [0], 2, P.expert_bytes, "exact", [[s] for s in steps])


def test_uncapped_replay_reproduces_the_gpu_trace() -> None:
    t = gpu_trace()
    assert modes.replay(t, [[START]], 3, 2, 4, None) == t


def test_cpu_replay_copies_nothing_and_keeps_misses_out_of_the_cache() -> None:
    r = modes.replay(gpu_trace(), [[START]], 3, 2, 4, 0)
    steps = [tok[0] for tok in r.tokens]
    assert [s.copies for s in steps] == [[], [], []]
    # t0: 0 hit, 2 on the CPU; t1: 3 and 2 both on the CPU; t2: 1 still cached, 3 CPU.
    assert [(s.hits, s.cpu_experts, s.slots) for s in steps] == [
        (1, 1, [0]),
        (0, 2, []),
        (1, 1, [1]),
    ]


def test_hybrid_copies_the_lowest_missing_ids_as_the_runtime_does() -> None:
    t = Trace(1, [0], 2, P.expert_bytes, "exact", [[LayerStep(0, [3, 2], [0, 1], 0)]])
    r = modes.replay(t, [[START]], 1, 2, 4, 1)
    s = r.tokens[0][0]
    # Expert 2 (the lower id) is copied, evicting 0 (least recent) from slot 0; 3 on the CPU.
    assert (s.copies, s.cpu_experts, s.slots, s.hits) == ([Copy(0, 0, 2, "miss")], 1, [0], 0)
    # The cap: copy 1.0 ms against CPU 0.1 + 1.0 ms per expert at k (1 - C / E) = 1 expected
    # miss of top-2 from 2 of 4 cached: copying it (1.0) beats computing it (1.1).
    assert modes.hybrid_cap(P, 2, 2, 4) == 1
    assert modes.hybrid_cap(replace(P, cpu_layer_us=0.0, cpu_gbps=P.cpu_gbps * 100), 2, 2, 4) == 0


def test_replay_refuses_prefetches_and_short_starts() -> None:
    t = gpu_trace()
    t.tokens[0][0].copies.append(Copy(0, 0, 1, "prefetch"))
    with pytest.raises(ValueError, match="without prefetches"):
        modes.replay(t, [[START]], 3, 2, 4, None)
    with pytest.raises(ValueError, match="do not cover"):
        modes.replay(gpu_trace(), [[START]], 2, 2, 4, None)


def test_modes_table_rows_and_assumptions() -> None:
    t = gpu_trace()
    by = {"rtx4090": modes.replay_modes(t, [[START]], 3, 2, 4, "rtx4090")}
    rows = modes.modes_rows(by)
    assert [r["mode"] for r in rows] == ["gpu", "cpu", "hybrid"]
    assert rows[0]["copies"] == 1.0 and rows[1]["copies"] == 0.0
    assert rows[1]["host_free"] == pytest.approx(
        simulate(by["rtx4090"]["cpu"], "rtx4090").ms_per_token
    )
    assert rows[1]["speedup"] == pytest.approx(rows[0]["host_free"] / rows[1]["host_free"])
    md = modes.modes_table(by)
    assert md.count("| rtx4090 |") == 3
    assert "assumptions: rtx4090: CPU 50 GB/s" in md


def test_a_pageable_copy_reads_before_it_copies() -> None:
    # Dense to 0.5; the miss copy 1.0 ms, from the pageable tier 0.2 ms more (1 MB at
    # 5 GB/s) first: ready at 1.7, the expert 1.7-1.8 (pinned: 1.6).
    c = Copy(0, 0, 5, "miss")
    t = one(LayerStep(0, [0], [0], 0, [c]))
    assert simulate(t, P).ms_per_token == pytest.approx(1.6)
    c.tier = "pageable"  # type: ignore[attr-defined]  # the field issue 28 adds
    r = simulate(t, replace(P, pageable_gbps=5.0))
    assert r.ms_per_token == pytest.approx(1.8)
    assert r.copy_ms == pytest.approx(1.2)
    c.tier = "nvme"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="tier 'nvme' is not"):
        simulate(t, P)
