"""psr.eval.host_probe: the host's work per decode token, as HostProbe logs it and as the
HostSchedule the latency model replays. The sync-free step's MoE layer is exactly the
router GEMV, the fused decode kernel, the join, the miss and prefetch gathers and the two
FFN kernels on the Triton path; the host-driven step reads, builds host tensors and
issues store copies; both share the dense part and the loop; schedules survive Trace
JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.eval.host_probe import HostProbe, measure_schedule, merge_ops, op_rates
from psr.runtime.trace import HostOp, HostSchedule, Trace
from psr.store import CopyReason, ExpertStore

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
EMBEDDED_PROMPT = torch.tensor([[5, 17, 33, 2, 9]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("host_path") / "olmoe")


def _model(which: str, tiny: Path, decode: str, compute: str) -> psr.OffloadedModel:
    if which == "tiny":
        return psr.load(
            tiny, "psr", 0.5, lam=0.5, n=2, decode=decode, compute=compute, progress=False
        )
    return psr.load(
        psr.DEFAULT_MODEL,
        "psr",
        0.5,
        lam=0.1,
        n=2,
        dtype="float32",
        decode=decode,
        compute=compute,
        progress=False,
    )


def _ops(ops: list[HostOp]) -> list[tuple[str, str, str]]:
    return [(o.kind, o.what, o.stream) for o in ops]


@pytest.mark.parametrize("which", ["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def test_device_and_host_schedules_on_the_triton_path(tiny, which) -> None:
    prompt = PROMPT if which == "tiny" else EMBEDDED_PROMPT
    dev = _model(which, tiny, "device", "triton")
    assert dev.runtime.ops.path == "triton"
    sd = measure_schedule(dev, prompt, new_tokens=3)
    ffn = [
        ("launch", "_gate_up_kernel", "compute"),
        ("launch", "_down_kernel", "compute"),
        ("launch", "_sum_experts_kernel", "compute"),  # SPLIT_K_DEFAULT: the experts' partials
    ]
    head = [("launch", "mm", "compute"), ("launch", "_decode_kernel", "compute")]
    assert sd.mode == "device"
    assert _ops(sd.moe_layer) == [
        *head,
        ("join", "", "compute"),
        ("gather", "miss", "compute"),
        ("gather", "prefetch", "side"),
        *ffn,
    ]
    assert _ops(sd.last_moe_layer) == [
        *head,
        ("join", "", "compute"),
        ("gather", "miss", "compute"),
        *ffn,
    ]

    host = _model(which, tiny, "host", "triton")
    sh = measure_schedule(host, prompt, new_tokens=4 if which == "tiny" else 3)
    kinds = [o.kind for o in sh.moe_layer]
    assert sh.mode == "host"
    assert kinds.count("sync") >= 3 and "h2d" in kinds  # mask, ids, prediction reads
    assert "copy" in kinds and kinds.index("wait") < kinds.index("release")
    assert {o.what for o in sh.moe_layer if o.kind == "copy"} <= {"miss", "prefetch"}
    assert not any(o.kind in ("gather", "join") for o in sh.moe_layer)

    # The dense part and the loop do not depend on the decode step, but for the device
    # step's one per-token copy of its counters (the per-token stats' snapshot).
    layers = dev.runtime.num_decoder_layers
    assert sd.dense_launches > 0
    assert sd.dense_launches * layers == pytest.approx(sh.dense_launches * layers + 1)
    for s in (sd, sh):
        assert [(o.kind, o.what.split(" @ ")[0]) for o in s.token] == [
            ("launch", "argmax"),
            ("launch", "cat"),
            ("sync", "__int__"),
        ]
        assert s.token[-1].what == "__int__ @ loop"  # named by where the probe is


def test_copies_carry_their_reason(tiny, monkeypatch) -> None:
    """Every store copy the runtime makes says why (CopyReason): the prefill's staging and
    seeding first, then the host step's misses and prefetches, as many experts of each as
    the stats count; a reason that is not a CopyReason is refused."""
    copied: list[tuple[CopyReason, int]] = []
    inner = ExpertStore.enqueue_copies

    def recording(self, layer, slots, experts, **kw):  # type: ignore[no-untyped-def]
        copied.append((kw["reason"], len(experts)))
        return inner(self, layer, slots, experts, **kw)

    model = psr.load(tiny, "psr", 0.5, lam=0.0, n=2, decode="host", progress=False)
    monkeypatch.setattr(ExpertStore, "enqueue_copies", recording)
    model.generate(PROMPT, max_new_tokens=4)
    reasons = [r for r, _ in copied]
    first = next(i for i, r in enumerate(reasons) if r != CopyReason.PREFILL)
    assert first > 0 and set(reasons[first:]) == {CopyReason.MISS, CopyReason.PREFETCH}
    stats = model.stats.report()
    for reason, key in ((CopyReason.MISS, "misses"), (CopyReason.PREFETCH, "prefetches")):
        assert sum(n for r, n in copied if r == reason) == stats[key] > 0
    with pytest.raises(TypeError, match="reason must be a CopyReason, got 'miss'"):
        inner(model.runtime.store, 0, [0], [0], reason="miss")  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_a_schedule_counted_without_running_the_kernels_is_the_same(tiny, fmt) -> None:
    """measure_schedule(kernels=False): the device step's decode forwards with their Triton
    launches and native store calls counted, not run, give the schedule the real kernels
    give (the sync-free step's host reads nothing they write); the host-driven step,
    which reads them, is refused."""
    got = []
    for kernels in (True, False):
        model = psr.load(
            tiny, "psr", 0.5, lam=0.5, n=2, compute="triton", expert_format=fmt, progress=False
        )
        got.append(measure_schedule(model, PROMPT, new_tokens=4, kernels=kernels))
        assert torch.equal(model.generate(PROMPT, max_new_tokens=2), model.generate(PROMPT, 2))
    assert got[0] == got[1] and got[0].mode == "device"
    host = _model("tiny", tiny, "host", "triton")
    with pytest.raises(ValueError, match="needs the device step"):
        measure_schedule(host, PROMPT, kernels=False)


def test_stubbed_native_calls_do_nothing_but_still_check() -> None:
    """ExpertStore.stub_native_calls (the public hook stubbed_launches times the host's
    Python through): while on, a copy and its wait leave the slot as it was, the
    wrapper's argument checks still refuse bad input and other calls stay real; off, the
    same calls copy."""
    store = ExpertStore([psr.LayerSpec(4, 2, 8)], torch.float32, backend="cpu")
    for e in range(4):
        store.register(0, e, [torch.full((8,), float(e + 1))])
    # A real copy first: a fresh slab is uninitialised memory, whose bytes may read as NaN
    # (never equal to itself).
    store.enqueue_copies(0, [0], [1], reason=CopyReason.MISS)
    store.acquire(0, [0], [1])
    store.release(0, [0])
    before = store.slab(0)[0].clone()
    assert torch.equal(before, torch.full((8,), 2.0))
    store.stub_native_calls(True)
    store.enqueue_copies(0, [0], [2], reason=CopyReason.MISS)
    store.acquire(0, [0])
    store.release(0, [0])
    assert torch.equal(store.slab(0)[0], before) and store.slot_experts(0)[0] == 1
    with pytest.raises(TypeError, match="reason must be a CopyReason"):
        store.enqueue_copies(0, [0], [2], reason="miss")  # type: ignore[arg-type]
    assert torch.equal(store.row(0, 3), torch.full((8,), 4.0))  # not stubbed
    store.stub_native_calls(False)
    store.enqueue_copies(0, [0], [2], reason=CopyReason.MISS)
    store.acquire(0, [0], [2])
    store.release(0, [0])
    assert torch.equal(store.slab(0)[0], torch.full((8,), 3.0))
    store.close()


def test_torch_path_counts_and_probe_cleanup(tiny) -> None:
    """The torch path's device step: no read or host-built tensor anywhere in the MoE
    path, the store calls in the device step's order; per-token counts agree with the
    schedule; the probe undoes every patch."""
    model = _model("tiny", tiny, "device", "torch")
    rt, hf_forward = model.runtime, model.hf.forward
    gather = ExpertStore.gather
    with HostProbe(model) as probe:
        want = model.generate(PROMPT, max_new_tokens=5)
    assert probe.modes == ["device"] * 4
    assert probe.uniform() == {"moe_layer": True, "last_moe_layer": True, "token": True}
    s = probe.schedule()
    for ops in (s.moe_layer, s.last_moe_layer):
        assert not any(o.kind in ("sync", "h2d", "copy", "wait", "release") for o in ops)
    store_ops = [(o.kind, o.stream) for o in s.moe_layer if o.kind != "launch"]
    assert store_ops == [("join", "compute"), ("gather", "compute"), ("gather", "side")]
    pt = probe.per_token(first=1)
    layers = len(rt.layers)
    per_layer = [len(s.moe_layer)] * (layers - 1) + [len(s.last_moe_layer)]
    assert pt["kernels"] + pt["store_calls"] - pt["gathers"] == sum(per_layer)
    assert pt["reads"] == 0 and pt["h2d"] == 0 and pt["token_reads"] == 1
    assert pt["dense_kernels"] == s.dense_launches * rt.num_decoder_layers
    assert probe.read_sites("token", first=1).total() == pt["tokens"]

    assert ExpertStore.gather is gather and model.hf.forward == hf_forward
    assert "route" not in vars(rt) and "experts" not in vars(rt)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=5), want)


def test_schedule_round_trips_through_trace_json(tiny, tmp_path) -> None:
    model = _model("tiny", tiny, "host", "torch")
    schedule = measure_schedule(model, PROMPT, new_tokens=4)
    rec = model.record_trace()
    model.generate(PROMPT, max_new_tokens=4)
    trace = rec.trace
    trace.host = schedule
    trace.save(tmp_path / "t.json")
    back = Trace.load(tmp_path / "t.json")
    assert back.host == schedule and back.tokens == trace.tokens
    assert HostSchedule.from_json(json.loads(json.dumps(trace.to_json()))["host"]) == schedule
    assert Trace.from_json({**trace.to_json(), "host": None}).host is None


def test_merge_keeps_every_cells_ops_in_order() -> None:
    a, b = HostOp("launch", "mm"), HostOp("launch", "bmm")
    miss, pre = HostOp("copy", "miss"), HostOp("copy", "prefetch")
    cells = [[a, miss, b], [a, b, pre], [a, b]]
    merged = merge_ops(cells)
    assert merged == [a, miss, b, pre]
    assert op_rates(merged, cells) == [1.0, 1 / 3, 1.0, 1 / 3]
    assert merge_ops([[a, b], [a, b]]) == [a, b]
    side = HostOp("gather", "prefetch", "side")
    assert merge_ops([[a, side], [a, HostOp("gather", "prefetch")]]) == [
        a,
        side,
        HostOp("gather", "prefetch"),
    ]


def test_schedule_needs_a_decode_forward_after_the_first(tiny) -> None:
    model = _model("tiny", tiny, "device", "torch")
    with HostProbe(model) as probe:
        model.generate(PROMPT, max_new_tokens=2)
    assert len(probe.steps) == 1
    with pytest.raises(ValueError, match="decode at least 3 new tokens"):
        probe.schedule()
    with pytest.raises(ValueError, match=">= 3"):
        measure_schedule(model, PROMPT, new_tokens=2)


# One family per router kind and expert kind the family table added (the old five's
# schedule is pinned above): each keeps the device step free of host reads.
# (The group-max and softmax+bias routers are branches of the same fused kernel, run on
# the Triton path by tests/runtime/test_families.py.)
NEW_KINDS = {
    "phimoe": "sparsemixer",
    "llama4_text": "topk_sigmoid + scaled_input",
    "gpt_oss": "router bias + gpt_oss experts",
}


@pytest.mark.parametrize("family", sorted(NEW_KINDS))
def test_new_router_and_expert_kinds_stay_sync_free(tmp_path, family) -> None:
    path = write_checkpoint(tiny_model(family), tmp_path / family)
    model = psr.load(path, "psr", 0.5, lam=0.5, n=2, compute="triton", progress=False)
    with HostProbe(model) as probe:
        model.generate(PROMPT, max_new_tokens=3)
    assert set(probe.modes) == {"device"}
    s = probe.schedule()
    for ops in (s.moe_layer, s.last_moe_layer):
        assert not any(o.kind in ("sync", "h2d", "copy", "wait", "release") for o in ops)
        launched = [o.what for o in ops if o.kind == "launch"]
        assert "_decode_kernel" in launched and "_gate_up_kernel" in launched
    pt = probe.per_token(first=1)
    assert pt["reads"] == 0 and pt["h2d"] == 0 and pt["token_reads"] == 1
