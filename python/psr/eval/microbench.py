"""Copy/compute overlap microbenchmark of the expert store.

Measured side by side in one run:
  * the copy engine's bandwidth vs a plain copy of the same bytes (host->host
    torch copy on the CPU backend; pinned-host -> GPU `copy_(non_blocking=True)`
    on CUDA);
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

    def table(self) -> str:
        rows = [
            ("backend", self.backend),
            ("expert size (MiB)", f"{self.expert_mib:.1f}"),
            ("copies per round", f"{self.copies}"),
            ("copy engine GB/s", f"{self.engine_gbps:.2f}"),
            (f"{self.reference} GB/s", f"{self.reference_gbps:.2f}"),
            ("engine / reference", f"{self.engine_gbps / self.reference_gbps:.2f}x"),
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
        self.a = torch.randn(512, 512, device=dev)
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
        """Pick compute_iters so compute takes about as long as one copy round."""
        self.compute_iters = 1
        t1 = _time(self.compute, 3)
        self.compute_iters = max(1, round(t_copy / max(t1, 1e-9)))


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
    )
