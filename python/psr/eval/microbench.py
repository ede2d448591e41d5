"""Copy/compute overlap microbenchmark of the expert store.

Measured side by side in one run:
  * the copy engine's bandwidth vs a plain copy of the same bytes (host->host
    torch copy on the CPU backend; pinned-host -> GPU `copy_(non_blocking=True)`
    on CUDA, from the store's own host buffer);
  * the peak: the best plain copy of the same bytes: the reference, or from a buffer torch
    pinned itself (`pin_memory=True`) as one copy or as one copy per expert
    (`engine_vs_peak` = engine / peak; a store whose host memory were not pinned would
    fall behind the torch-pinned copies here);
  * overlap efficiency `max(t_copy, t_compute) / t_both` when expert-sized
    copies run beside a compute loop (1.0 = perfect overlap, 0.5 = serial);
  * per expert format (bf16, int8, fp8, int4; `formats`): the engine's GB/s and time per
    expert copy with rows of that format's byte size for an expert of the same H x F
    (`psr_kernels.QuantLayout.of(fmt, H, F).nbytes`; bf16: 3*H*F*2), the formats' rounds
    interleaved, and each format's copy time over bf16's against its bytes ratio, which is
    what the latency model assumes (`simulate` prices a copy by expert_bytes * bytes_ratio).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

import psr_kernels as pk
from psr.store import ExpertStore, LayerSpec
from psr.vocab import QUANT_FORMATS

# The expert formats with rows of their own byte size (not "native"), bf16 first: the
# reference the others' copy times are compared to.
COPY_FORMATS: tuple[str, ...] = ("bf16", *QUANT_FORMATS)


@dataclass
class CopyBenchResult:
    backend: str
    expert_mib: float
    copies: int
    engine_gbps: float
    reference_gbps: float
    reference: str
    t_copy_ms: float
    t_compute_ms: float
    t_both_ms: float
    overlap_efficiency: float
    peak_gbps: float = float("nan")
    peak: str = ""
    engine_vs_peak: float = float("nan")
    repeats: int = 0
    # Per expert format (`measure_format_copies`): {fmt: {row_bytes, bytes_ratio, gbps,
    # copy_ms, time_ratio_vs_bf16, ratio_error, abs_ratio_error}}; hidden x ffn of the rows.
    formats: dict = field(default_factory=dict)
    format_shape: list = field(default_factory=list)

    def table(self) -> str:
        rows = [
            ("backend", self.backend),
            ("expert size (MiB)", f"{self.expert_mib:.1f}"),
            ("copies per round", f"{self.copies}"),
            ("copy engine GB/s", f"{self.engine_gbps:.2f}"),
            (f"{self.reference} GB/s", f"{self.reference_gbps:.2f}"),
            ("engine / reference", f"{self.engine_gbps / self.reference_gbps:.2f}x"),
            (f"peak: {self.peak} GB/s", f"{self.peak_gbps:.2f}"),
            ("engine / peak", f"{self.engine_vs_peak:.2f}"),
            ("t_copy ms", f"{self.t_copy_ms:.2f}"),
            ("t_compute ms", f"{self.t_compute_ms:.2f}"),
            ("t_both ms", f"{self.t_both_ms:.2f}"),
            ("overlap max(copy,compute)/both", f"{self.overlap_efficiency:.2f}"),
        ]
        if self.formats:
            H, F = self.format_shape
            rows.append(("per format (H x F)", f"{H} x {F}: ms/copy, GB/s, time/bf16, bytes/bf16"))
        for fmt, d in self.formats.items():
            rows.append(
                (
                    f"  {fmt} ({d['row_bytes'] / 2**20:.2f} MiB)",
                    f"{d['copy_ms']:.4f} ms  {d['gbps']:.2f} GB/s  "
                    f"{d['time_ratio_vs_bf16']:.3f}x  (bytes {d['bytes_ratio']:.3f}x, "
                    f"error {d['ratio_error']:+.1%})",
                )
            )
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(store: ExpertStore) -> None:
    if store.backend == "cuda":
        torch.cuda.synchronize(store.device)


class CopyOverlapBench:
    """Holds a store with `num_experts` registered experts of `shape` and `num_slots` slots."""

    def __init__(
        self,
        shape: tuple[int, ...] = (3, 2048, 1024),
        num_experts: int = 8,
        num_slots: int = 4,
        dtype: torch.dtype = torch.bfloat16,
        backend: str | None = None,
    ) -> None:
        numel = 1
        for d in shape:
            numel *= d
        self.store = ExpertStore([LayerSpec(num_experts, num_slots, numel)], dtype, backend=backend)
        gen = torch.Generator().manual_seed(0)
        for e in range(num_experts):
            self.store.register(0, e, torch.randn(numel, generator=gen).to(dtype))
        self.num_slots, self.num_experts = num_slots, num_experts
        self.nbytes = self.store.expert_bytes[0]
        self._round = 0
        dev = self.store.device
        # Reference copy: same bytes, the plain framework path.
        self.ref_src = self.store.host(0)[:num_slots]
        self.ref_dst = torch.empty_like(self.ref_src, device=dev)
        # Peak: the same bytes from memory torch pinned itself (plain pinned copies).
        pin = dev.type == "cuda"
        self.peak_src = torch.empty(self.ref_src.shape, dtype=self.ref_src.dtype, pin_memory=pin)
        self.peak_src.copy_(self.ref_src)
        # Compute: GPU-bound bf16 GEMMs on CUDA (SMs and HBM busy beside the DMA engine),
        # small fp32 ones on the CPU.
        n, cdt = (2048, torch.bfloat16) if dev.type == "cuda" else (512, torch.float32)
        self.a = (torch.randn(n, n, device=dev) / n**0.5).to(cdt)
        self.compute_iters = 1

    def copy_round(self) -> None:
        """Load every slot with a different expert than last round, then wait for all."""
        self._round += 1
        slots = list(range(self.num_slots))
        experts = [(s + self._round) % self.num_experts for s in slots]
        self.store.enqueue_copies(0, slots, experts)
        self.store.acquire(0, slots)
        self.store.release(0, slots)
        _sync(self.store)

    def reference_round(self) -> None:
        self.ref_dst.copy_(self.ref_src, non_blocking=True)
        _sync(self.store)

    def peak_round(self) -> None:
        """One plain copy of all the bytes, from torch-pinned memory."""
        self.ref_dst.copy_(self.peak_src, non_blocking=True)
        _sync(self.store)

    def peak_per_expert_round(self) -> None:
        """The same bytes as one plain copy per expert (the engine's granularity)."""
        for i in range(self.num_slots):
            self.ref_dst[i].copy_(self.peak_src[i], non_blocking=True)
        _sync(self.store)

    def compute(self) -> torch.Tensor:
        x = self.a
        for _ in range(self.compute_iters):
            x = torch.tanh(x @ self.a)
        _sync(self.store)
        return x

    def both_round(self) -> None:
        self._round += 1
        slots = list(range(self.num_slots))
        self.store.enqueue_copies(0, slots, [(s + self._round) % self.num_experts for s in slots])
        self.compute()
        self.store.acquire(0, slots)
        self.store.release(0, slots)
        _sync(self.store)

    def calibrate(self, t_copy: float) -> None:
        """Pick compute_iters so compute takes about as long as one copy round (the
        per-iteration time from 1 vs 11 iterations, so the sync's latency does not count)."""
        self.compute_iters = 1
        t1 = _time(self.compute, 3)
        self.compute_iters = 11
        t11 = _time(self.compute, 3)
        per_iter = max((t11 - t1) / 10, t1 / 100, 1e-9)
        self.compute_iters = max(1, round(t_copy / per_iter))


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_copy_overlap(
    shape: tuple[int, ...] = (3, 2048, 1024),
    num_experts: int = 8,
    num_slots: int = 4,
    repeats: int = 5,
    backend: str | None = None,
    formats: tuple[str, ...] | None = None,
) -> CopyBenchResult:
    """Run the benchmark once; every figure comes from this one run.

    `formats` (default: COPY_FORMATS when `shape` is an expert's (3, H, F), else none):
    the expert formats whose copies are also timed, rows of each format's byte size for
    that H x F (`measure_format_copies`)."""
    threads = torch.get_num_threads()
    b = CopyOverlapBench(shape, num_experts, num_slots, backend=backend)
    if formats is None:
        formats = COPY_FORMATS if len(shape) == 3 and shape[0] == 3 else ()
    if b.store.backend == "cpu":
        # The CPU backend's copy worker is a thread: leave it a core, as a GPU
        # leaves its copy engine free of the SMs.
        torch.set_num_threads(1)
    try:
        r = _measure(b, num_slots, repeats)
        if formats:
            H, F = shape[1], shape[2]
            r.formats = measure_format_copies(
                formats, H, F, num_experts, num_slots, repeats, backend=b.store.backend
            )
            r.format_shape = [H, F]
        return r
    finally:
        torch.set_num_threads(threads)


def format_row_bytes(fmt: str, hidden_size: int, ffn_size: int) -> int:
    """Bytes of one expert's row in the host store: bf16 gate, up, down back to back, or a
    quantized format's packed uint8 row (weights + fp32 scales, `QuantLayout`)."""
    return pk.RowFormat.parse(fmt).row_bytes(hidden_size, ffn_size)


def measure_format_copies(
    formats: tuple[str, ...],
    hidden_size: int,
    ffn_size: int,
    num_experts: int = 8,
    num_slots: int = 4,
    repeats: int = 5,
    backend: str | None = None,
) -> dict[str, dict]:
    """The copy engine per expert format, side by side: one uint8 store per format (rows
    of the format's byte size; the bytes are random: a copy moves bytes, whatever they
    encode), rounds of `num_slots` copies of different experts, the formats interleaved
    round by round (drift hits them alike); the best round of `repeats` per format.

    Per format: row_bytes, bytes_ratio (row bytes / bf16 row bytes), gbps, copy_ms (per
    expert copy), time_ratio_vs_bf16 (copy_ms / bf16's; NaN without bf16), ratio_error
    (time_ratio / bytes_ratio - 1: 0 where copy time is proportional to bytes, as the
    latency model prices it) and abs_ratio_error."""
    formats = tuple(dict.fromkeys(formats))
    bf16_bytes = format_row_bytes("bf16", hidden_size, ffn_size)
    gen = torch.Generator().manual_seed(1)
    stores: dict[str, ExpertStore] = {}
    try:
        for fmt in formats:
            nb = format_row_bytes(fmt, hidden_size, ffn_size)
            st = ExpertStore([LayerSpec(num_experts, num_slots, nb)], torch.uint8, backend=backend)
            row = torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=gen)
            for e in range(num_experts):
                st.register(0, e, row)
            stores[fmt] = st
        slots = list(range(num_slots))
        best = dict.fromkeys(formats, float("inf"))
        for r in range(repeats + 1):  # round 0 warms up
            for fmt, st in stores.items():
                experts = [(s + r + 1) % num_experts for s in slots]
                _sync(st)
                t0 = time.perf_counter()
                st.enqueue_copies(0, slots, experts)
                st.acquire(0, slots)
                st.release(0, slots)
                _sync(st)
                if r:
                    best[fmt] = min(best[fmt], time.perf_counter() - t0)
        out: dict[str, dict] = {}
        for fmt, st in stores.items():
            nb = st.expert_bytes[0]
            t = best[fmt] / num_slots
            out[fmt] = {
                "row_bytes": nb,
                "bytes_ratio": nb / bf16_bytes,
                "gbps": nb / t / 1e9,
                "copy_ms": t * 1e3,
            }
        base = out.get("bf16")
        for d in out.values():
            tr = d["copy_ms"] / base["copy_ms"] if base else math.nan
            d["time_ratio_vs_bf16"] = tr
            d["ratio_error"] = tr / d["bytes_ratio"] - 1
            d["abs_ratio_error"] = abs(d["ratio_error"])
        return out
    finally:
        for st in stores.values():
            st.close()


def _measure(b: CopyOverlapBench, num_slots: int, repeats: int) -> CopyBenchResult:
    total = b.nbytes * num_slots
    t_copy = _time(b.copy_round, repeats)
    t_ref = _time(b.reference_round, repeats)
    t_peak1 = _time(b.peak_round, repeats)
    t_peak_e = _time(b.peak_per_expert_round, repeats)
    t_peak = min(t_ref, t_peak1, t_peak_e)  # the best plain copy of the same bytes
    b.calibrate(t_copy)
    t_compute = _time(b.compute, repeats)
    t_both = _time(b.both_round, repeats)
    return CopyBenchResult(
        backend=b.store.backend,
        expert_mib=b.nbytes / 2**20,
        copies=num_slots,
        engine_gbps=total / t_copy / 1e9,
        reference_gbps=total / t_ref / 1e9,
        reference="pinned copy_(non_blocking)" if b.store.backend == "cuda" else "torch host copy_",
        t_copy_ms=t_copy * 1e3,
        t_compute_ms=t_compute * 1e3,
        t_both_ms=t_both * 1e3,
        overlap_efficiency=max(t_copy, t_compute) / t_both,
        peak_gbps=total / t_peak / 1e9,
        peak=(
            ("pinned copy_" if b.store.backend == "cuda" else "host copy_")
            + (
                " (store's host buffer)"
                if t_peak == t_ref
                else " (one copy)"
                if t_peak == t_peak1
                else " (per expert)"
            )
        ),
        engine_vs_peak=t_peak / t_copy,
        repeats=repeats,
    )
