"""Checks that need a CUDA device (skipped elsewhere; run by bench/gpu_bench.sh)."""

from __future__ import annotations

import pytest
import torch

import psr
import psr_kernels as pk

pytestmark = pytest.mark.gpu


def test_cuda_backend_round_trip_and_counters() -> None:
    store = psr.ExpertStore([(16, 4, 3 * 256 * 128)] * 2, torch.bfloat16, backend="cuda")
    host = [[torch.randn(3 * 256 * 128).to(torch.bfloat16) for _ in range(16)] for _ in range(2)]
    for l in range(2):
        for e in range(16):
            store.register(l, e, host[l][e])
    assert store.slab(0).is_cuda
    for step in range(20):
        l, slots = step % 2, [0, 1, 2, 3]
        experts = [(step * 3 + s) % 16 for s in slots]
        store.enqueue_copies(l, slots, experts)
        with store.reading(l, slots, experts) as slab:
            got = slab[slots].cpu()  # on the current stream: ordered after the copies
        for s, e in zip(slots, experts, strict=True):
            assert torch.equal(got[s], host[l][e])
            assert store.verify(l, s)
    c = store.counters()
    assert c["copies"] == 80 and c["failed_copies"] == 0


def test_cuda_write_after_read_on_streams() -> None:
    store = psr.ExpertStore([(4, 2, 1 << 22)], torch.float32, backend="cuda")
    for e in range(4):
        store.register(0, e, torch.full((1 << 22,), float(e)))
    store.enqueue_copies(0, [0], [1])
    store.acquire(0, [0], [1])
    slab = store.slab(0)
    # A long read on the compute stream, then a load into the same slot: the copy
    # must wait for the read event, so the reduction sees only expert 1's values.
    acc = torch.zeros((), device="cuda")
    for _ in range(50):
        acc += slab[0].sum()
    store.release(0, [0])
    store.enqueue_copies(0, [0], [3])
    torch.cuda.synchronize()
    assert acc.item() == 50 * float(1 << 22)
    store.acquire(0, [0], [3])
    assert slab[0][0].item() == 3.0
    store.release(0, [0])


def test_cuda_copies_are_retried_then_raised() -> None:
    store = psr.ExpertStore([(4, 2, 1 << 16)], torch.float32, backend="cuda", copy_retries=2)
    for e in range(4):
        store.register(0, e, torch.full((1 << 16,), float(e)))
    store.fail_next_copies(2)  # the copy and its first retry
    store.enqueue_copies(0, [0], [3])
    with store.reading(0, [0], [3]) as slab:
        assert slab[0].eq(3.0).all().item()
    c = store.counters()
    assert c["copies"] == 3 and c["retried_copies"] == 2 and c["failed_copies"] == 2
    store.fail_next_copies(3)
    store.enqueue_copies(0, [1], [2])
    with pytest.raises(psr.CopyError, match="after 2 retries"):
        store.acquire(0, [1], [2])
    assert store.slot_experts(0)[1] == -1 and store.readers(0) == [0, 0]
    store.enqueue_copies(0, [1], [2])
    store.acquire(0, [1], [2])
    assert store.verify(0, 1)
    store.release(0, [1])


def test_cuda_close_keeps_views_and_frees_the_rest() -> None:
    with psr.ExpertStore([(4, 2, 1 << 20)], torch.float32, backend="cuda") as store:
        for e in range(4):
            store.register(0, e, torch.full((1 << 20,), float(e)))
        store.enqueue_copies(0, [0, 1], [1, 2])
        slab = store.slab(0)
    with pytest.raises(psr.StoreError, match="closed"):
        store.acquire(0, [0])
    torch.cuda.synchronize()
    assert slab[1].eq(2.0).all().item() and slab[0].eq(1.0).all().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_match_references_on_cuda(dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    T, E, k, H, F = 3, 64, 8, 2048, 256
    logits = torch.randn(T, E, device="cuda", generator=g).to(dtype)
    mask = torch.rand(E, device="cuda", generator=g) < 0.5
    w, ids = pk.route(logits, pk.RouteSpec(k, lam=0.3), mask=mask)
    w2, ids2 = pk.route_ref(logits, pk.RouteSpec(k, lam=0.3), mask=mask)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2)
    hidden = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    gate = (torch.randn(E, H, device="cuda", generator=g) / H**0.5).to(dtype)
    nw = torch.ones(H, device="cuda", dtype=dtype)
    assert torch.equal(
        pk.predict_next(hidden, nw, gate, 2, pk.RouteSpec(k), mask=mask)[0],
        pk.predict_next_ref(hidden, nw, gate, 2, pk.RouteSpec(k), mask=mask)[0],
    )
    slab = (torch.randn(16, 3 * H * F, device="cuda", generator=g) / H**0.5).to(dtype)
    slots = torch.randint(0, 16, (1, k), device="cuda", generator=g)
    wt = torch.rand(1, k, device="cuda", generator=g)
    y = pk.expert_ffn(hidden[:1], slab, slots, wt, H, F, out_dtype=torch.float32)
    y2 = pk.expert_ffn_ref(hidden[:1], slab, slots, wt, H, F, out_dtype=torch.float32)
    torch.testing.assert_close(y, y2, rtol=1e-3, atol=1e-3 * y2.abs().max().item())


def test_runtime_on_cuda_matches_transformers_and_is_deterministic(tmp_path) -> None:
    import transformers
    from tiny_models import tiny_model, write_checkpoint

    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    prompt = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60]])
    with torch.no_grad():
        want = ref.generate(prompt.cuda(), max_new_tokens=8, do_sample=False).cpu()
    model = psr.load(path, "exact", residency=0.25, device="cuda", progress=False)
    assert model.runtime.store.backend == "cuda" and model.runtime.ops.path == "triton"
    assert model.generate(prompt, 8).cpu().tolist() == want.tolist()
    outs = []
    for _ in range(3):
        m = psr.load(path, "psr", residency=0.5, lam=0.5, n=2, device="cuda", progress=False)
        toks = m.generate(prompt, 8)
        outs.append((toks.cpu(), m.decode_logits(toks, prompt.shape[1]).cpu(), m.stats["misses"]))
    for o in outs[1:]:
        assert torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1])
        assert o[2] == outs[0][2]


def test_ggml_kernels_match_references_on_cuda() -> None:
    """GGUF's block types through the compiled Triton kernels (the interpreter runs the
    same code on the CPU): every mix of tests/ggml_blocks.py against the torch reference."""
    import numpy as np
    from ggml_blocks import MIXES, expert_rows

    rng = np.random.default_rng(0)
    H, F = 2048, 768
    for types in MIXES:
        slab = torch.stack([expert_rows(types, H, F, rng)[0] for _ in range(4)]).cuda()
        fmt = pk.ggml_format(*types)
        x, w = torch.randn(2, H, device="cuda"), torch.rand(2, 3, device="cuda")
        slots = torch.tensor([[3, 0, 1], [2, 2, 0]], device="cuda")
        y = pk.expert_ffn(x, slab, slots, w, H, F, fmt=fmt, out_dtype=torch.float32)
        ref = pk.expert_ffn_ref(x, slab, slots, w, H, F, fmt=fmt, out_dtype=torch.float32)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
