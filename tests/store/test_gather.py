"""Device-indexed copies: ExpertStore.gather / join / adopt_slots on both backends (CUDA
ones marked gpu). The copy list is data the store reads when the copy runs, never the
host: rows past the count are not copied, side gathers run behind the store's earlier
copies and are joined per layer, and out-of-range rows are refused (CPU)."""

from __future__ import annotations

import pytest
import torch

from psr.store import ExpertStore, StoreError, cuda_available

E, S, N = 8, 4, 6  # experts, slots, elements per expert


def _store(backend: str = "cpu", **kw) -> ExpertStore:
    st = ExpertStore([(E, S, N), (E, S, N)], torch.float32, backend=backend, **kw)
    for layer in range(2):
        for e in range(E):
            st.register(layer, e, torch.full((N,), 10.0 * layer + e))
    return st


def _list(rows: list[tuple[int, int]], count: int, device: str | torch.device = "cpu"):
    pad = [(-1, -1)] * 2
    t = torch.tensor([(s, e, 0) for s, e in rows + pad], dtype=torch.int32, device=device)
    return t, torch.tensor([count], dtype=torch.int32, device=device)


def _held(st: ExpertStore, layer: int) -> list[float]:
    return st.slab(layer)[:, 0].cpu().tolist()


def test_inline_gather_copies_the_counted_rows_now() -> None:
    with _store() as st:
        st.slab(0).zero_()
        rows, count = _list([(2, 5), (0, 7), (1, 3)], 2)
        st.gather(0, rows, count, side=False)
        assert _held(st, 0) == [7.0, 0.0, 5.0, 0.0]  # row 2 is past the count


def test_side_gathers_follow_earlier_copies_and_join_per_layer() -> None:
    with _store(copy_delay_us=3000, seed=11) as st:
        st.enqueue_copies(0, [0], [1])
        rows, count = _list([(0, 2), (3, 6)], 2)
        st.gather(0, rows, count, side=True)  # queued behind the copy into slot 0
        other, n_other = _list([(1, 4)], 1)
        st.gather(1, other, n_other, side=True)
        st.join(0)
        assert _held(st, 0)[0] == 2.0 and _held(st, 0)[3] == 6.0
        st.join(1)
        assert _held(st, 1)[1] == 14.0
        assert st.counters()["stall_s"] > 0  # the joins waited for delayed copies


def test_many_delayed_side_gathers_end_exactly_as_listed() -> None:
    g = torch.Generator().manual_seed(0)
    with _store(copy_delay_us=200, seed=5) as st:
        want = [-1] * S
        for _ in range(40):
            slots = torch.randperm(S, generator=g)[:2].tolist()
            experts = torch.randperm(E, generator=g)[:2].tolist()
            n = int(torch.randint(0, 3, (1,), generator=g))
            rows, count = _list(list(zip(slots, experts, strict=True)), n)
            st.gather(0, rows, count, side=True)
            for s, e in list(zip(slots, experts, strict=True))[:n]:
                want[s] = e
            st.join(0)
            assert [int(v) if want[i] >= 0 else -1 for i, v in enumerate(_held(st, 0))] == want


def test_bad_rows_and_arguments_are_refused() -> None:
    with _store() as st:
        rows, count = _list([(S, 1)], 1)
        with pytest.raises(StoreError, match=r"row 0 \(slot 4, expert 1\) is out of range"):
            st.gather(0, rows, count, side=False)
        st.gather(0, rows, count, side=True)
        with pytest.raises(StoreError, match="out of range"):
            st.join(0)
        st.join(0)  # the error was raised once; the store keeps working
        with pytest.raises(ValueError, match="contiguous int32 tensor"):
            st.gather(0, rows.long(), count, side=False)
        with pytest.raises(ValueError, match=r"rows must be \[R, 3\]"):
            st.gather(0, rows[:, :2].contiguous(), count, side=False)


def test_adopt_slots_sets_the_bookkeeping_without_a_copy() -> None:
    with _store() as st:
        rows, count = _list([(0, 3), (2, 6)], 2)
        st.gather(0, rows, count, side=False)
        st.adopt_slots(0, [3, -1, 6, -1])
        assert st.slot_experts(0) == [3, -1, 6, -1]
        assert st.verify(0, 0) and st.verify(0, 2)
        copies = st.counters()["copies"]
        with st.reading(0, [0, 2], [3, 6]) as slab:  # loaded: acquire waits for nothing
            assert slab[2, 0] == 6.0
        assert st.counters()["copies"] == copies
        st.adopt_slots(0, [3, 3, -1, -1])  # a leftover beside a fresh copy: allowed
        assert st.slot_experts(0) == [3, 3, -1, -1]
        with pytest.raises(IndexError, match=r"expert 8 out of range \[-1, 8\)"):
            st.adopt_slots(0, [8, -1, -1, -1])
        st.adopt_slots(0, [3, -1, 6, -1])
        with pytest.raises(ValueError, match="3 experts for the 4 slots"):
            st.adopt_slots(0, [3, -1, 6])
        st.acquire(0, [0])
        with pytest.raises(StoreError, match="held by a reader"):
            st.adopt_slots(0, [3, -1, 6, -1])
        st.release(0, [0])


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_cuda_gathers_read_the_list_on_the_device() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    with _store("cuda") as st:
        st.slab(0).zero_()
        rows, count = _list([(2, 5), (0, 7), (1, 3)], 2, dev)
        st.gather(0, rows, count, side=True)
        st.join(0)
        assert _held(st, 0) == [7.0, 0.0, 5.0, 0.0]
        count.fill_(3)  # the count is read when the copy runs, on the device
        st.gather(0, rows, count, side=False)
        assert _held(st, 0) == [7.0, 3.0, 5.0, 0.0]
        bad, n = _list([(S, 1), (3, 4)], 2, dev)  # out of range: skipped on CUDA
        st.gather(0, bad, n, side=False)
        assert _held(st, 0) == [7.0, 3.0, 5.0, 4.0]
        big = torch.arange(E * 4096, dtype=torch.float32).view(E, 4096)
        with ExpertStore([(E, S, 4096)], torch.float32, backend="cuda") as wide:
            for e in range(E):
                wide.register(0, e, big[e])
            rows, count = _list([(s, E - 1 - s) for s in range(S)], S, dev)
            wide.gather(0, rows, count, side=True)
            wide.join(0)
            wide.adopt_slots(0, [E - 1 - s for s in range(S)])
            assert all(wide.verify(0, s) for s in range(S))
            assert torch.equal(wide.slab(0).cpu(), big.flip(0)[:S])
