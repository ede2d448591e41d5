"""The C++ expert store: contents, ordering, failures, retries, lifetime, threads and bad input
(CPU backend)."""

from __future__ import annotations

import gc
import importlib.util
import itertools
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from procfs import copy_threads

import psr
from psr import _C

ROOT = Path(__file__).resolve().parents[2]


def make_store(layers=((8, 4, 96), (6, 3, 40)), dtype=torch.bfloat16, **kw) -> psr.ExpertStore:
    kw.setdefault("backend", "cpu")
    store = psr.ExpertStore([psr.LayerSpec(*spec) for spec in layers], dtype, **kw)
    gen = torch.Generator().manual_seed(0)
    for l, spec in enumerate(store.layers):
        for e in range(spec.num_experts):
            # Two parts, as gate/up/down matrices are registered, packed in order.
            a = torch.randn(spec.expert_numel // 2, generator=gen).to(dtype)
            b = torch.randn(spec.expert_numel - a.numel(), generator=gen).to(dtype)
            store.register(l, e, [a, b])
    return store


def test_backend_info_reports_build_and_runtime() -> None:
    info = psr.backend_info()
    assert isinstance(info["cuda_compiled"], bool) and isinstance(info["cuda_available"], bool)
    assert info["backend"] in ("cpu", "cuda")
    if not torch.cuda.is_available():
        assert info["backend"] == "cpu" and info["cuda_available"] is False


def cubin_archs(path: str) -> set[int]:
    """SM architectures of the cubins embedded in an ELF's .nv_fatbin section."""
    data = Path(path).read_bytes()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = sections[shstrndx][4]
    archs: set[int] = set()
    for name, _type, _flags, _addr, off, size in sections:
        end = data.index(b"\0", names_off + name)
        if data[names_off + name : end] != b".nv_fatbin":
            continue
        blob = data[off : off + size]
        i = blob.find(b"\x7fELF")
        while i >= 0:
            (machine,) = struct.unpack_from("<H", blob, i + 18)
            (flags,) = struct.unpack_from("<I", blob, i + 48)
            if machine == 190:  # EM_CUDA; e_flags bits 8-15 hold the SM version
                archs.add((flags >> 8) & 0xFF)
            i = blob.find(b"\x7fELF", i + 4)
    return archs


@pytest.mark.skipif(
    shutil.which("nvcc") is None
    or os.environ.get("PSR_SKIP_CUDA_BUILD") == "1"
    or os.environ.get("PSR_CUDA", "").strip().lower() in ("0", "off", "false", "no"),
    reason="CUDA backend only built where nvcc exists and PSR_CUDA is not 0",
)
def test_cuda_backend_is_in_the_built_module() -> None:
    info = psr.backend_info()
    assert info["cuda_compiled"] is True
    assert info["cuda_runtime_version"] >= 12000
    want = {int(a.split("-")[0]) for a in info["cuda_archs"]}
    assert want, "architectures the module was built for"
    assert cubin_archs(_C.__file__) >= want


def test_backend_selection_and_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSR_BACKEND", "cpu")
    assert psr.current_backend() == "cpu"
    monkeypatch.setenv("PSR_BACKEND", "tpu")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        psr.current_backend()
    monkeypatch.delenv("PSR_BACKEND")
    psr.set_backend("cpu")
    try:
        assert psr.current_backend() == "cpu"
    finally:
        psr.set_backend(None)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            psr.set_backend("cuda")
        with pytest.raises(RuntimeError, match="CUDA"):
            make_store(backend="cuda")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_under_random_delays(seed: int) -> None:
    store = make_store(copy_delay_us=300, seed=seed)
    rng = random.Random(seed)
    issued = 0
    for _ in range(40):
        l = rng.randrange(len(store.layers))
        spec = store.layers[l]
        k = rng.randint(1, spec.num_slots)
        issued += k
        slots = rng.sample(range(spec.num_slots), k)
        experts = [rng.randrange(spec.num_experts) for _ in slots]
        store.enqueue_copies(l, slots, experts)
        # Wait on a random subset now, the rest maybe later (or never).
        waited = slots[: rng.randint(1, k)]
        with store.reading(l, waited, [experts[slots.index(s)] for s in waited]) as slab:
            for s in waited:
                e = store.slot_experts(l)[s]
                assert torch.equal(slab[s], store.host(l)[e]), (l, s, e)
    store.synchronize()
    for l in range(len(store.layers)):
        for s, e in enumerate(store.slot_experts(l)):
            if e >= 0:
                assert store.verify(l, s)
    c = store.counters()
    assert c["failed_copies"] == 0 and c["copies"] == issued  # each enqueued copy, once


def test_counters_count_copies_bytes_and_stalls() -> None:
    store = make_store(copy_delay_us=5000, seed=3)
    store.reset_counters()
    store.enqueue_copies(0, [0, 1, 2], [5, 6, 7])
    store.enqueue_copies(1, [0], [2])
    store.acquire(0, [0, 1, 2])
    store.release(0, [0, 1, 2])
    c = store.counters()
    eb = store.expert_bytes
    assert c["copies"] == 4
    assert c["bytes_copied"] == 3 * eb[0] + eb[1]
    assert c["waits"] == 3
    assert c["stall_s"] > 0 and c["stalled_waits"] >= 1
    store.reset_counters()
    assert store.counters()["copies"] == 0


def test_slab_is_a_view_that_outlives_the_wrapper() -> None:
    store = make_store()
    slab, host = store.slab(0), store.host(0)
    assert slab.shape == (4, 96) and slab.dtype == torch.bfloat16
    assert host.shape == (8, 96)
    store.enqueue_copies(0, [2], [7])
    store.acquire(0, [2], [7])
    store.release(0, [2])
    del store  # the capsules keep the C++ store alive
    assert torch.equal(slab[2], host[7])


def test_write_after_read_waits_for_the_reader() -> None:
    store = make_store(copy_delay_us=0)
    store.enqueue_copies(0, [1], [3])
    store.acquire(0, [1], [3])
    before = store.slab(0)[1].clone()
    store.enqueue_copies(0, [1], [4])  # slot is held: the copy must wait for release
    time.sleep(0.05)
    assert torch.equal(store.slab(0)[1], before), "slot overwritten while still being read"
    assert store.slot_experts(0)[1] == 4
    with pytest.raises(psr.StoreError, match="queued behind its own readers"):
        store.acquire(0, [1])
    # Other slots keep loading while this one waits (no head-of-line deadlock).
    store.enqueue_copies(0, [2], [5])
    store.acquire(0, [2], [5])
    store.release(0, [2])
    store.release(0, [1])
    store.acquire(0, [1], [4])
    assert torch.equal(store.slab(0)[1], store.host(0)[4])
    store.release(0, [1])


def test_write_after_read_with_nested_readers() -> None:
    store = make_store()
    store.enqueue_copies(0, [0], [1])
    store.acquire(0, [0])
    store.acquire(0, [0])
    assert store.readers(0)[0] == 2
    store.enqueue_copies(0, [0], [2])
    store.release(0, [0])
    time.sleep(0.02)
    assert torch.equal(store.slab(0)[0], store.host(0)[1])
    store.release(0, [0])
    store.acquire(0, [0], [2])
    assert torch.equal(store.slab(0)[0], store.host(0)[2])


def test_copy_failure_surfaces_at_wait_without_leaking_the_slot() -> None:
    store = make_store(copy_delay_us=200, seed=1, copy_retries=0)
    store.enqueue_copies(0, [0], [1])
    store.fail_next_copies(1)
    store.enqueue_copies(0, [1], [2])
    store.enqueue_copies(0, [2], [3])
    with pytest.raises(psr.CopyError, match="layer 0 expert 2 -> slot 1"):
        store.acquire(0, [0, 1, 2])
    # All or nothing: nothing held, the failed slot is empty and loadable again.
    assert store.readers(0) == [0, 0, 0, 0]
    assert store.slot_experts(0)[1] == -1
    assert store.counters()["failed_copies"] == 1 and store.counters()["retried_copies"] == 0
    with pytest.raises(psr.StoreError, match="never loaded"):
        store.acquire(0, [1])
    store.enqueue_copies(0, [1], [2])
    store.acquire(0, [0, 1, 2], [1, 2, 3])
    assert torch.equal(store.slab(0)[1], store.host(0)[2])
    store.release(0, [0, 1, 2])


def test_copy_failure_does_not_deadlock_a_waiting_thread() -> None:
    store = make_store(copy_delay_us=20000, seed=0)
    store.fail_next_copies(3)  # the copy and both retries
    store.enqueue_copies(0, [3], [0])
    err: list[BaseException] = []

    def waiter() -> None:
        try:
            store.acquire(0, [3])
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "acquire deadlocked on a failed copy"
    assert len(err) == 1 and isinstance(err[0], psr.CopyError)
    assert "after 2 retries" in str(err[0])


def test_environment_fault_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSR_COPY_DELAY_US", "4000")
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", "7")
    store = make_store()
    store.enqueue_copies(0, [0, 1, 2, 3], [0, 1, 2, 3])
    store.acquire(0, [3])
    assert store.counters()["stall_s"] > 0.001
    monkeypatch.setenv("PSR_COPY_DELAY_US", "-5")
    with pytest.raises(ValueError, match="PSR_COPY_DELAY_US"):
        make_store()
    monkeypatch.setenv("PSR_COPY_DELAY_US", "abc")
    with pytest.raises(ValueError, match="PSR_COPY_DELAY_US"):
        make_store()


# --- bad input ---------------------------------------------------------------


def test_bad_layer_slot_and_expert_indices() -> None:
    store = make_store()
    with pytest.raises(IndexError, match="layer 2 out of range"):
        store.enqueue_copies(2, [0], [0])
    with pytest.raises(IndexError, match="layer -1 out of range"):
        store.slab(-1)
    with pytest.raises(IndexError, match="slot 4 out of range"):
        store.enqueue_copies(0, [4], [0])
    with pytest.raises(IndexError, match="slot -1 out of range"):
        store.acquire(0, [-1])
    with pytest.raises(IndexError, match="expert 8 out of range"):
        store.enqueue_copies(0, [0], [8])
    with pytest.raises(IndexError, match="expert 6 out of range"):
        store.register(1, 6, torch.zeros(40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2 slots but 1 experts"):
        store.enqueue_copies(0, [0, 1], [0])
    with pytest.raises(ValueError, match="slot 1 appears twice"):
        store.enqueue_copies(0, [1, 1], [0, 2])
    # A rejected batch changes nothing.
    assert store.slot_experts(0) == [-1] * 4 and store.counters()["copies"] == 0


def test_unregistered_expert_and_never_loaded_slot() -> None:
    store = psr.ExpertStore([(4, 2, 8)], torch.float32, backend="cpu")
    store.register(0, 0, torch.zeros(8))
    with pytest.raises(ValueError, match="expert 3 of layer 0 is not registered"):
        store.enqueue_copies(0, [0], [3])
    with pytest.raises(psr.StoreError, match="slot 1, which was never loaded"):
        store.acquire(0, [1])
    store.enqueue_copies(0, [0], [0])
    with pytest.raises(psr.StoreError, match="holds expert 0, expected 2"):
        store.acquire(0, [0], [2])
    with pytest.raises(psr.StoreError, match="not held"):
        store.release(0, [0])
    store.acquire(0, [0])
    with pytest.raises(psr.StoreError, match="not held"):
        store.release(0, [0, 0])
    assert store.readers(0) == [1, 0]


def test_register_size_and_dtype_mismatch() -> None:
    store = psr.ExpertStore([(4, 2, 8)], torch.float16, backend="cpu")
    with pytest.raises(ValueError, match="expected 16 bytes, got 14"):
        store.register(0, 1, torch.zeros(7, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"dtype torch\.float32, store holds torch\.float16"):
        store.register(0, 1, torch.zeros(8, dtype=torch.float32))
    with pytest.raises(TypeError, match="not a tensor"):
        store.register(0, 1, [[0.0] * 8])
    # The C++ layer checks too, for callers that bypass the wrapper.
    t = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(ValueError, match="store holds float16, got float32"):
        store._store.register_expert(0, 1, "float32", [(t.data_ptr(), 16)])
    assert not store.is_registered(0, 1)
    # Non-contiguous parts are packed correctly.
    m = torch.arange(16, dtype=torch.float16).view(4, 4).t()[:2]
    store.register(0, 1, m)
    assert torch.equal(store.host(0)[1], m.reshape(-1))


def test_bad_layer_specs_and_allocation_failure() -> None:
    with pytest.raises(ValueError, match=r"num_slots must be in \[0, num_experts=4\], got 5"):
        psr.ExpertStore([(4, 5, 8)], torch.float32, backend="cpu")
    with pytest.raises(ValueError, match="num_experts must be positive"):
        psr.ExpertStore([(0, 0, 8)], torch.float32, backend="cpu")
    with pytest.raises(ValueError, match="at least one layer"):
        psr.ExpertStore([], torch.float32, backend="cpu")
    with pytest.raises(MemoryError, match=r"cannot allocate .* bytes of host memory"):
        psr.ExpertStore([(1 << 20, 1, 1 << 30)], torch.float32, backend="cpu")
    with pytest.raises(MemoryError, match="overflow"):
        psr.ExpertStore([(1 << 40, 1, 1 << 30)], torch.float32, backend="cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        psr.ExpertStore([(4, 2, 8)], torch.float32, backend="tpu")
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        psr.ExpertStore([(4, 2, 8)], "float32", backend="cpu")


def test_fault_injection_is_cpu_only_and_validated() -> None:
    store = make_store()
    with pytest.raises(ValueError, match=r"n must be in \[0, "):
        store.fail_next_copies(-1)
    with pytest.raises(ValueError, match="n must be >= 0"):  # the C++ check, for direct callers
        store._store.fail_next_copies(-1)


ASAN_SCRIPT = textwrap.dedent(
    """
    import random, sys, threading
    sys.path.insert(0, sys.argv[1])
    import _C
    import ctypes
    E, C, B = 6, 3, 4096
    s = _C.Store([(E, C, B), (E, C, B)], "uint8", 1, "cpu", 0, 200, 1, 1)
    bufs = [ctypes.create_string_buffer(bytes([e]) * B) for e in range(E)]
    for l in range(2):
        for e in range(E):
            s.register_expert(l, e, "uint8", [(ctypes.addressof(bufs[e]), B)])
    rng = random.Random(0)
    for i in range(300):
        l = rng.randrange(2); slots = rng.sample(range(C), 2)
        s.enqueue_copies(l, slots, [rng.randrange(E) for _ in slots])
        if i % 17 == 0:
            s.fail_next_copies(1 + i % 3)  # retried, or not enough retries
        try:
            s.acquire(l, slots)
            s.enqueue_copies(l, [slots[0]], [rng.randrange(E)])  # deferred behind the reader
            s.release(l, slots)
        except _C.CopyError:
            pass
        except RuntimeError:
            pass
    for bad in (lambda: s.enqueue_copies(5, [0], [0]), lambda: s.acquire(0, [9]),
                lambda: s.register_expert(0, 0, "uint8", [(ctypes.addressof(bufs[0]), 3)])):
        try:
            bad()
        except (IndexError, ValueError, RuntimeError):
            pass
    # Threads on distinct layers, then close() while a capsule (a view) is alive.
    def work(l):
        r = random.Random(l)
        for _ in range(100):
            slots = r.sample(range(C), 2)
            s.enqueue_copies(l, slots, [r.randrange(E) for _ in slots])
            s.acquire(l, slots)
            s.release(l, slots)
    ts = [threading.Thread(target=work, args=(l,)) for l in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    cap = s.slab_dlpack(0)
    s.synchronize()
    s.close()
    s.close()
    try:
        s.acquire(0, [0])
    except RuntimeError as e:
        assert "closed" in str(e)
    del s, cap  # the capsule frees the slab now (it was never consumed)
    print("asan-ok")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or shutil.which("cmake") is None, reason="linux+cmake")
@pytest.mark.skipif(
    bool(os.environ.get("PSR_SANITIZED")), reason="the whole run is already sanitized"
)
def test_store_is_clean_under_address_sanitizer(tmp_path: Path) -> None:
    # A standalone ASan+UBSan build of the CPU store (scripts/sanitize.sh runs the whole suite
    # that way). libstdc++ is preloaded with libasan so ASan can intercept C++ throws.
    libs = [
        subprocess.run(
            ["gcc", f"-print-file-name={lib}"], capture_output=True, text=True
        ).stdout.strip()
        for lib in ("libasan.so", "libubsan.so", "libstdc++.so")
    ]
    if not all(os.path.isabs(lib) for lib in libs):
        pytest.skip("libasan not found")
    import pybind11

    build = tmp_path / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build),
            "-G",
            "Ninja",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DPSR_WITH_CUDA=OFF",
            "-DPSR_SANITIZE=address,undefined",
            "-DCMAKE_BUILD_TYPE=Debug",
            f"-DPSR_OUTPUT_DIR={tmp_path}",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    script = tmp_path / "exercise.py"
    script.write_text(ASAN_SCRIPT)
    env = dict(
        os.environ,
        LD_PRELOAD=" ".join(libs),
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
    )
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0 and "asan-ok" in r.stdout, r.stderr[-4000:]
    assert "ERROR: AddressSanitizer" not in r.stderr
    assert "runtime error:" not in r.stderr  # UBSan


def test_ready_reports_finished_copies_without_blocking() -> None:
    store = make_store(copy_delay_us=50000, seed=0)
    assert store.ready(0) == [False] * 4
    store.enqueue_copies(0, [0, 1], [2, 3])
    assert store.ready(0)[:2] != [True, True]  # 50 ms copies cannot both be done yet
    store.acquire(0, [0, 1])
    store.release(0, [0, 1])
    assert store.ready(0) == [True, True, False, False]


# --- one name for copies, one module for the extension (tasks 1, 2) ------------------------


def test_copies_are_enqueued_by_one_name_only() -> None:
    assert hasattr(psr.ExpertStore, "enqueue_copies") and hasattr(_C.Store, "enqueue_copies")
    assert not hasattr(psr.ExpertStore, "load") and not hasattr(_C.Store, "load")


def test_backend_choice_lives_in_the_store_module() -> None:
    from psr import store

    assert importlib.util.find_spec("psr._backend") is None
    for name in ("cuda_available", "set_backend", "current_backend", "backend_info"):
        assert callable(getattr(store, name))
    assert store.backend_info()["extension"] == _C.__file__


# --- lifetime: close(), context manager, no cycles (task 3) -------------------------------


def test_close_is_idempotent_and_every_method_raises_after_it() -> None:
    store = make_store()
    store.enqueue_copies(0, [0], [1])
    slab, host = store.slab(0), store.host(0)
    assert not store.closed
    store.close()
    store.close()
    assert store.closed and "closed" in repr(store)
    calls = {
        "slab": lambda: store.slab(0),
        "host": lambda: store.host(0),
        "register": lambda: store.register(0, 0, torch.zeros(96, dtype=torch.bfloat16)),
        "is_registered": lambda: store.is_registered(0, 0),
        "enqueue_copies": lambda: store.enqueue_copies(0, [0], [1]),
        "acquire": lambda: store.acquire(0, [0]),
        "release": lambda: store.release(0, [0]),
        "slot_experts": lambda: store.slot_experts(0),
        "readers": lambda: store.readers(0),
        "ready": lambda: store.ready(0),
        "verify": lambda: store.verify(0, 0),
        "synchronize": store.synchronize,
        "counters": store.counters,
        "reset_counters": store.reset_counters,
        "set_copy_delay": lambda: store.set_copy_delay(1),
        "fail_next_copies": lambda: store.fail_next_copies(1),
        "expert_bytes": lambda: store.expert_bytes,
        "reading": lambda: store.reading(0, [0]).__enter__(),
        "__enter__": store.__enter__,
    }
    for name, call in calls.items():
        with pytest.raises(psr.StoreError, match="the store is closed"):
            call()
        assert name
    # Plain attributes stay readable; the views handed out stay valid (they own their buffer).
    assert store.backend == "cpu" and len(store.layers) == 2 and store.copy_retries == 2
    assert torch.equal(slab[0], host[1])


def test_native_store_raises_after_close_too() -> None:
    s = _C.Store([(4, 2, 8)], "uint8", 1)
    cap = s.host_dlpack(0)
    s.close()
    assert s.closed
    for call in (
        lambda: s.enqueue_copies(0, [0], [0]),
        lambda: s.acquire(0, [0]),
        lambda: s.counters(),
        lambda: s.slab_dlpack(0),
        lambda: s.spec(0),
    ):
        with pytest.raises(psr.StoreError, match="the store is closed"):
            call()
    assert torch.from_dlpack(cap).shape == (4, 8)  # exported before close: still valid


def test_context_manager_closes_and_joins_the_copy_thread() -> None:
    gc.collect()  # a store dropped by an earlier test must not end its thread mid-count
    before = copy_threads()
    with make_store(copy_delay_us=2000, seed=0) as store:
        assert copy_threads(before + 1) == before + 1  # the CPU backend's copy worker
        store.enqueue_copies(0, [0, 1, 2, 3], [0, 1, 2, 3])  # still queued at close
        slab, host = store.slab(0), store.host(0)
    assert store.closed and copy_threads(before) == before
    # close() finished the queued copies before stopping the worker.
    assert torch.equal(slab, host[:4])


def test_views_outlive_close_and_keep_their_buffers() -> None:
    store = psr.ExpertStore([(4, 2, 1 << 20)], torch.float32, backend="cpu")
    for e in range(4):
        store.register(0, e, torch.full((1 << 20,), float(e)))
    store.enqueue_copies(0, [1], [3])
    slab = store.slab(0)
    host_row = store.host(0)[2]
    store.close()
    del store
    gc.collect()
    assert slab[1].eq(3.0).all() and host_row.eq(2.0).all()
    slab[0].fill_(7.0)  # still our memory
    assert slab[0].sum().item() == 7.0 * (1 << 20)


def test_wrapper_holds_no_reference_cycle() -> None:
    gc.disable()
    try:
        store = make_store()
        store.enqueue_copies(0, [0], [0])
        with store.reading(0, [0]):
            pass
        assert sys.getrefcount(store) == 2  # the local and getrefcount's argument
        assert gc.get_referrers(store) == []  # no container holds it
        threads = copy_threads()
        ref = weakref.ref(store)
        del store
        assert ref() is None, "the wrapper survived its last reference (a cycle)"
        assert copy_threads(threads - 1) == threads - 1, "the copy thread outlived the store"
    finally:
        gc.enable()


_CYCLES = """
import gc, sys
sys.path.insert(0, sys.argv[1])
import torch
import psr
from procfs import copy_threads, rss_bytes

layers = [(16, 8, 64 * 1024)]  # float32: 256 KiB per expert
weights = [torch.full((64 * 1024,), float(e)) for e in range(16)]


def cycle() -> None:
    store = psr.ExpertStore(layers, torch.float32, backend="cpu", copy_delay_us=50)
    for e in range(16):
        store.register(0, e, weights[e])
    store.enqueue_copies(0, list(range(8)), list(range(8, 16)))
    with store.reading(0, [0, 7], [8, 15]) as slab:
        assert slab[7][0].item() == 15.0
    assert store.verify(0, 3)


gc.disable()
cycle()  # warm-up: allocator pools, torch's lazy state
threads, rss = copy_threads(), rss_bytes()
after = []
for _ in range(30):
    cycle()
    after.append(copy_threads(threads))
print(threads, max(after), rss_bytes() - rss)
"""


def test_create_use_drop_cycles_free_threads_and_memory_without_gc() -> None:
    """30 create/register/copy/drop cycles with the garbage collector off, in a process of
    their own (a test worker's other stores and threads, as under pytest-xdist, would be
    counted too).

    Each store holds 6 MiB (4 MiB host, 2 MiB slab): a leak would add 180 MiB over the cycles,
    an orphaned worker thread one thread per cycle. Bound: RSS grows by less than 24 MiB (four
    stores), and the thread count returns to where it started after every cycle."""
    nbytes = 16 * 64 * 1024 * 4 + 8 * 64 * 1024 * 4
    tests = str(Path(__file__).resolve().parents[1])
    r = subprocess.run(
        [sys.executable, "-c", _CYCLES, tests], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    threads, most, growth = (int(v) for v in r.stdout.split()[-3:])
    assert most == threads, f"{most - threads} copy thread(s) outlived their store"
    if os.environ.get("PSR_SANITIZED"):
        return  # ASan quarantines freed memory (256 MiB): RSS says nothing; ASan checks the rest
    assert growth < 4 * nbytes, f"RSS grew by {growth / 2**20:.1f} MiB over 30 cycles"


def test_close_waits_for_an_acquire_in_flight() -> None:
    store = make_store(copy_delay_us=0)
    store.set_copy_delay(200_000, seed=1)  # one long copy
    store.enqueue_copies(0, [0], [5])
    store.set_copy_delay(0)
    out: list[object] = []

    def waiter() -> None:
        try:
            store.acquire(0, [0], [5])
            out.append("held")
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)  # let the waiter reach acquire (a loaded CI core may start it late)
    store.close()  # waits for the acquire, which completes normally
    t.join(timeout=10)
    assert out == ["held"]


# --- retries (task 4) ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 2])
def test_failed_copies_are_retried_up_to_copy_retries(k: int) -> None:
    store = make_store(copy_delay_us=300, seed=k, copy_retries=2)
    store.reset_counters()
    store.fail_next_copies(k)
    store.enqueue_copies(0, [2], [5])
    store.acquire(0, [2], [5])
    assert store.readers(0)[2] == 1
    assert torch.equal(store.slab(0)[2], store.host(0)[5])
    store.release(0, [2])
    assert store.verify(0, 2)
    c = store.counters()
    eb = store.expert_bytes[0]
    # Counting rule: each issued copy, retries included, counts in copies and bytes_copied.
    assert c["copies"] == 1 + k and c["bytes_copied"] == (1 + k) * eb
    assert c["retried_copies"] == k and c["failed_copies"] == k
    assert c["waits"] == 1 + k  # the slot was waited for again after each retry


def test_copy_error_once_retries_are_exhausted_leaves_the_slot_empty() -> None:
    store = make_store(copy_delay_us=300, seed=4, copy_retries=2)
    store.enqueue_copies(0, [0], [1])  # a good copy in the same acquire
    store.fail_next_copies(3)
    store.enqueue_copies(0, [1], [2])
    with pytest.raises(psr.CopyError, match=r"layer 0 expert 2 -> slot 1.*after 2 retries"):
        store.acquire(0, [0, 1], [1, 2])
    assert store.readers(0) == [0, 0, 0, 0]  # all or nothing
    assert store.slot_experts(0)[:2] == [1, -1]
    c = store.counters()
    eb = store.expert_bytes[0]
    assert c["copies"] == 4 and c["bytes_copied"] == 4 * eb
    assert c["retried_copies"] == 2 and c["failed_copies"] == 3
    assert c["failed_copies"] - c["retried_copies"] == 1  # given up on
    # The failed slot is loadable again.
    store.enqueue_copies(0, [1], [2])
    with store.reading(0, [0, 1], [1, 2]) as slab:
        assert torch.equal(slab[1], store.host(0)[2])
    assert store.verify(0, 1) and store.verify(0, 0)
    assert store.counters()["copies"] == 5


def test_retries_are_per_slot_in_one_acquire() -> None:
    # Two slots, each failing once: both recover with one retry each.
    store = make_store(copy_retries=1)
    store.fail_next_copies(2)
    store.enqueue_copies(1, [0, 2], [3, 4])
    store.acquire(1, [0, 2], [3, 4])
    assert store.verify(1, 0) and store.verify(1, 2)
    c = store.counters()
    assert c["copies"] == 4 and c["retried_copies"] == 2 and c["failed_copies"] == 2


def test_copy_retries_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSR_COPY_RETRIES", "0")
    store = make_store()
    assert store.copy_retries == 0
    store.fail_next_copies(1)
    store.enqueue_copies(0, [0], [0])
    with pytest.raises(psr.CopyError):
        store.acquire(0, [0])
    assert make_store(copy_retries=5).copy_retries == 5  # the argument wins
    for bad in ("-1", "101", "2.5", "many"):
        monkeypatch.setenv("PSR_COPY_RETRIES", bad)
        with pytest.raises(
            ValueError, match=r"\$PSR_COPY_RETRIES must be an integer in \[0, 100\]"
        ):
            make_store()
    monkeypatch.delenv("PSR_COPY_RETRIES")
    assert make_store().copy_retries == 2


# --- clear errors (task 5) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("var", "value", "bound"),
    [
        ("PSR_COPY_DELAY_US", str(2**40), "4294967295"),
        ("PSR_COPY_DELAY_US", str(2**32), "4294967295"),
        ("PSR_COPY_DELAY_US", "-1", "4294967295"),
        ("PSR_COPY_DELAY_US", "4.7", "4294967295"),
        ("PSR_COPY_DELAY_SEED", str(2**64), "18446744073709551615"),
        ("PSR_COPY_DELAY_SEED", "-3", "18446744073709551615"),
        ("PSR_COPY_DELAY_SEED", "0x10", "18446744073709551615"),
    ],
)
def test_environment_values_out_of_range_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, bound: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=rf"\${var} must be an integer in \[0, {bound}\]") as e:
        make_store()
    assert "incompatible" not in str(e.value)


def test_environment_extremes_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSR_COPY_DELAY_US", "0")
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", str(2**64 - 1))
    make_store()
    store = make_store(copy_delay_us=2**32 - 1, seed=2**64 - 1)  # the C++ types' maxima
    store.set_copy_delay(0)


@pytest.mark.parametrize(
    ("kw", "value", "error"),
    [
        ("copy_delay_us", True, TypeError),
        ("copy_delay_us", 4.7, TypeError),
        ("copy_delay_us", "5", TypeError),
        ("copy_delay_us", -1, ValueError),
        ("copy_delay_us", 2**32, ValueError),
        ("seed", False, TypeError),
        ("seed", 1.0, TypeError),
        ("seed", -1, ValueError),
        ("seed", 2**64, ValueError),
        ("copy_retries", True, TypeError),
        ("copy_retries", 2.0, TypeError),
        ("copy_retries", -1, ValueError),
        ("copy_retries", 101, ValueError),
    ],
)
def test_bad_constructor_numbers_name_the_argument_and_range(
    kw: str, value: object, error: type[Exception]
) -> None:
    hi = {"copy_delay_us": 2**32 - 1, "seed": 2**64 - 1, "copy_retries": 100}[kw]
    with pytest.raises(error, match=rf"{kw} must be (an int )?in \[0, {hi}\]") as e:
        psr.ExpertStore([(4, 2, 8)], torch.float32, backend="cpu", **{kw: value})
    assert "incompatible" not in str(e.value)


def test_index_arguments_must_be_ints() -> None:
    store = make_store()
    cases = [
        (lambda: store.enqueue_copies(0, [1.0], [2]), r"enqueue_copies: slots\[0\] must be an int"),
        (lambda: store.enqueue_copies(0, [1], [True]), r"enqueue_copies: experts\[0\] must be"),
        (lambda: store.enqueue_copies(0, "01", [0, 1]), "enqueue_copies: slots must be a sequence"),
        (lambda: store.enqueue_copies(0.0, [1], [2]), "enqueue_copies: layer must be an int"),
        (lambda: store.acquire(0, [0.5]), r"acquire: slots\[0\] must be an int, got float 0.5"),
        (lambda: store.acquire(0, [0], [False]), r"acquire: experts\[0\] must be an int"),
        (lambda: store.acquire(True, [0]), "acquire: layer must be an int, got bool"),
        (lambda: store.release(0, [None]), r"release: slots\[0\] must be an int"),
        (lambda: store.acquire(0, torch.tensor([0.0])), r"acquire: slots\[0\] must be an int"),
        (lambda: store.verify(0, 1.5), "verify: slot must be an int"),
    ]
    for call, match in cases:
        with pytest.raises(TypeError, match=match):
            call()
    assert store.counters()["copies"] == 0
    with pytest.raises(IndexError, match="out of range"):
        store.enqueue_copies(0, [2**70], [0])
    # Integer-likes (torch / numpy integers) are accepted.
    store.enqueue_copies(0, torch.tensor([0, 1]), [torch.tensor(2), 3])
    store.acquire(0, torch.tensor([0, 1]), [2, 3])
    store.release(0, [0, 1])


def test_fault_injection_arguments_are_checked() -> None:
    store = make_store()
    with pytest.raises(ValueError, match=r"max_delay_us must be in \[0, 4294967295\]"):
        store.set_copy_delay(2**40)
    with pytest.raises(TypeError, match="seed must be an int"):
        store.set_copy_delay(10, seed=0.5)
    with pytest.raises(TypeError, match="n must be an int"):
        store.fail_next_copies(True)


# --- threads (task 6) ---------------------------------------------------------------------


def test_threads_copy_on_distinct_layers_while_one_reads_counters() -> None:
    L, E, C = 4, 8, 4
    store = make_store(layers=[(E, C, 256)] * L, copy_delay_us=200, seed=5)
    store.fail_next_copies(2)  # two failures land somewhere: retried, never raised
    rounds = 60
    errors: list[BaseException] = []
    issued = [0] * L
    stop = threading.Event()
    seen: list[dict] = []

    def worker(l: int) -> None:
        rng = random.Random(l)
        try:
            for _ in range(rounds):
                slots = rng.sample(range(C), rng.randint(1, C))
                experts = [rng.randrange(E) for _ in slots]
                store.enqueue_copies(l, slots, experts)
                issued[l] += len(slots)
                with store.reading(l, slots, experts) as slab:
                    for s, e in zip(slots, experts, strict=True):
                        assert torch.equal(slab[s], store.host(l)[e]), (l, s, e)
                # Released, not overwritten (only this thread copies into layer l): the
                # slots still hold the experts just read, and their copies are done.
                held, ready = store.slot_experts(l), store.ready(l)
                assert [held[s] for s in slots] == experts and all(ready[s] for s in slots)
        except BaseException as e:
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append(store.counters())
                time.sleep(0.001)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(l,)) for l in range(L)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stop.set()
    watcher.join(timeout=10)
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in [*threads, watcher])
    c = store.counters()
    eb = store.expert_bytes[0]
    assert c["retried_copies"] == 2 and c["failed_copies"] == 2
    assert c["copies"] == sum(issued) + 2 and c["bytes_copied"] == c["copies"] * eb
    assert len(seen) > 1
    for a, b in itertools.pairwise(seen):  # counters only grow, and consistently
        assert a["copies"] <= b["copies"] and b["bytes_copied"] == b["copies"] * eb
    for l in range(L):
        assert store.readers(l) == [0] * C
        for s, e in enumerate(store.slot_experts(l)):
            assert e < 0 or store.verify(l, s)
