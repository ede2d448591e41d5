"""Memory tiers in the store: pageable rows read from checkpoint files (copies, gathers, host
reads), their counters, read errors that leave nothing half-written, and bad registrations.
The reference is the file's bytes, written here with numpy."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import psr
from psr.store import LayerSpec, Segment, cuda_available

E, SLOTS, ROW = 6, 3, 4096 + 512  # bytes per row: three segments (a zero-fill gap)
HELD = 2  # experts 0, 1 held; 2..5 pageable
PARTS = (2048, 512, 2048)  # gate | zeros | down, as a GGUF row pads its parts


def _file(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A 'checkpoint' of E experts' two tensors each, and the rows they pack to."""
    rng = np.random.default_rng(0)
    gate = rng.integers(0, 256, (E, PARTS[0]), dtype=np.uint8)
    down = rng.integers(0, 256, (E, PARTS[2]), dtype=np.uint8)
    path = tmp_path / "experts.bin"
    with path.open("wb") as f:
        f.write(b"header--")
        f.write(gate.tobytes())
        f.write(down.tobytes())
    rows = np.concatenate([gate, np.zeros((E, PARTS[1]), np.uint8), down], axis=1)
    return path, rows


def _fs_type(path: Path) -> str:
    """The type of the filesystem holding `path` (/proc/mounts: the longest mount prefix)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, fs = line.split()[:3]
        if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
            best, kind = mnt, fs
    return kind


def _segments(path: Path, e: int) -> list[Segment]:
    base = 8
    return [
        (str(path), base + e * PARTS[0], PARTS[0], f"gate.{e}"),
        ("", 0, PARTS[1], "padding"),
        (str(path), base + E * PARTS[0] + e * PARTS[2], PARTS[2], f"down.{e}"),
    ]


def _store(tmp_path: Path, backend: str = "cpu", **kw) -> tuple[psr.ExpertStore, np.ndarray, Path]:
    path, rows = _file(tmp_path)
    store = psr.ExpertStore([LayerSpec(E, SLOTS, ROW, HELD)], torch.uint8, backend=backend, **kw)
    for e in range(E):
        if e < HELD:
            store.register(0, e, torch.from_numpy(rows[e].copy()))
        else:
            store.register_pageable(0, e, _segments(path, e))
    return store, rows, path


def test_pageable_rows_copy_gather_and_read_as_the_file_holds_them(tmp_path: Path) -> None:
    store, rows, _ = _store(tmp_path, copy_delay_us=300, seed=3)
    assert store.tiers(0) == ["held"] * HELD + ["pageable"] * (E - HELD)
    assert store.host(0).shape == (E, ROW)  # a materialized copy: the layer has pageable rows
    assert np.array_equal(store.host(0).numpy(), rows)
    for e in range(E):
        assert np.array_equal(store.row(0, e).numpy(), rows[e])
    store.reset_counters()
    store.enqueue_copies(0, [0, 1, 2], [1, 3, 5])  # one held, two pageable
    with store.reading(0, [0, 1, 2], [1, 3, 5]) as slab:
        for s, e in enumerate([1, 3, 5]):
            assert np.array_equal(slab[s].numpy(), rows[e])
            assert store.verify(0, s)
    c = store.counters()
    assert c["bytes_pinned"] == ROW and c["bytes_pageable"] == 2 * (ROW - PARTS[1])
    assert c["bytes_page_cache"] + c["bytes_disk"] == c["bytes_pageable"]
    # Dropped from the page cache (fsync first: dirty pages stay), a read counts as disk
    # (not on tmpfs, whose pages are the file).
    if _fs_type(tmp_path) not in ("tmpfs", "ramfs", "overlay"):
        store.reset_counters()
        fd = os.open(tmp_path / "experts.bin", os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        store.enqueue_copies(0, [0], [2])
        store.acquire(0, [0], [2])
        store.release(0, [0])
        assert store.counters()["bytes_disk"] == ROW - PARTS[1]
    # Read again: the file's pages are in the page cache now.
    store.reset_counters()
    store.enqueue_copies(0, [1], [2])
    store.acquire(0, [1], [2])
    store.release(0, [1])
    assert store.counters()["bytes_page_cache"] == ROW - PARTS[1]
    # The device step's gathers: inline and on the copy thread, pageable and held rows.
    for side in (False, True):
        want = [0, 2, 4] if side else [5, 1, 3]
        lst = torch.tensor([[s, e, 0] for s, e in enumerate(want)], dtype=torch.int32)
        count = torch.tensor([3], dtype=torch.int32)  # read when the copy runs: kept alive
        store.gather(0, lst, count, side=side)
        store.join(0)
        for s, e in enumerate(want):
            assert np.array_equal(store.slab(0)[s].numpy(), rows[e])
        store.adopt_slots(0, want)
    store.close()


def test_a_read_error_names_the_file_and_tensor_and_leaves_nothing_half_written(
    tmp_path: Path,
) -> None:
    store, rows, path = _store(tmp_path, copy_retries=1)
    good = path.read_bytes()
    os.truncate(path, 8 + E * PARTS[0] + 3 * PARTS[2])  # down.3 onwards is gone
    store.enqueue_copies(0, [0, 1], [2, 4])
    with pytest.raises(psr.CopyError, match=rf"{path}.*tensor 'down\.4'.*truncated"):
        store.acquire(0, [0, 1], [2, 4])
    assert store.readers(0) == [0] * SLOTS and store.slot_experts(0)[1] == -1
    assert store.counters()["read_errors"] == 2  # the read and its retry
    # A gather that fails: its slots are poisoned, and adopting them leaves them empty.
    lst = torch.tensor([[2, 0, 0], [0, 5, 0], [1, 1, 0]], dtype=torch.int32)
    with pytest.raises(psr.CopyError, match=r"down\.5"):
        store.gather(0, lst, torch.tensor([3], dtype=torch.int32), side=False)
    store.adopt_slots(0, [5, 1, 0])
    assert store.slot_experts(0) == [-1, -1, 0]  # slot 2's row came before the failure
    path.write_bytes(good)  # the file is back: the same store copies correctly again
    store.enqueue_copies(0, [0, 1], [4, 5])
    with store.reading(0, [0, 1], [4, 5]) as slab:
        assert np.array_equal(slab[0].numpy(), rows[4])
        assert np.array_equal(slab[1].numpy(), rows[5])
    store.close()


def test_bad_pageable_registrations_are_refused(tmp_path: Path) -> None:
    store, _, path = _store(tmp_path)
    with pytest.raises(psr.StoreError, match=r"cannot open checkpoint file .*missing"):
        store.register_pageable(0, 2, [(str(tmp_path / "missing"), 0, ROW, "x")])
    with pytest.raises(psr.StoreError, match="not a regular file"):
        store.register_pageable(0, 2, [(str(tmp_path), 0, ROW, "x")])
    with pytest.raises(psr.StoreError, match=r"tensor 'x'.*needs bytes up to"):
        store.register_pageable(0, 2, [(str(path), path.stat().st_size - 10, ROW, "x")])
    with pytest.raises(ValueError, match="size mismatch"):
        store.register_pageable(0, 2, [(str(path), 0, ROW - 1, "x")])
    with pytest.raises(psr.StoreError, match="held in host memory"):
        store.register_pageable(0, 0, _segments(path, 0))
    with pytest.raises(psr.StoreError, match="all 2 held rows are taken"):
        store.register(0, 3, torch.zeros(ROW, dtype=torch.uint8))
    with pytest.raises(ValueError, match="num_held must be in"):
        psr.ExpertStore([LayerSpec(E, SLOTS, ROW, E + 1)], torch.uint8, backend="cpu")
    store.close()


@pytest.mark.gpu
def test_cuda_pageable_rows_go_through_the_staging_ring(tmp_path: Path) -> None:
    if not cuda_available():
        pytest.skip("needs a CUDA device")
    store, rows, _ = _store(tmp_path, backend="cuda")
    for step in range(12):  # held and pageable copies mixed, in order through the ring
        experts = [(step + s) % E for s in range(SLOTS)]
        store.enqueue_copies(0, list(range(SLOTS)), experts)
        with store.reading(0, list(range(SLOTS)), experts) as slab:
            got = slab.cpu().numpy()
        for s, e in enumerate(experts):
            assert np.array_equal(got[s], rows[e]), (step, s, e)
            assert store.verify(0, s)
    c = store.counters()
    assert c["bytes_pageable"] > 0 and c["bytes_pinned"] > 0
    lst = torch.zeros((1, 3), dtype=torch.int32, device="cuda")
    with pytest.raises(psr.StoreError, match="reads only held rows"):
        store.gather(0, lst, torch.ones(1, dtype=torch.int32, device="cuda"), side=False)
    store.close()
