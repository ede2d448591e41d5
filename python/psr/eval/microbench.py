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
    copies run beside a compute loop (1.0 = perfect overlap, 0.5 = serial).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from psr.store import ExpertStore, LayerSpec


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
) -> CopyBenchResult:
    """Run the benchmark once; every figure comes from this one run."""
    threads = torch.get_num_threads()
    b = CopyOverlapBench(shape, num_experts, num_slots, backend=backend)
    if b.store.backend == "cpu":
        # The CPU backend's copy worker is a thread: leave it a core, as a GPU
        # leaves its copy engine free of the SMs.
        torch.set_num_threads(1)
    try:
        return _measure(b, num_slots, repeats)
    finally:
        torch.set_num_threads(threads)


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
