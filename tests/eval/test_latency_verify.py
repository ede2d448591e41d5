"""The latency model on speculative verify blocks (issue 41): hand-computed small cases of
the host-free and host-aware schedules, and a recorded verify block's CPU rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import test_latency_cpu as cpu_case
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.eval.latency import simulate
from psr.runtime.speculative import generate_speculative
from psr.runtime.trace import Copy, HostOp, HostSchedule, LayerStep, Trace
from psr.runtime.verify import make_verify

# test_latency_cpu's round numbers (copy 1.0 ms, GPU expert 0.1 ms, dense 0.5 ms per
# layer, 0.1 ms CPU hand-off per layer; host: a launch 0.1 ms, a sync 0.05 ms), with a CPU
# that reads an expert in 0.5 ms and computes a token row of it in 0.1 ms.
CPU = {"cpu_gbps": 2.0, "cpu_gflops": 10.0, "expert_flops": 1_000_000}
V, H = replace(cpu_case.P, **CPU), replace(cpu_case.H, **CPU)


def block_trace() -> Trace:
    """One verify block over one MoE layer: its 4 tokens route to a union of 3 experts, 2
    read from slots (one a miss copied into slot 1), 1 on the CPU for 3 of the tokens;
    the block emitted 2 tokens."""
    step = LayerStep(0, [0, 1, 2], [0, 1], 1, [Copy(0, 1, 2, "miss")], cpu_experts=1, cpu_rows=3)
    return Trace(1, [0], 2, 1_000_000, "", [[step]], emitted=[2])


def test_cpu_experts_read_their_weights_once_for_the_block_rows() -> None:
    assert V.cpu_s(0) == 0.0
    assert V.cpu_s(2) == pytest.approx(0.1e-3 + 2 * 0.5e-3)  # one row each: the reads
    # 6 rows over 2 experts: still 2 reads (0.6 ms of FLOPs overlap them), not 6
    assert V.cpu_s(2, 6) == pytest.approx(0.1e-3 + 1.0e-3)
    assert V.cpu_s(1, 8) == pytest.approx(0.1e-3 + 0.8e-3)  # 8 rows of one: compute bound
    with pytest.raises(ValueError, match="1 CPU token rows for 2 CPU experts"):
        V.cpu_s(2, 1)


def test_host_free_verify_block_by_hand() -> None:
    # Drafter 0-0.2, dense 0.2-0.7; the CPU 0.7-1.3 (0.1 + max(0.5 read, 0.3 rows)); the
    # miss copies 0.7-1.7, the 2 slab experts 1.7-1.9: 1.9 ms for 2 emitted tokens.
    r = simulate(block_trace(), V, draft_s=0.2e-3)
    assert r.per_token_ms == pytest.approx([1.9])
    assert r.ms_per_token == pytest.approx(0.95)
    assert r.tokens == 2
    assert r.stall_ms == pytest.approx(0.5)
    assert r.compute_ms == pytest.approx(0.45)
    assert r.copy_ms == pytest.approx(0.5)
    assert r.cpu_ms == pytest.approx(0.3)


def op(kind: str, what: str = "") -> HostOp:
    return HostOp(kind, what)


# A verify block's recorded layer: route, read the ids, copy the misses, acquire, the
# slab's experts, release, then the CPU hand-off as a CPU machine records it (dropped).
VERIFY_LAYER = [
    op("launch", "mm"),
    op("sync", "tolist @ route"),
    op("copy", "miss"),
    op("wait"),
    op("launch", "_gate_up_kernel"),
    op("release"),
    op("sync", "cpu @ experts"),
    op("launch", "mm"),
]
# Between blocks: the target's choices read, one drafter launch.
VERIFY_LOOP = [op("launch", "argmax"), op("sync", "tolist @ loop"), op("launch", "mm")]


def test_host_aware_verify_block_by_hand() -> None:
    # Dense launch issued 0-0.1, runs 0.1-0.6; route launched to 0.2; the ids read at
    # 0.65; the miss copied 0.65-1.65 (compute waits); FFN launched at 0.75, runs
    # 1.65-1.85; the host reads the input for the CPU at 1.9, the CPU runs 1.9-2.5 with
    # the host waiting, the result's copy and sum launched to 2.7; the loop: argmax to
    # 2.8 (runs 2.8-2.9 with half the drafter's 0.2 ms), its read at 2.95, the drafter's
    # launch to 3.05 (runs 3.05-3.15): 3.15 ms for 2 emitted tokens.
    t = block_trace()
    t.host = HostSchedule("verify", VERIFY_LAYER, VERIFY_LAYER, 1.0, VERIFY_LOOP)
    r = simulate(t, H, draft_s=0.2e-3, host=True)
    assert r.per_token_ms == pytest.approx([3.15])
    assert r.ms_per_token == pytest.approx(1.575)
    assert r.stall_ms == pytest.approx(0.8)  # (1.0 copy + 0.6 CPU) / 2 tokens
    assert r.cpu_ms == pytest.approx(0.3)
    assert r.host_model.startswith("host-aware(unit verify")
    # The recorded CPU hand-off after the slab's release is not priced as launches.
    t.host = HostSchedule("verify", VERIFY_LAYER[:6], VERIFY_LAYER[:6], 1.0, VERIFY_LOOP)
    assert simulate(t, H, draft_s=0.2e-3, host=True).per_token_ms == pytest.approx([3.15])


def test_verify_and_decode_schedules_do_not_mix() -> None:
    t = block_trace()
    t.host = HostSchedule("host", VERIFY_LAYER, VERIFY_LAYER, 1.0, [])
    with pytest.raises(ValueError, match="verify blocks need a schedule measured from verify"):
        simulate(t, H, host=True)
    t.host = HostSchedule("verify", VERIFY_LAYER[:4], VERIFY_LAYER[:4], 1.0, [])
    with pytest.raises(ValueError, match="no slab read"):
        simulate(t, H, host=True)
    ar = Trace(1, [0], 2, 1_000_000, "", [[LayerStep(0, [0], [0], 1)]])
    ar.host = HostSchedule("verify", VERIFY_LAYER, VERIFY_LAYER, 1.0, [])
    with pytest.raises(ValueError, match="trace of decode tokens with a 'verify'"):
        simulate(ar, H, host=True)


def test_a_recorded_verify_block_counts_its_cpu_rows(tmp_path, monkeypatch) -> None:
    """Exact routing, nothing copied (cpu:0): each layer step's CPU rows are the block's
    token rows routed to the experts `use` left to the CPU (both captured as the block
    runs), between one and T per CPU expert."""
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    m = psr.load(path, "exact", residency=0.25, progress=False)
    rt = m.runtime
    rule = make_verify("cpu:0", None, rt.spec.top_k, rt.capacity, rt.placement)
    rec = m.record_trace()
    sizes: list[int] = []
    routed: list[torch.Tensor] = []  # each layer step's ids [T, k], in order
    left: list[list[int]] = []  # each layer step's experts left to the CPU
    select, use = type(rule).select, type(rt.book).use

    def spy_select(self, *a, **kw):
        w, ids = select(self, *a, **kw)
        routed.append(ids.clone())
        return w, ids

    def spy_use(self, *a, **kw):
        cpu = use(self, *a, **kw)
        left.append(list(cpu))
        return cpu

    monkeypatch.setattr(type(rule), "select", spy_select)
    monkeypatch.setattr(type(rt.book), "use", spy_use)

    class Drafts:
        kind, block, memory_bytes = "fixed", 3, 0

        def reset(self) -> None:
            pass

        def propose(self, tokens, hidden):
            return [(tokens[-1] * 7 + i) % 50 for i in range(3)]

    generate_speculative(
        m.hf, rt, Drafts(), torch.tensor([[1, 5, 9, 13]]), 8, rule,
        on_block=lambda t, e: (sizes.append(t), rec.trace.emitted.append(e)),
    )  # fmt: skip
    steps = [ls for block in rec.trace.tokens for ls in block]
    assert len(steps) == len(routed) == len(left) == len(sizes) * len(rt.layers)
    for i, ls in enumerate(steps):
        T = sizes[i // len(rt.layers)]
        want = sum(int((routed[i] == e).sum()) for e in left[i])
        assert ls.cpu_rows == want and ls.cpu_experts == len(left[i])
        assert ls.cpu_experts <= ls.cpu_rows <= T * ls.cpu_experts
    assert sum(ls.cpu_rows for ls in steps) > sum(ls.cpu_experts for ls in steps) > 0
    assert simulate(rec.trace, "rtx4090").ms_per_token > 0
    m.close()
