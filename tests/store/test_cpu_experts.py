"""The CPU expert kernels (csrc/cpu/expert_gemv.*, psr.store.cpu_expert_ffn) against the
torch reference psr_kernels.expert_ffn_ref: every format, odd shapes, every ISA path this
CPU runs, one and two threads; determinism; the slot checks; a row that ends at an
unmapped page (the kernels never read past a row)."""

from __future__ import annotations

import ctypes
import mmap
import signal
import subprocess
import sys

import pytest
import torch

import psr_kernels as pk
from psr import store

# The fp32-activation path's references (the q8 path's: test_cpu_qdot.py).
pytestmark = pytest.mark.usefixtures("f32_dots")

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
QUANT = ["int8", "fp8", "int4"]
FORMATS = [(None, d) for d in FLOATS] + [(q, None) for q in QUANT]
FMT_IDS = ["fp32", "bf16", "fp16", *QUANT]
SHAPES = [(40, 24), (72, 56), (130, 66), (48, 32)]  # (H, F): not multiples of 16 but one
ISAS = store.cpu_isas()
THREADS = sorted({1, min(2, store.cpu_max_threads())})


def _group(H: int, F: int) -> int:
    """An int4 group valid for (H, F): 16 (several groups) where it divides both, else one
    group per row."""
    return 16 if H % 16 == 0 and F % 16 == 0 else 256


def _slab(H: int, F: int, C: int, fmt: str | None, dtype: torch.dtype | None, gs: int, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(C):
        gate = torch.randn(F, H, generator=g) / H**0.5
        up = torch.randn(F, H, generator=g) / H**0.5
        down = torch.randn(H, F, generator=g) / F**0.5
        if fmt is None:
            rows.append(pk.pack_expert(gate, up, down).to(dtype))
        else:
            rows.append(pk.quantize_expert(gate, up, down, fmt, group_size=gs))
    return torch.stack(rows)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32 sums of a few hundred products in another order: a few ulps of the largest term.
    scale = float(ref.abs().max()) + 1e-30
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=2e-5 * scale)


@pytest.mark.parametrize(("fmt", "dtype"), FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize(("H", "F"), SHAPES, ids=[f"{h}x{f}" for h, f in SHAPES])
def test_matches_reference(fmt, dtype, H, F) -> None:
    gs = _group(H, F)
    slab = _slab(H, F, 5, fmt, dtype, gs)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, H, generator=g)
    slots = torch.tensor([[0, 3, 4], [4, 4, 1], [2, 1, 0]])  # a repeat, the last row
    w = torch.rand(3, 3, generator=g)
    ref = pk.expert_ffn_ref(x, slab, slots, w, H, F, fmt=fmt, group_size=gs)
    for isa in ISAS:
        outs = [
            store.cpu_expert_ffn(
                x, slab, slots, w, H, F, fmt=fmt, group_size=gs, isa=isa, threads=t
            )
            for t in THREADS
        ]
        _close(outs[0], ref)
        for y in outs[1:]:  # the thread count never changes a result
            assert torch.equal(y, outs[0]), isa


@pytest.mark.parametrize("fmt", QUANT)
def test_every_code_decodes_exactly(fmt) -> None:
    """A gate row holding every code of the format (e4m3's subnormals and NaNs included), up
    and down codes of 1.0, scales 1, F = 1, and one-hot tokens: token j's output is
    silu(code j's value), compared per token with the reference's decoder."""
    H = 32 if fmt == "int4" else 256
    lay = pk.QuantLayout.of(fmt, H, 1, group_size=16)
    row = torch.zeros(lay.nbytes, dtype=torch.uint8)
    if fmt == "int4":  # every nibble, low and high: 0x10, 0x32, ..., 0xFE, twice
        codes = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2)
    else:
        codes = torch.arange(256)
    one = {"int8": 0x01, "fp8": 0x38, "int4": 0x11}[fmt]
    row[lay.gate : lay.gate + lay.row_bytes_h] = codes.to(torch.uint8)
    row[lay.up : lay.up + lay.row_bytes_h] = one
    row[lay.down : lay.down + H * lay.row_bytes_f] = 0x01 if fmt == "int4" else one
    scales = ((lay.gate_scale, lay.groups_h), (lay.up_scale, lay.groups_h), (lay.down_scale, H))
    for at, n in scales:
        row[at : at + 4 * n] = torch.ones(n).view(torch.uint8)
    slab = row[None]
    x = torch.eye(H)
    slots, w = torch.zeros(H, 1, dtype=torch.long), torch.ones(H, 1)
    ref = pk.expert_ffn_ref(x, slab, slots, w, H, 1, fmt=fmt, group_size=16)
    for isa in ISAS:
        y = store.cpu_expert_ffn(x, slab, slots, w, H, 1, fmt=fmt, group_size=16, isa=isa)
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize(("fmt", "dtype"), FORMATS, ids=FMT_IDS)
def test_deterministic_and_batch_one(fmt, dtype) -> None:
    """Repeated calls are bit-identical; each token of a T > 1 call equals its own T = 1
    call (tokens are computed independently)."""
    H, F = 72, 56
    slab = _slab(H, F, 6, fmt, dtype, 256)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, H, generator=g)
    slots = torch.randint(0, 6, (4, 2), generator=g)
    w = torch.rand(4, 2, generator=g)
    for isa in ISAS:
        kw = dict(fmt=fmt, group_size=256, isa=isa)
        a = store.cpu_expert_ffn(x, slab, slots, w, H, F, **kw)
        assert torch.equal(a, store.cpu_expert_ffn(x, slab, slots, w, H, F, **kw))
        for t in range(4):
            one = store.cpu_expert_ffn(
                x[t : t + 1], slab, slots[t : t + 1], w[t : t + 1], H, F, **kw
            )
            assert torch.equal(one[0], a[t])


def test_slot_table_ids_dtypes_and_out_dtype() -> None:
    """Expert ids through an int32 slot table (the device decode's map) equal the slots
    themselves; int32 ids equal int64 ids; bf16 x gives the fp32 result rounded once."""
    H, F = 40, 24
    slab = _slab(H, F, 4, None, torch.bfloat16, 128)
    table = torch.tensor([3, -1, 0, 2, 1], dtype=torch.int32)  # expert -> slot
    ids = torch.tensor([[0, 4, 2]])
    slots = table[ids].long()
    x, w = torch.randn(1, H), torch.rand(1, 3)
    ref = store.cpu_expert_ffn(x, slab, slots, w, H, F)
    assert torch.equal(store.cpu_expert_ffn(x, slab, ids, w, H, F, slot_table=table), ref)
    assert torch.equal(store.cpu_expert_ffn(x, slab, slots.int(), w, H, F), ref)
    xb = x.bfloat16()
    yb = store.cpu_expert_ffn(xb, slab, slots, w, H, F)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, store.cpu_expert_ffn(xb.float(), slab, slots, w, H, F).bfloat16())
    empty = store.cpu_expert_ffn(x, slab, slots[:, :0], w[:, :0], H, F)
    assert torch.equal(empty, torch.zeros(1, H))


def test_clamped_swiglu_activation() -> None:
    """gpt-oss's clamped SwiGLU against its formula in torch."""
    H, F, alpha, limit = 48, 32, 1.702, 0.5  # a small limit: the clamps bind
    slab = _slab(H, F, 3, None, torch.float32, 128)
    x, w = torch.randn(2, H) * 3, torch.rand(2, 2)
    slots = torch.tensor([[0, 2], [1, 0]])
    gate, up, down = pk.unpack_expert(slab[slots], H, F)
    gx = torch.einsum("tkfh,th->tkf", gate, x).clamp(max=limit)
    ux = torch.einsum("tkfh,th->tkf", up, x).clamp(-limit, limit)
    h = (ux + 1) * gx * torch.sigmoid(alpha * gx)
    ref = (torch.einsum("tkhf,tkf->tkh", down, h) * w[..., None]).sum(1)
    for isa in ISAS:
        y = store.cpu_expert_ffn(
            x, slab, slots, w, H, F, activation="swiglu_oai", alpha=alpha, limit=limit, isa=isa
        )
        _close(y, ref)


def test_bad_input_is_a_clear_error() -> None:
    H, F = 40, 24
    slab = _slab(H, F, 3, None, torch.float32, 128)
    x, w = torch.randn(1, H), torch.rand(1, 2)
    with pytest.raises(IndexError, match="slot 3 out of range"):
        store.cpu_expert_ffn(x, slab, torch.tensor([[0, 3]]), w, H, F)
    with pytest.raises(IndexError, match="slot -1 out of range"):
        store.cpu_expert_ffn(x, slab, torch.tensor([[-1, 0]]), w, H, F)
    table = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(IndexError, match="expert id 2 out of range"):
        store.cpu_expert_ffn(x, slab, torch.tensor([[0, 2]]), w, H, F, slot_table=table)
    with pytest.raises(ValueError, match="threads must be in"):
        store.cpu_expert_ffn(x, slab, torch.tensor([[0, 1]]), w, H, F, threads=10_000)
    with pytest.raises(ValueError, match="isa 'sse9'"):
        store.cpu_expert_ffn(x, slab, torch.tensor([[0, 1]]), w, H, F, isa="sse9")
    with pytest.raises(ValueError, match="part down"):  # rows too short for (H, F)
        store.cpu_expert_ffn(x, slab[:, :-1], torch.tensor([[0, 1]]), w, H, F)
    q = _slab(H, F, 2, "int8", None, 128)
    with pytest.raises(ValueError, match="rows hold"):
        store.cpu_expert_ffn(x, q[:, :-16], torch.tensor([[0, 1]]), w, H, F, fmt="int8")
    with pytest.raises(ValueError, match="float rows"):
        store.cpu_expert_ffn(x, slab.double(), torch.tensor([[0, 1]]), w, H, F)


PROT_NONE = 0


def _guarded(nbytes: int) -> tuple[mmap.mmap, memoryview, int]:
    """An mmap whose last page is PROT_NONE, and the offset at which `nbytes` end exactly at
    that page."""
    page = mmap.PAGESIZE
    n = (nbytes + page - 1) // page + 1
    mm = mmap.mmap(-1, n * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    buf = (ctypes.c_char * (n * page)).from_buffer(mm)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(ctypes.addressof(buf) + (n - 1) * page, page, PROT_NONE) != 0:
        pytest.skip(f"mprotect failed (errno {ctypes.get_errno()})")
    return mm, memoryview(buf).cast("B"), (n - 1) * page - nbytes


@pytest.mark.parametrize(("fmt", "dtype"), FORMATS, ids=FMT_IDS)
def test_never_reads_past_a_row(fmt, dtype) -> None:
    """The routed row is the last before an unmapped page: any read past it faults."""
    H, F = 130, 66
    src = _slab(H, F, 2, fmt, dtype, 256)
    nbytes = src.numel() * src.element_size()
    _mm, view, at = _guarded(nbytes)  # the map stays alive while its view is used
    try:
        flat = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=at)
        rows = flat.view(src.dtype).view(src.shape)
        rows.copy_(src)
        x, w = torch.randn(1, H), torch.rand(1, 2)
        slots = torch.tensor([[1, 1]])
        ref = pk.expert_ffn_ref(x, src, slots, w, H, F, fmt=fmt, group_size=256)
        for isa in ISAS:
            y = store.cpu_expert_ffn(x, rows, slots, w, H, F, fmt=fmt, group_size=256, isa=isa)
            _close(y, ref)
        del flat, rows
    finally:
        view.release()


def test_the_guard_page_faults() -> None:
    """The guard is real: one byte read past such a row kills a process (SIGSEGV)."""
    code = (
        "import ctypes, mmap\n"
        "mm = mmap.mmap(-1, 2 * mmap.PAGESIZE)\n"
        "buf = (ctypes.c_char * (2 * mmap.PAGESIZE)).from_buffer(mm)\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
        "assert libc.mprotect(ctypes.addressof(buf) + mmap.PAGESIZE, mmap.PAGESIZE, 0) == 0\n"
        "ctypes.string_at(ctypes.addressof(buf) + mmap.PAGESIZE - 1, 1)\n"
        "print('in bounds ok', flush=True)\n"
        "ctypes.string_at(ctypes.addressof(buf) + mmap.PAGESIZE, 1)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # Under scripts/sanitize.sh the child inherits ASan, which reports the SEGV and exits 1.
    segv = r.returncode == -signal.SIGSEGV or (r.returncode != 0 and "SEGV" in r.stderr)
    assert "in bounds ok" in r.stdout and segv, (r.returncode, r.stderr)


def test_triad_reports_bandwidth() -> None:
    bw = store.cpu_triad(1 << 16, threads=1, reps=2)
    assert 1e8 < bw < 1e13  # bytes/s: between 100 MB/s and 10 TB/s
