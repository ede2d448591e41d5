"""The sync-free decode step (decode="device") against the host-driven one (decode="host"):
the same tokens, logits and counts on every family and policy, on the torch and the Triton
path; no host read in the MoE path while decoding; hand-overs between the two steps within
a sequence; non-finite router inputs raising after the call; the decode streams' caches
equal to psr.cache.LogicalCache replayed on their own routing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, tiny_model, write_checkpoint

import psr
from psr.cache import LogicalCache, prefill_state
from psr.eval.host_probe import HostProbe
from psr.runtime.steering import Steering
from psr_kernels import cache_state as cs

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
NEW = 10
POLICIES = [
    ("exact", {}),
    ("exact-prefetch", {"n": 2}),
    ("cache-prior", {"lam": 0.5}),
    ("psr", {"lam": 0.5, "n": 2}),
]
COUNTS = (
    "tokens",
    "routed",
    "hits",
    "misses",
    "prefetches",
    "prefetch_used",
    "substituted",
    "copies",
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("device")
    return {f: write_checkpoint(tiny_model(f), root / f) for f in FAMILIES}


def _load(path: Path, policy: str, decode: str, **kw) -> psr.OffloadedModel:
    return psr.load(path, policy, 0.5, decode=decode, progress=False, **kw)


def _decode(
    model: psr.OffloadedModel, new: int = NEW
) -> tuple[list[int], torch.Tensor, dict[str, float]]:
    tokens = model.generate(PROMPT, max_new_tokens=new)
    logits = model.decode_logits(tokens, PROMPT.shape[1])
    return tokens[0].tolist(), logits, {k: model.stats[k] for k in COUNTS}


@pytest.mark.parametrize(("policy", "kw"), POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("family", FAMILIES)
def test_device_step_equals_host_step(ckpts, family, policy, kw) -> None:
    host_model = _load(ckpts[family], policy, "host", **kw)
    host = _decode(host_model)
    dev_model = _load(ckpts[family], policy, "device", **kw)
    dev = _decode(dev_model)
    assert dev[0] == host[0]
    assert torch.equal(dev[1], host[1])  # bit-identical logits: the same kernels and order
    assert dev[2] == host[2]  # substituted too: the kernel's count equals the host's
    if policy.startswith("exact"):  # no bias, nothing substituted, by construction
        assert dev[2]["substituted"] == 0
    # per-token records, row by row: the device step's come from its on-device snapshots
    assert _rows(dev_model) == _rows(host_model)
    assert len(_rows(dev_model)) == 2 * NEW - 1  # generate's NEW - 1, decode_logits' NEW


ROW_KEYS = (
    "routed",
    "hits",
    "misses",
    "prefetches",
    "prefetch_used",
    "substituted",
    "copies",
    "bytes_copied",
)


def _rows(model: psr.OffloadedModel) -> list[tuple[float, ...]]:
    return [tuple(r[k] for k in ROW_KEYS) for r in model.stats.per_token]


def dev_context(ckpts) -> int:
    import json

    return int(json.loads((ckpts["olmoe"] / "config.json").read_text())["max_position_embeddings"])


def test_per_token_records_without_a_read_per_token(ckpts, monkeypatch) -> None:
    """More tokens than the snapshot buffer's first size (it grows on the device) and its
    largest (the stats are read then), stats read mid-way (the records so far), and the
    sums of the rows equal the totals."""
    from psr.runtime import device_decode

    monkeypatch.setattr(device_decode, "SNAPSHOT_ROWS", 16)  # small: the context is 128
    monkeypatch.setattr(device_decode, "MAX_SNAPSHOT_ROWS", 40)

    kw = dict(lam=0.5, n=2)
    host = _load(ckpts["olmoe"], "psr", "host", **kw)
    dev = _load(ckpts["olmoe"], "psr", "device", **kw)
    n = 2 * device_decode.MAX_SNAPSHOT_ROWS + 6  # past the first size, twice past the largest
    assert PROMPT.shape[1] + n <= dev_context(ckpts)
    seen: dict[str, list[int]] = {"host": [], "device": []}

    class Reader:  # reads the stats while decoding: the records made so far
        def __init__(self, m: psr.OffloadedModel, name: str) -> None:
            self.m, self.name, self.calls = m, name, 0

        def put(self, _value: torch.Tensor) -> None:
            self.calls += 1
            if self.calls in (5, 10):  # then 76 tokens: past 40 (read), never 128 rows
                seen[self.name].append(len(self.m.stats.per_token))

        def end(self) -> None:
            pass

    for m, name in ((host, "host"), (dev, "device")):
        m.generate(PROMPT, max_new_tokens=n, eos_token_id=None, streamer=Reader(m, name))
        m.generate(PROMPT[:, :5], max_new_tokens=3)
    assert seen["device"] == seen["host"]
    assert len(seen["device"]) == 2
    assert dev.runtime.device_step._snaps.shape[0] == 64  # grew 16 -> 64, read at 40
    assert _rows(dev) == _rows(host) and len(_rows(dev)) == n - 1 + 2
    totals = dev.stats.totals
    for i, k in enumerate(ROW_KEYS):
        assert sum(r[i] for r in _rows(dev)) == totals[k]
    assert all(r["time_s"] > 0 for r in dev.stats.per_token)  # CPU: the host's time


TRITON_CASES = [  # every family and expert format once
    ("olmoe", None),
    ("qwen3_moe", "int8"),
    ("qwen2_moe", None),
    ("mixtral", "int4"),
    ("deepseek_v3", "fp8"),
]


@pytest.mark.parametrize(("family", "fmt"), TRITON_CASES)
def test_device_step_equals_host_step_on_the_triton_path(ckpts, family, fmt) -> None:
    kw = dict(lam=0.5, n=2, compute="triton", expert_format=fmt)
    host_model = _load(ckpts[family], "psr", "host", **kw)
    dev_model = _load(ckpts[family], "psr", "device", **kw)
    assert dev_model.runtime.ops.path == "triton"
    # Interpreted (about 1 s a decode forward): 3 new tokens, so generate's hand-over and a
    # steady step, and 3 teacher-forced steps.
    host, dev = _decode(host_model, 3), _decode(dev_model, 3)
    assert dev[0] == host[0] and dev[2] == host[2]
    torch.testing.assert_close(dev[1], host[1], rtol=0, atol=0)


@pytest.mark.parametrize(("policy", "kw"), POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("compute", ["torch", "triton"])
def test_no_host_read_in_the_moe_path_while_decoding(ckpts, policy, kw, compute) -> None:
    """Every read of device data, and every tensor built from host data, inside the router
    and experts hooks of decode forwards is counted (psr.eval.host_probe); the device step
    makes none. The host step, probed the same way, makes several per layer: the probe
    sees them."""
    path = ckpts["olmoe"]
    dev = _load(path, policy, "device", compute=compute, **kw)
    with HostProbe(dev) as probe:
        dev.generate(PROMPT, max_new_tokens=4)
    assert len(probe.steps) == 3
    assert probe.read_sites() == {} and probe.per_token()["h2d"] == 0
    per_layer = [c.kernels for step in probe.steps for c in step]
    if compute == "triton":
        # router GEMV, the fused decode kernel, the miss gather, [the prefetch gather], FFN x2
        # and the split down's sum of the experts' partials (SPLIT_K_DEFAULT)
        want = 7 if kw.get("n") else 6
        assert max(per_layer) == want
    host = _load(path, policy, "host", compute=compute, **kw)
    with HostProbe(host) as probe:
        host.generate(PROMPT, max_new_tokens=4)
    assert sum(probe.read_sites().values()) >= 3 * len(host.runtime.layers)


@pytest.mark.parametrize("compute", ["torch", "triton"])
def test_kernel_arguments_are_checked_once_per_layer(ckpts, monkeypatch, compute) -> None:
    """The decode step's and the experts' argument checks run on a layer's first decode
    token only (a layer's arguments keep their shapes, dtypes and devices); later tokens
    launch unchecked, and decode as a model whose every call is checked."""
    import sys

    dec, ffn = sys.modules["psr_kernels.decode"], sys.modules["psr_kernels.expert_ffn"]
    calls = {"decode": 0, "ffn": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    kw = dict(lam=0.5, n=2, compute=compute)
    # The torch path's experts would run the CPU kernels (which check every call in C++):
    # this test is about the reference's Python checks.
    monkeypatch.setenv("PSR_CPU_EXPERTS", "torch")
    new = 4  # a layer's first decode token, then unchecked ones (interpreted on triton)
    model = _load(ckpts["olmoe"], "psr", "device", **kw)
    monkeypatch.setattr(dec, "_check", counting("decode", dec._check))
    monkeypatch.setattr(ffn, "_check_ffn", counting("ffn", ffn._check_ffn))
    got = _decode(model, new)
    layers = len(model.runtime.layers)
    assert calls == {"decode": layers, "ffn": layers}, calls  # over generate and decode_logits

    # the same tokens, logits and counts as with every call checked
    class Never(set):  # a layer never counts as checked: every call checks
        def add(self, _layer: object) -> None:
            pass

    everyone = _load(ckpts["olmoe"], "psr", "device", **kw)
    everyone.runtime.device_step.checked = Never()
    calls.update(decode=0, ffn=0)
    want = _decode(everyone, new)
    # every decode step: generate's new - 1, decode_logits' new (teacher-forced)
    assert calls["decode"] == calls["ffn"] == (2 * new - 1) * layers
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[2] == want[2]


def test_recording_and_variants_take_the_host_step_with_the_same_results(ckpts) -> None:
    path, kw = ckpts["mixtral"], dict(lam=0.5, n=2)
    plain = _decode(_load(path, "psr", "device", **kw))
    model = _load(path, "psr", "device", **kw)
    rec = model.record_trace()
    with HostProbe(model) as probe:
        tokens = model.generate(PROMPT, max_new_tokens=NEW)
    assert tokens[0].tolist() == plain[0]
    assert sum(probe.read_sites().values()) > 0  # the host step ran: it records the trace
    assert rec.trace.counts()["misses"] == model.stats["misses"]


def test_hand_over_between_steps_within_a_sequence(ckpts) -> None:
    """A sequence decoded partly by the device step and partly by the host step (a mode
    switch mid-sequence) routes and counts exactly as one decoded by either alone."""
    from psr.runtime.kv import cache_kwarg, output_cache

    path, kw = ckpts["olmoe"], dict(lam=0.5, n=2)
    want = _load(path, "psr", "host", **kw)
    want_tokens = want.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
    model = _load(path, "psr", "device", **kw)
    hf, kv_name, rt = model.hf, cache_kwarg(model.hf), model.runtime
    ids = PROMPT.clone()
    with torch.no_grad(), rt.lock:
        out = hf(input_ids=ids, use_cache=True)
        for i in range(NEW - 1):
            rt.set_decode("host" if i % 3 == 2 else "device")  # switch back and forth
            nxt = out.logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, nxt], 1)
            out = hf(input_ids=nxt, use_cache=True, **{kv_name: output_cache(out)})
        ids = torch.cat([ids, out.logits[0, -1].argmax().view(1, 1)], 1)
    assert ids[0].tolist() == want_tokens
    assert {k: model.stats[k] for k in COUNTS} == {k: want.stats[k] for k in COUNTS}


def test_device_caches_equal_a_replay_of_their_own_routing(ckpts) -> None:
    """The device caches after decoding equal psr.cache.LogicalCache replayed, from the
    prefill seed, on the routing and predictions the decode made (recorded from an equal
    host decode: its trace and a spy on its steering): the spec's use / prefetch, whatever
    the kernels compute it with."""
    path, kw = ckpts["qwen2_moe"], dict(lam=0.5, n=2)
    host = _load(path, "psr", "host", **kw)
    predicted: list[tuple[int, list[int], int]] = []

    class Spy(Steering):
        def predictions(self, layer, residual):  # type: ignore[no-untyped-def]
            out = super().predictions(layer, residual)
            predicted.extend((target, ids[0], n) for target, n, ids in out)
            return out

    host.runtime.set_steering(Spy(host.runtime))
    rec = host.record_trace()
    host.generate(PROMPT, max_new_tokens=NEW)
    model = _load(path, "psr", "device", **kw)
    model.generate(PROMPT, max_new_tokens=NEW)
    rt = model.runtime
    C, E = rt.capacity, rt.spec.num_experts
    prefill = psr.load(path, "psr", 0.5, progress=False, **kw)
    prefill(PROMPT)  # exact routing of the prompt: each layer's history
    caches = [LogicalCache(C, E) for _ in rt.layers]
    for cache, L in zip(caches, prefill.runtime.layers, strict=True):
        cache.reset(prefill_state(L.history, C))
    queue = iter(predicted)
    for token in rec.trace.tokens:
        for step in token:
            caches[step.layer].use(step.experts)
            if step.layer + 1 < len(caches):
                target, ids, n = next(queue)
                assert target == step.layer + 1
                caches[target].prefetch(ids, n)
    assert next(queue, None) is None
    for L, cache in zip(rt.layers, caches, strict=True):
        assert cs.cache_order(rt._device.state, rt._device.layout, L.index) == cache.order()


def test_non_finite_router_input_raises_after_the_call(ckpts) -> None:
    """Router logits that turn non-finite during decoding (prefill checks its own on the
    host) set the device flag; the call's end raises the error once, naming the layer.
    The host step and prefill raise the same error at once."""
    from psr.runtime.kv import cache_kwarg, output_cache

    model = _load(ckpts["olmoe"], "psr", "device", lam=0.5, n=2)
    rt, hf = model.runtime, model.hf
    router = rt.layers[1].router
    with torch.no_grad(), rt.lock:
        out = hf(input_ids=PROMPT, use_cache=True)  # prefill: finite
        router.weight[3, 0] = float("nan")
        for _ in range(2):
            nxt = out.logits[0, -1].argmax().view(1, 1)
            out = hf(input_ids=nxt, use_cache=True, **{cache_kwarg(hf): output_cache(out)})
        with pytest.raises(ValueError, match=r"MoE layer 1: router logits contain NaN or inf"):
            rt.end_call()
        rt.end_call()  # reported once
    # The host step and prefill check on the host, at once, and say it the same way.
    for n in (2, 0):
        host = _load(ckpts["olmoe"], "psr", "host", lam=0.5, n=n)
        rt, hf = host.runtime, host.hf
        with torch.no_grad(), rt.lock:
            out = hf(input_ids=PROMPT, use_cache=True)
            rt.layers[1].router.weight[3, 0] = float("nan")
            nxt = out.logits[0, -1].argmax().view(1, 1)
            with pytest.raises(ValueError) as err:
                hf(input_ids=nxt, use_cache=True, **{cache_kwarg(hf): output_cache(out)})
        want = "MoE layer 1: router logits contain NaN or inf (found while decoding; layers [1])"
        assert str(err.value) == want
    with torch.no_grad():
        host.runtime.layers[1].router.weight[3, 0] = float("nan")
    with pytest.raises(ValueError) as err:
        host.generate(PROMPT, max_new_tokens=3)
    want = "MoE layer 1: router logits contain NaN or inf (found in prefill; layers [1])"
    assert str(err.value) == want


def test_decode_mode_is_validated(ckpts) -> None:
    with pytest.raises(ValueError, match="decode must be one of device, host; got 'gpu'"):
        _load(ckpts["olmoe"], "psr", "gpu")
    model = _load(ckpts["olmoe"], "psr", "device")
    with pytest.raises(ValueError, match="decode must be one of device, host"):
        model.runtime.set_decode("fast")


@pytest.mark.gpu
@pytest.mark.parametrize(("policy", "kw"), POLICIES, ids=[p for p, _ in POLICIES])
def test_device_step_on_cuda_equals_host_step(tmp_path, policy, kw) -> None:
    """On a GPU: the Triton kernels, the CUDA store's gathers (mapped host memory, side
    stream, joins) give the host step's tokens and counts, with no host read in the MoE
    path, run after run. (tmp_path only: bench/gpu_tests.py's mini runner runs it too.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    host = _decode(_load(path, policy, "host", device="cuda", **kw))
    for _ in range(2):
        model = _load(path, policy, "device", device="cuda", **kw)
        assert model.runtime.store.backend == "cuda" and model.runtime.ops.path == "triton"
        with HostProbe(model) as probe:
            dev = _decode(model)
        assert dev[0] == host[0] and dev[2] == host[2]
        torch.testing.assert_close(dev[1], host[1], rtol=1e-5, atol=1e-5)
        assert probe.read_sites() == {}


@pytest.mark.gpu
@pytest.mark.parametrize(("policy", "kw"), POLICIES, ids=[p for p, _ in POLICIES])
def test_graphs_on_cuda_equal_the_eager_device_step(tmp_path, policy, kw) -> None:
    """On a GPU, graphs on (a CUDAGraph replay per decode token) give the eager device
    step's tokens and counts, run after run, with one capture per run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    eager = _load(path, policy, "device", device="cuda", graphs=False, **kw)
    want = (
        eager.generate(PROMPT, max_new_tokens=NEW)[0].tolist(),
        {k: eager.stats[k] for k in COUNTS},
    )
    assert eager.graph_status == "off (graphs=False)"
    for _ in range(2):
        model = _load(path, policy, "device", device="cuda", graphs=True, **kw)
        tokens = model.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
        assert model.graph_status.startswith("on (static cache of"), model.graph_status
        assert model.stats["captures"] == 1
        assert (tokens, {k: model.stats[k] for k in COUNTS}) == want


@pytest.mark.gpu
def test_graphs_capture_after_a_prefetching_policy_on_the_same_store(tmp_path) -> None:
    """One model reconfigured from psr (side-stream prefetches) to policies without them
    captures their graphs too, with the eager step's tokens and counts. The store's join
    waited on the last side gather's event whether or not this capture recorded it: an
    event from before the capture invalidated it (the first H200 run: cache-prior and
    exact failed after psr on one store)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    model = _load(path, "psr", "device", device="cuda", graphs=True, lam=0.5, n=2)
    model.generate(PROMPT, max_new_tokens=NEW)
    for policy, kw in [("cache-prior", {"lam": 0.5}), ("exact", {}), ("psr", {"lam": 0.5, "n": 2})]:
        eager = _load(path, policy, "device", device="cuda", graphs=False, **kw)
        want = eager.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
        model.configure(policy, 0.5, **kw)
        model.reset_stats()
        tokens = model.generate(PROMPT, max_new_tokens=NEW)[0].tolist()
        assert model.graph_status.startswith("on (static cache of"), (policy, model.graph_status)
        assert model.stats["captures"] >= 1, policy
        assert tokens == want, policy
        assert {k: model.stats[k] for k in COUNTS} == {k: eager.stats[k] for k in COUNTS}, policy


@pytest.mark.gpu
def test_decode_seconds_on_cuda_are_the_wall_clock(tmp_path) -> None:
    """psr's tokens / s on CUDA (the device step, graphs) is the decode's wall clock: not the
    host's launch time, nor the final wait alone (which gave 200k+ tok/s in the first run)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import time

    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    model = _load(path, "psr", "device", device="cuda", graphs=True, lam=0.5, n=2)
    model.generate(PROMPT, max_new_tokens=NEW)  # warm-up and capture
    walls = []
    for new in (1, 4 * NEW):
        model.reset_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(PROMPT, max_new_tokens=new)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    decode_wall = walls[1] - walls[0]  # the 4 * NEW - 1 decode tokens, less the prefill
    s = model.stats
    assert s["tokens"] == 4 * NEW - 1
    assert 0.5 * decode_wall <= s["decode_s"] <= walls[1], (s["decode_s"], walls)
