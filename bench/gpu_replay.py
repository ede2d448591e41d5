"""Trace replay: the embedded model's decode traces, replayed with OLMoE-1B-7B-sized experts
on this machine's expert store and Triton expert kernel, against the latency model.

    python bench/gpu_replay.py --out DIR              # GPU: 4 prompts x 48 tokens, OLMoE experts
    python bench/gpu_replay.py --out DIR --tiny       # CPU rehearsal: tiny shapes, short loops

1. Traces: the embedded model (psr.DEFAULT_MODEL, float32, on the CPU) greedily decodes
   held-out prompts under each standard policy at its operating points
   (`standard_policies(operating_points(DEFAULT_MODEL, rho))`) at 50% and 25% residency,
   recording per decode token and MoE layer the slots read and the copies issued.
2. Store: one ExpertStore (cuda backend on a GPU) with as many layers, experts and slots
   as the traces use, each expert 3 x 2048 x 1024 bf16 = 12.6 MB in pinned host memory.
3. Replay, per decoder layer of each token: the dense stand-in (a bf16 GEMV loop, or
   `torch.cuda._sleep`, sized to the H200 profile's dense_ms_per_layer); at a MoE layer
   the host waits for the compute stream (batch-1 routing puts the router's ids on the
   host, as the runtime's does), enqueues the step's copies on the store's copy stream
   in trace order, then acquire -> psr_kernels.expert_ffn on the slab's slots -> release.
   ms/token from CUDA events over whole traces, after a warm-up, median of repeats.
4. Model: a profile calibrated on this machine (`psr.eval.latency.calibrate`) from the
   store's measured copy GB/s, the dense stand-in alone, and the replay without copies
   (expert time); `simulate` of each trace under it vs the measured ms/token: the model
   error, and the speedup vs exact measured vs modeled.
5. Quantized experts (`--formats`, default int8,int4,fp8, in that order; `--format-policies`,
   default exact,psr): per format a second store of that format's uint8 rows
   (`psr_kernels.quantize_expert` of random OLMoE-shaped experts, a few reused for every
   expert id: only the bytes and the kernel matter), copies moving those bytes and
   `psr_kernels.expert_ffn(..., fmt=)` on the slab. The same routing traces, `bytes_ratio` set
   to the format's (row bytes over the bf16 replay's row bytes), replayed and modeled:
   the expert kernel's time is calibrated per format (the replay without copies), the
   copy rate stays the bf16 one (the model prices a copy by its bytes). A format is
   skipped when the time left (`--budget-s`, default $PSR_STAGE_LIMIT_S) would not cover
   it (estimated from the last format's time).

Writes DIR/replay.json (rewritten after every policy: a timeout keeps what was done),
DIR/replay.md, DIR/replay_profile.json (+ replay_profile_<fmt>.json) and DIR/traces/*.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_lib import log, replay
from replay_tables import closing_lines

import psr_kernels as pk
from psr.vocab import COMPUTE_CHOICES, QUANT_FORMATS

H200_DENSE_MS = 0.08  # the built-in h200 profile's dense_ms_per_layer
DEFAULT_FORMATS = "int8,int4,fp8"  # most valuable first: a short budget keeps int8


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny experts, short runs")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (4; tiny 2)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per prompt (48; tiny 6)")
    ap.add_argument("--residency", default="0.5,0.25")
    ap.add_argument("--repeats", type=int, default=None, help="timed replays per trace (3; tiny 1)")
    ap.add_argument("--warm", type=int, default=None, help="warm-up tokens per trace (8; tiny 2)")
    ap.add_argument("--dense", choices=["gemv", "sleep"], default="gemv")
    ap.add_argument("--dense-ms", type=float, default=H200_DENSE_MS, help="per decoder layer")
    ap.add_argument(
        "--compute",
        "--ffn",
        dest="compute",
        choices=COMPUTE_CHOICES,
        default="auto",
        help="the expert kernel: Triton, the torch reference, or auto ($PSR_COMPUTE, else "
        "Triton on CUDA)",
    )
    ap.add_argument("--backend", choices=["cpu", "cuda"], default=None)
    ap.add_argument(
        "--formats",
        default=DEFAULT_FORMATS,
        help=f"quantized expert formats replayed after bf16, in order ({DEFAULT_FORMATS}; "
        "'' for none)",
    )
    ap.add_argument(
        "--format-policies",
        default="exact,psr",
        help="policies replayed in each format (exact,psr: the operating point and baseline)",
    )
    env_budget = os.environ.get("PSR_STAGE_LIMIT_S")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=float(env_budget) if env_budget else None,
        help="this script's seconds (default $PSR_STAGE_LIMIT_S, set by gpu_bench.sh): "
        "formats that would not fit are skipped",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in QUANT_FORMATS:
            ap.error(f"--formats: {f!r} is not one of {', '.join(QUANT_FORMATS)}")
    fpols = {p.strip() for p in args.format_policies.split(",") if p.strip()}
    tiny = args.tiny
    args.prompts = args.prompts or (2 if tiny else 4)
    args.tokens = args.tokens or (6 if tiny else 48)
    args.repeats = args.repeats or (1 if tiny else 3)
    args.warm = args.warm if args.warm is not None else (2 if tiny else 8)
    backend = args.backend or ("cuda" if torch.cuda.is_available() else "cpu")
    try:  # "auto" follows $PSR_COMPUTE, then the device
        ops = pk.kernel_ops(args.compute, "cuda" if backend == "cuda" else "cpu")
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"--compute {args.compute}: {e}") from None
    result, failed = replay(args, backend, ops, formats, fpols)
    for line in closing_lines(result):
        log(line)
    if failed:
        log(f"failed formats: {', '.join(failed)} (replay.json: formats.<fmt>.status)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
