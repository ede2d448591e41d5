"""`psr bench machine`: this machine's costs of a miss computed on the CPU and of a miss
copied, measured at one expert shape and format, into the profile psr.machine keeps (and
`experts_on="hybrid"` chooses its per-layer cap from).

Measured (median of `repeats` timed calls after one warm-up):
  cpu_expert_s   `psr.store.cpu_expert_ffn` over `top_k` distinct experts of random rows
                 of this shape and format, one token, threads = torch.get_num_threads(),
                 divided by top_k (the per-expert slope; the call's fixed part is below);
  cpu_fixed_s    one call of one tiny expert (H = F = 16, fp32): the hand-over of x and
                 ids, the pool's wake-up and the result, what every CPU-experts call pays;
                 on CUDA, the device step's hand-off of it (`ExpertStore.cpu_experts` +
                 `cpu_join` on a CUDA store, to the stream's end: the staging copies, the
                 host function's wake-up and the copy back);
  triad          `psr.store.cpu_triad` (STREAM a = b + s c) at the same threads;
  copy_s         (CUDA) one expert's host-to-device copy through the expert store
                 (enqueue_copies + acquire of top_k experts, divided by top_k).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import psr.machine as mc
import psr_kernels as pk
from psr.store import ExpertStore, LayerSpec, cpu_expert_ffn, cpu_layout, cpu_triad

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: the pool's threads, first-touch pages
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def random_rows(experts: int, hidden: int, ffn: int, fmt: str, seed: int = 0) -> torch.Tensor:
    """`experts` random expert rows of this shape in `fmt` (a float dtype name, or a
    psr_kernels quantized format: uint8 rows)."""
    g = torch.Generator().manual_seed(seed)
    if fmt in FLOAT_FORMATS:
        rows = torch.randn(experts, 3 * hidden * ffn, generator=g) * 0.02
        return rows.to(FLOAT_FORMATS[fmt])
    if fmt not in pk.QUANT_FORMATS:
        raise ValueError(
            f"psr bench machine: format {fmt!r} is not one of "
            f"{', '.join([*FLOAT_FORMATS, *pk.QUANT_FORMATS])}"
        )
    out = []
    for _ in range(experts):
        gate, up = (torch.randn(ffn, hidden, generator=g) * 0.02 for _ in range(2))
        down = torch.randn(hidden, ffn, generator=g) * 0.02
        out.append(pk.quantize_expert(gate, up, down, fmt))
    return torch.stack(out)


def cpu_expert_time(
    hidden: int, ffn: int, fmt: str, top_k: int, repeats: int, experts: int
) -> tuple[float, int]:
    """(seconds per expert on the CPU kernels, bytes per row) at this shape and format."""
    rows = random_rows(experts, hidden, ffn, fmt)
    qfmt = None if fmt in FLOAT_FORMATS else fmt
    x = torch.randn(1, hidden)
    ids = torch.randperm(experts)[:top_k][None]
    w = torch.full((1, top_k), 1.0 / top_k)
    t = _median_s(lambda: cpu_expert_ffn(x, rows, ids, w, hidden, ffn, fmt=qfmt), repeats)
    return t / top_k, rows.shape[1] * rows.element_size()


def cpu_fixed_time(repeats: int) -> float:
    """One CPU-experts call of one tiny expert: its fixed cost."""
    rows = torch.zeros(1, 3 * 16 * 16)
    x, ids, w = torch.zeros(1, 16), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    return _median_s(lambda: cpu_expert_ffn(x, rows, ids, w, 16, 16), repeats)


def handoff_fixed_time(repeats: int, backend: str) -> float:
    """One tiny expert through the device step's hand-off (cpu_experts, then cpu_join and
    the stream's end) on a `backend` store: the fixed cost of a layer's CPU work there."""
    H = F = 16
    rows = torch.zeros(1, 3 * H * F)
    with ExpertStore([LayerSpec(1, 1, rows.shape[1])], torch.float32, backend=backend) as st:
        st.register(0, 0, rows[0])
        lay = cpu_layout(None, torch.float32, H, F, 128, rows.shape[1] * 4)
        f32, threads = torch.float32, torch.get_num_threads()
        st.cpu_experts_setup(
            0, lay, x_dtype=f32, w_dtype=f32, id_dtype=torch.int64, top_k=1, threads=threads
        )
        dev = st.device
        x, y = torch.zeros(1, H, device=dev), torch.zeros(1, H, device=dev)
        ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        w = torch.ones(1, 1, device=dev)
        listed = torch.zeros(1, dtype=torch.int32, device=dev)

        def one() -> None:
            st.cpu_experts(0, x, ids, w, listed, y)
            st.cpu_join(0)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        return _median_s(one, repeats)


def copy_time(rows: torch.Tensor, top_k: int, repeats: int) -> float:
    """(CUDA) one expert's copy through the expert store, seconds."""
    E, nbytes = rows.shape[0], rows.shape[1] * rows.element_size()
    with ExpertStore([LayerSpec(E, top_k, nbytes)], torch.uint8, backend="cuda") as st:
        raw = rows.view(torch.uint8).reshape(E, nbytes)
        for e in range(E):
            st.register(0, e, raw[e])
        slots = list(range(top_k))

        def one() -> None:
            experts = torch.randperm(E)[:top_k].tolist()
            st.enqueue_copies(0, slots, experts)
            st.acquire(0, slots, experts)
            st.release(0, slots)
            st.synchronize()

        return _median_s(one, repeats) / top_k


def measure_profile(
    hidden: int,
    ffn: int,
    fmt: str,
    *,
    top_k: int = 8,
    repeats: int = 20,
    experts: int = 32,
    triad_floats: int = 1 << 23,
    base: mc.MachineProfile | None = None,
) -> mc.MachineProfile:
    """This machine's profile with the costs of one shape and format (added to `base`'s
    shapes when `base` was measured here)."""
    threads = torch.get_num_threads()
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else "none"
    fp = mc.fingerprint(threads, gpu, mc.psr_version())
    cpu_s, row_bytes = cpu_expert_time(hidden, ffn, fmt, top_k, repeats, experts)
    copy_s = None
    if cuda:
        copy_s = copy_time(random_rows(experts, hidden, ffn, fmt), top_k, repeats)
    shapes = dict(base.shapes) if base is not None and base.fingerprint == fp else {}
    shapes[mc.shape_key(hidden, ffn, fmt)] = mc.ShapeCosts(row_bytes, cpu_s, copy_s)
    fixed = handoff_fixed_time(repeats, "cuda") if cuda else cpu_fixed_time(repeats)
    return mc.MachineProfile(fp, fixed, cpu_triad(triad_floats, threads, 5), shapes)


def table(profile: mc.MachineProfile) -> str:
    """The profile as the command prints it."""
    lines = [
        f"machine: {mc.describe(profile.fingerprint)}",
        f"triad: {profile.triad_bytes_per_s / 1e9:.2f} GB/s",
        f"CPU call fixed cost: {profile.cpu_fixed_s * 1e6:.1f} us",
    ]
    for key, c in profile.shapes.items():
        bw = c.row_bytes / c.cpu_expert_s / 1e9 if c.cpu_expert_s > 0 else 0.0
        cp = "n/a (no GPU)" if c.copy_s is None else f"{c.copy_s * 1e6:.1f} us"
        lines.append(
            f"{key}: CPU {c.cpu_expert_s * 1e6:.1f} us/expert ({bw:.2f} GB/s of "
            f"{c.row_bytes / 2**20:.2f} MiB rows), copy {cp}"
        )
    return "\n".join(lines)
