"""The C++ expert store: contents, ordering, failures and bad input (CPU backend)."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import psr
from psr import _C

ROOT = Path(__file__).resolve().parents[1]


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
    shutil.which("nvcc") is None or os.environ.get("PSR_SKIP_CUDA_BUILD") == "1",
    reason="CUDA backend only built where nvcc exists",
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
    for _ in range(40):
        l = rng.randrange(len(store.layers))
        spec = store.layers[l]
        k = rng.randint(1, spec.num_slots)
        slots = rng.sample(range(spec.num_slots), k)
        experts = [rng.randrange(spec.num_experts) for _ in slots]
        store.load(l, slots, experts)
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
    assert c["failed_copies"] == 0 and c["copies"] >= 40


def test_counters_count_copies_bytes_and_stalls() -> None:
    store = make_store(copy_delay_us=5000, seed=3)
    store.reset_counters()
    store.load(0, [0, 1, 2], [5, 6, 7])
    store.load(1, [0], [2])
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
    store.load(0, [2], [7])
    store.acquire(0, [2], [7])
    store.release(0, [2])
    del store  # the capsules keep the C++ store alive
    assert torch.equal(slab[2], host[7])


def test_write_after_read_waits_for_the_reader() -> None:
    store = make_store(copy_delay_us=0)
    store.load(0, [1], [3])
    store.acquire(0, [1], [3])
    before = store.slab(0)[1].clone()
    store.load(0, [1], [4])  # slot is held: the copy must wait for release
    time.sleep(0.05)
    assert torch.equal(store.slab(0)[1], before), "slot overwritten while still being read"
    assert store.slot_experts(0)[1] == 4
    with pytest.raises(psr.StoreError, match="queued behind its own readers"):
        store.acquire(0, [1])
    # Other slots keep loading while this one waits (no head-of-line deadlock).
    store.load(0, [2], [5])
    store.acquire(0, [2], [5])
    store.release(0, [2])
    store.release(0, [1])
    store.acquire(0, [1], [4])
    assert torch.equal(store.slab(0)[1], store.host(0)[4])
    store.release(0, [1])


def test_write_after_read_with_nested_readers() -> None:
    store = make_store()
    store.load(0, [0], [1])
    store.acquire(0, [0])
    store.acquire(0, [0])
    assert store.readers(0)[0] == 2
    store.load(0, [0], [2])
    store.release(0, [0])
    time.sleep(0.02)
    assert torch.equal(store.slab(0)[0], store.host(0)[1])
    store.release(0, [0])
    store.acquire(0, [0], [2])
    assert torch.equal(store.slab(0)[0], store.host(0)[2])


def test_copy_failure_surfaces_at_wait_without_leaking_the_slot() -> None:
    store = make_store(copy_delay_us=200, seed=1)
    store.load(0, [0], [1])
    store.fail_next_copies(1)
    store.load(0, [1], [2])
    store.load(0, [2], [3])
    with pytest.raises(psr.CopyError, match="layer 0 expert 2 -> slot 1"):
        store.acquire(0, [0, 1, 2])
    # All or nothing: nothing held, the failed slot is empty and loadable again.
    assert store.readers(0) == [0, 0, 0, 0]
    assert store.slot_experts(0)[1] == -1
    assert store.counters()["failed_copies"] == 1
    with pytest.raises(psr.StoreError, match="never loaded"):
        store.acquire(0, [1])
    store.load(0, [1], [2])
    store.acquire(0, [0, 1, 2], [1, 2, 3])
    assert torch.equal(store.slab(0)[1], store.host(0)[2])
    store.release(0, [0, 1, 2])


def test_copy_failure_does_not_deadlock_a_waiting_thread() -> None:
    store = make_store(copy_delay_us=20000, seed=0)
    store.fail_next_copies(1)
    store.load(0, [3], [0])
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


def test_environment_fault_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSR_COPY_DELAY_US", "4000")
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", "7")
    store = make_store()
    store.load(0, [0, 1, 2, 3], [0, 1, 2, 3])
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
        store.load(2, [0], [0])
    with pytest.raises(IndexError, match="layer -1 out of range"):
        store.slab(-1)
    with pytest.raises(IndexError, match="slot 4 out of range"):
        store.load(0, [4], [0])
    with pytest.raises(IndexError, match="slot -1 out of range"):
        store.acquire(0, [-1])
    with pytest.raises(IndexError, match="expert 8 out of range"):
        store.load(0, [0], [8])
    with pytest.raises(IndexError, match="expert 6 out of range"):
        store.register(1, 6, torch.zeros(40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2 slots but 1 experts"):
        store.load(0, [0, 1], [0])
    with pytest.raises(ValueError, match="slot 1 appears twice"):
        store.load(0, [1, 1], [0, 2])
    # A rejected batch changes nothing.
    assert store.slot_experts(0) == [-1] * 4 and store.counters()["copies"] == 0


def test_unregistered_expert_and_never_loaded_slot() -> None:
    store = psr.ExpertStore([(4, 2, 8)], torch.float32, backend="cpu")
    store.register(0, 0, torch.zeros(8))
    with pytest.raises(ValueError, match="expert 3 of layer 0 is not registered"):
        store.load(0, [0], [3])
    with pytest.raises(psr.StoreError, match="slot 1, which was never loaded"):
        store.acquire(0, [1])
    store.load(0, [0], [0])
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
    with pytest.raises(ValueError, match=r"num_slots must be in \[1, num_experts=4\], got 5"):
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
    with pytest.raises(ValueError, match="n must be >= 0"):
        store.fail_next_copies(-1)


ASAN_SCRIPT = textwrap.dedent(
    """
    import random, sys, threading
    sys.path.insert(0, sys.argv[1])
    import _C
    import ctypes
    E, C, B = 6, 3, 4096
    s = _C.Store([(E, C, B), (E, C, B)], "uint8", 1, "cpu", 0, 200, 1)
    bufs = [ctypes.create_string_buffer(bytes([e]) * B) for e in range(E)]
    for l in range(2):
        for e in range(E):
            s.register_expert(l, e, "uint8", [(ctypes.addressof(bufs[e]), B)])
    rng = random.Random(0)
    for i in range(300):
        l = rng.randrange(2); slots = rng.sample(range(C), 2)
        s.load(l, slots, [rng.randrange(E) for _ in slots])
        if i % 17 == 0:
            s.fail_next_copies(1)
        try:
            s.acquire(l, slots)
            s.load(l, [slots[0]], [rng.randrange(E)])  # deferred behind the reader
            s.release(l, slots)
        except _C.CopyError:
            pass
        except RuntimeError:
            pass
    for bad in (lambda: s.load(5, [0], [0]), lambda: s.acquire(0, [9]),
                lambda: s.register_expert(0, 0, "uint8", [(ctypes.addressof(bufs[0]), 3)])):
        try:
            bad()
        except (IndexError, ValueError, RuntimeError):
            pass
    cap = s.slab_dlpack(0)
    s.synchronize()
    del s, cap
    print("asan-ok")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or shutil.which("cmake") is None, reason="linux+cmake")
def test_store_is_clean_under_address_sanitizer(tmp_path: Path) -> None:
    # libstdc++ is preloaded with libasan so ASan can intercept C++ throws.
    libs = [
        subprocess.run(
            ["gcc", f"-print-file-name={lib}"], capture_output=True, text=True
        ).stdout.strip()
        for lib in ("libasan.so", "libstdc++.so")
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
            "-DPSR_SANITIZE=address",
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
        os.environ, LD_PRELOAD=" ".join(libs), ASAN_OPTIONS="detect_leaks=0:abort_on_error=0"
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


def test_ready_reports_finished_copies_without_blocking() -> None:
    store = make_store(copy_delay_us=50000, seed=0)
    assert store.ready(0) == [False] * 4
    store.load(0, [0, 1], [2, 3])
    assert store.ready(0)[:2] != [True, True]  # 50 ms copies cannot both be done yet
    store.acquire(0, [0, 1])
    store.release(0, [0, 1])
    assert store.ready(0) == [True, True, False, False]
