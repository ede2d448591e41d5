"""The device step's CPU experts through the store (ExpertStore.cpu_experts / cpu_join,
issue 27 part 3): the listed experts of one token computed from the host rows, in routed
order, equal to the CPU kernels over that subset (bit for bit: the same kernel), for the
dtypes the device step hands over; no listed expert gives zeros; errors raised in one line
on the next call; the slab kernels' `skip_absent` (an expert the slot map sends to -1 adds
nothing) on every path. CUDA: the same through a host stream, and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import psr
import psr_kernels as pk
from psr import store as st

H, F, E, K = 40, 24, 6, 3


def _store(backend: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack(
        [
            pk.pack_expert(
                torch.randn(F, H, generator=g) / H**0.5,
                torch.randn(F, H, generator=g) / H**0.5,
                torch.randn(H, F, generator=g) / F**0.5,
            ).to(dtype)
            for _ in range(E)
        ]
    )
    s = psr.ExpertStore([(E, 2, rows.shape[1])], dtype, backend=backend)
    for e in range(E):
        s.register(0, e, rows[e])
    return s, rows


def _setup(s, rows, x_dtype=torch.float32, w_dtype=torch.float32, id_dtype=torch.int64):
    lay = st.cpu_layout(None, rows.dtype, H, F, 128, rows.shape[1] * rows.element_size())
    s.cpu_experts_setup(
        0, lay, x_dtype=x_dtype, w_dtype=w_dtype, id_dtype=id_dtype, top_k=K, threads=1
    )


def _cpu_list(ids: list[int], listed: set[int]) -> torch.Tensor:
    out = sorted(e for e in ids if e in listed)
    return torch.tensor(out + [-1] * (K - len(out)), dtype=torch.int32)


def _expected(rows, x, ids, w, listed: set[int]) -> torch.Tensor:
    """The CPU kernels over the listed experts, in routed order (the device step's sum)."""
    at = [j for j, e in enumerate(ids[0].tolist()) if e in listed]
    if not at:
        return torch.zeros(1, H)
    sel = ids[:, at].long()
    return st.cpu_expert_ffn(x.float(), rows, sel, w[:, at].float(), H, F, threads=1,
                             out_dtype=torch.float32)  # fmt: skip


DTYPES = [
    (torch.float32, torch.float32, torch.int64),
    (torch.bfloat16, torch.bfloat16, torch.int32),
    (torch.float16, torch.float32, torch.int64),
]


@pytest.mark.parametrize(("x_dtype", "w_dtype", "id_dtype"), DTYPES, ids=["fp32", "bf16", "fp16"])
def test_the_listed_experts_equal_the_kernels_over_them(x_dtype, w_dtype, id_dtype) -> None:
    s, rows = _store()
    _setup(s, rows, x_dtype, w_dtype, id_dtype)
    g = torch.Generator().manual_seed(3)
    y = torch.full((1, H), float("nan"))
    for listed in ({4, 1}, {2}, set(), {5, 0, 3}):
        x = torch.randn(1, H, generator=g).to(x_dtype)
        ids = torch.tensor([[4, 2, 1]] if listed != {5, 0, 3} else [[5, 0, 3]], dtype=id_dtype)
        w = torch.rand(1, K, generator=g).to(w_dtype)
        s.cpu_experts(0, x, ids, w, _cpu_list(ids[0].tolist(), listed), y)
        s.cpu_join(0)
        assert torch.equal(y, _expected(rows, x, ids, w, listed))
    c = s.counters()
    assert c["cpu_tasks"] == 4 and c["cpu_task_experts"] == 2 + 1 + 0 + 3
    s.reset_counters()
    assert s.counters()["cpu_tasks"] == 0


def test_bad_use_is_refused_in_one_line() -> None:
    s, rows = _store()
    x, y = torch.zeros(1, H), torch.zeros(1, H)
    ids, w = torch.tensor([[0, 1, 2]]), torch.ones(1, K)
    lst = _cpu_list([0, 1, 2], {1})
    with pytest.raises(psr.StoreError, match="no CPU experts set up"):
        s.cpu_experts(0, x, ids, w, lst, y)
    lay = st.cpu_layout(None, rows.dtype, H, F, 128, rows.shape[1] * 4)
    with pytest.raises(ValueError, match="layout's rows hold"):
        s.cpu_experts_setup(0, (*lay[:-1], lay[-1] + 4), x_dtype=torch.float32,
                            w_dtype=torch.float32, id_dtype=torch.int64, top_k=K,
                            threads=1)  # fmt: skip
    with pytest.raises(ValueError, match="threads must be in"):
        s.cpu_experts_setup(0, lay, x_dtype=torch.float32, w_dtype=torch.float32,
                            id_dtype=torch.int64, top_k=K, threads=10_000)  # fmt: skip
    with pytest.raises(ValueError, match="ids must be int32/int64"):
        s.cpu_experts_setup(0, lay, x_dtype=torch.float32, w_dtype=torch.float32,
                            id_dtype=torch.float32, top_k=K, threads=1)  # fmt: skip
    _setup(s, rows)
    with pytest.raises(ValueError, match="y must be a contiguous float32"):
        s.cpu_experts(0, x, ids, w, lst, torch.zeros(1, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cpu_list must be int32"):
        s.cpu_experts(0, x, ids, w, lst.long(), y)
    # An id out of range inside the task: y zeroed, the error raised at once on the CPU
    # backend (on CUDA: by the layer's next call or cpu_check), and only once.
    y.fill_(1.0)
    with pytest.raises(psr.StoreError, match=r"layer 0 CPU experts: routed expert id 9 out"):
        s.cpu_experts(0, x, torch.tensor([[0, 9, 2]]), w, lst, y)
    assert torch.equal(y, torch.zeros(1, H))
    s.cpu_check()  # raised already: nothing left
    s.cpu_experts(0, x, ids, w, lst, y)  # the layer works after it


def test_pageable_experts_are_refused(tmp_path) -> None:
    s = psr.ExpertStore([st.LayerSpec(E, 2, 16, num_held=E - 1)], torch.float32)
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(64 * E))
    for e in range(E - 1):
        s.register(0, e, torch.zeros(16))
    s.register_pageable(0, E - 1, [(str(path), 0, 64, "rows")])
    lay = (0, 4, 4, 0, 64, 128, 0, 0, 0, 16, 16, 4, 4, 64)
    with pytest.raises(psr.StoreError, match="every expert must be held"):
        s.cpu_experts_setup(0, lay, x_dtype=torch.float32, w_dtype=torch.float32,
                            id_dtype=torch.int64, top_k=2, threads=1)  # fmt: skip


@pytest.mark.parametrize("path", ["torch", "triton", "cpu"])
def test_slab_kernels_skip_absent_experts(path) -> None:
    """An expert the slot map sends to -1 adds nothing (weight and bias ignored): the result
    equals the kernels over the present experts alone; without skip_absent -1 is an error."""
    g = torch.Generator().manual_seed(5)
    slab = torch.stack(
        [pk.pack_expert(torch.randn(F, H, generator=g), torch.randn(F, H, generator=g),
                        torch.randn(H, F, generator=g)) for _ in range(3)]
    )  # fmt: skip
    table = torch.tensor([2, -1, 0, -1, 1, -1], dtype=torch.int32)  # experts 1, 3, 5 absent
    x = torch.randn(1, H, generator=g)
    ids = torch.tensor([[3, 0, 5, 4]])
    w = torch.rand(1, 4, generator=g)
    present = [1, 3]  # routed positions of experts 0 and 4
    if path == "cpu":
        got = st.cpu_expert_ffn(x, slab, ids, w, H, F, slot_table=table, skip_absent=True)
        want = st.cpu_expert_ffn(x, slab, ids[:, present], w[:, present], H, F, slot_table=table)
        assert torch.equal(got, want)
        with pytest.raises(IndexError, match="slot -1 out of range"):
            st.cpu_expert_ffn(x, slab, ids, w, H, F, slot_table=table)
        return
    fn = pk.expert_ffn if path == "triton" else pk.expert_ffn_ref
    got = fn(x, slab, ids, w, H, F, slot_table=table, skip_absent=True)
    want = pk.expert_ffn_ref(x, slab, ids[:, present], w[:, present], H, F, slot_table=table)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError, match="slot ids must be in"):
        fn(x, slab, ids, w, H, F, slot_table=table)


# --- CUDA ------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not st.cuda_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_hand_off_equals_the_cpu_backend_and_replays_in_a_graph() -> None:
    """On CUDA: staged to pinned memory on the host stream, computed by a host function,
    joined into the compute stream; equal to the CPU backend's result, and a CUDA graph of
    (write the list, cpu_experts, a kernel meanwhile, cpu_join, use y) replays it right
    for new inputs."""
    cs, rows = _store("cpu")
    gs, _ = _store("cuda")
    _setup(cs, rows)
    _setup(gs, rows)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, H, generator=g)
    ids, w = torch.tensor([[4, 2, 1]]), torch.rand(1, K, generator=g)
    lst = _cpu_list([4, 2, 1], {4, 1})
    yc = torch.zeros(1, H)
    cs.cpu_experts(0, x, ids, w, lst, yc)
    xd, idsd, wd, lstd = x.to(dev), ids.to(dev), w.to(dev), lst.to(dev)
    yd = torch.zeros(1, H, device=dev)
    gs.cpu_experts(0, xd, idsd, wd, lstd, yd)
    gs.cpu_join(0)
    assert torch.equal(yd.cpu(), yc)

    out = torch.zeros(1, H, device=dev)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            gs.cpu_experts(0, xd, idsd, wd, lstd, yd)
            other = xd * 2.0  # runs on the compute stream while the CPU computes
            gs.cpu_join(0)
            out.copy_(yd + other)
    for listed in ({2}, {4, 2, 1}, set()):
        x2 = torch.randn(1, H, generator=g)
        xd.copy_(x2.to(dev))
        lstd.copy_(_cpu_list([4, 2, 1], listed).to(dev))
        graph.replay()
        torch.cuda.synchronize()
        want = _expected(rows, x2, ids, w, listed) + x2 * 2.0
        torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)
    gs.cpu_check()


def test_bench_machine_times_the_hand_off_on_the_store() -> None:
    """psr bench machine's fixed cost on CUDA is the hand-off's (timed through a store);
    the same function runs on the CPU backend: one tiny expert per call, a positive time
    under 50 ms."""
    from psr.eval.machine_profile import handoff_fixed_time

    t = handoff_fixed_time(5, "cpu")
    assert 0 < t < 0.05
