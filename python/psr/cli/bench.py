"""`psr bench copy | sweep | speculative | serve | machine | ttft` (serve: psr.cli.serve)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from psr.cli.args import (
    EMBEDDED,
    QUIET_HELP,
    UsageError,
    add_threads_option,
    apply_threads,
    comma_list,
    command,
    drafter_kind,
    eval_model,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    progress,
    residencies,
    shape,
    writable_dir,
    writable_file,
)
from psr.cli.evaluate import apply_workers, check_profile, tuning_args
from psr.cli.serve import add_bench_serve


def add_bench(sub: Any) -> None:
    bench = command(sub, "bench", "benchmarks: copy engine, lam x n sweep")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    _add_copy(bsub)
    _add_sweep(bsub)
    _add_speculative(bsub)
    add_bench_serve(bsub)
    _add_machine(bsub)
    _add_ttft(bsub)


def _add_ttft(bsub: Any) -> None:
    from psr.eval.latency import PROFILES

    bt = command(
        bsub,
        "ttft",
        "modeled time to first token on the GPU profiles (no GPU needed): psr's prefill "
        "schedule, the overlap it lacks, the peers' published figures",
    )
    bt.add_argument(
        "--profiles",
        type=comma_list(str),
        default=["rtx4090", "h200"],
        help=f"latency profiles, comma-separated (built in: {', '.join(PROFILES)})",
    )
    bt.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk (tokens)")
    bt.set_defaults(fn=run_ttft)


def run_ttft(args: argparse.Namespace) -> int:
    from psr.eval.ttft import GPU_TFLOPS, ttft_report

    bad = [p for p in args.profiles if p not in GPU_TFLOPS]
    if bad:
        raise UsageError(
            f"--profiles: no GPU FLOP/s for {', '.join(bad)} (modeled: {', '.join(GPU_TFLOPS)})"
        )
    print(ttft_report(args.profiles, chunk=args.chunk))
    return 0


MACHINE_FORMATS = ("float32", "bfloat16", "float16", "int8", "fp8", "int4")


def _add_machine(bsub: Any) -> None:
    bm = command(
        bsub,
        "machine",
        "this machine's CPU-expert and copy costs: the profile experts_on='hybrid' uses",
    )
    bm.add_argument("--hidden", type=positive_int, default=2048, help="expert input size H")
    bm.add_argument("--ffn", type=positive_int, default=768, help="expert FFN size F")
    bm.add_argument(
        "--format",
        choices=MACHINE_FORMATS,
        default="bfloat16",
        help="the experts' rows: a float dtype or a quantized format (default: %(default)s; "
        "defaults: a Qwen3-30B-A3B expert)",
    )
    bm.add_argument("--top-k", type=positive_int, default=8, help="experts per timed call")
    add_threads_option(bm)
    bm.add_argument("--repeats", type=positive_int, default=20, help="timed calls (median)")
    bm.add_argument(
        "--out",
        default=None,
        help="profile file (default: machine.json beside the operating points, which "
        "experts_on='hybrid' reads)",
    )
    bm.set_defaults(fn=run_machine)


def run_machine(args: argparse.Namespace) -> int:
    from pathlib import Path

    import psr.machine as mc

    out = writable_file(args.out, "--out") if args.out else mc.profile_path()
    apply_threads(args)
    from psr.eval.machine_profile import measure_profile, table

    try:
        base = mc.read_profile(Path(out))
    except ValueError:
        base = None  # not a profile: rewritten
    p = measure_profile(
        args.hidden, args.ffn, args.format, top_k=args.top_k, repeats=args.repeats, base=base
    )
    if base is not None and base.fingerprint != p.fingerprint:
        print(f"replacing a profile measured on {mc.describe(base.fingerprint)}")
    print(table(p))
    print(f"wrote {mc.write_profile(p, Path(out))}")
    return 0


def _add_copy(bsub: Any) -> None:
    bc = command(bsub, "copy", "copy engine bandwidth and copy/compute overlap")
    bc.add_argument(
        "--shape",
        type=shape,
        default="3x2048x1024",
        help="expert shape, dimensions joined by x (default: %(default)s, an OLMoE expert)",
    )
    bc.add_argument("--experts", type=positive_int, default=8, help="experts in the host store")
    bc.add_argument("--slots", type=positive_int, default=4, help="device slots, <= --experts")
    bc.add_argument("--repeats", type=positive_int, default=5, help="timed repetitions")
    bc.add_argument(
        "--backend",
        choices=["cpu", "cuda"],
        default=None,
        help="store backend (default: psr's current backend)",
    )
    bc.add_argument(
        "--json", default=None, help="also write the result as JSON here (default: no JSON)"
    )
    bc.set_defaults(fn=run_copy)


def run_copy(args: argparse.Namespace) -> int:
    if args.slots > args.experts:
        raise UsageError(f"--slots {args.slots} exceeds --experts {args.experts}")
    out = writable_file(args.json, "--json") if args.json else None
    from psr.eval.microbench import run_copy_overlap

    r = run_copy_overlap(args.shape, args.experts, args.slots, args.repeats, backend=args.backend)
    print(r.table())
    if out is not None:
        out.write_text(json.dumps(r.as_dict(), indent=2))
    return 0


def _add_sweep(bsub: Any) -> None:
    sw = command(bsub, "sweep", "lam x n: Pareto front of modeled latency vs quality")
    tuning_args(sw, "0.5,0.25")
    sw.add_argument("--split", choices=["A", "B"], default="A", help="held-out set to measure on")
    sw.add_argument("--out", default="psr-results/sweep", help="folder for sweep.{md,json,png}")
    sw.set_defaults(fn=run_sweep)


def run_sweep(args: argparse.Namespace) -> int:
    path = eval_model(args.model)
    writable_dir(args.out, "--out")
    check_profile(args.profile)
    from psr.eval.runs import sweep

    with apply_workers(args) as workers:
        sweep(
            path,
            args.out,
            args.residency,
            args.lams,
            args.ns,
            budget=args.budget,
            windows=args.windows,
            split=args.split,
            profile=args.profile,
            progress=progress(args),
            workers=workers,
        )
    return 0


def _add_speculative(bsub: Any) -> None:
    from psr.eval.defaults import WINDOWS

    sp = command(
        bsub,
        "speculative",
        "speculative decoding (block heads, AR drafter; K_b x lam grid) vs autoregressive "
        "policies at equal device memory",
    )
    sp.add_argument("--model", default=None, help=f"checkpoint with drafters {EMBEDDED}")
    sp.add_argument(
        "--residency", type=residencies, default="0.5,0.25", help="comma list, each in (0, 1]"
    )
    sp.add_argument(
        "--windows", type=positive_int, default=WINDOWS, help="teacher-forced windows (quality)"
    )
    sp.add_argument("--prompts", type=positive_int, default=16, help="generated prompts (speed)")
    sp.add_argument("--gen-tokens", type=positive_int, default=64, help="tokens per prompt")
    sp.add_argument("--block", type=positive_int, default=4, help="drafted tokens per block")
    sp.add_argument(
        "--drafters",
        type=comma_list(drafter_kind),
        default="block,ar",
        help="comma list of drafters to run: block, ar, mtp, oracle (an upper bound: exact "
        "greedy decoding's own tokens as drafts, free)",
    )
    sp.add_argument(
        "--block-k",
        type=comma_list(positive_int),
        default=None,
        help="comma list of K_b (experts per block and layer, each >= top-k) "
        "(default: k, 1.5k, 2k)",
    )
    sp.add_argument(
        "--lams",
        type=comma_list(nonnegative_float),
        default="0,0.2",
        help="comma list of lam biasing the block set (verify='budget') or each token's "
        "top-k (verify='cpu') toward the logical cache",
    )
    sp.add_argument(
        "--prefetch",
        type=nonnegative_int,
        default=1,
        help="n: experts prefetched into the next layer per layer and verify block "
        "(default: %(default)s)",
    )
    sp.add_argument(
        "--cpu-copies",
        type=comma_list(nonnegative_int),
        default=[],
        help="comma list of M: verify='cpu:M' rows (each token's own top-k, at most M misses "
        "copied per layer and block, the rest computed on the CPU) (default: none)",
    )
    sp.add_argument(
        "--out", default="psr-results/speculative", help="folder for speculative.{md,json}"
    )
    sp.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    add_threads_option(sp)
    sp.set_defaults(fn=run_speculative)


def run_speculative(args: argparse.Namespace) -> int:
    path = eval_model(args.model)
    writable_dir(args.out, "--out")
    apply_threads(args)
    from psr.eval.runs import speculative

    speculative(
        path,
        args.out,
        args.residency,
        windows=args.windows,
        prompts=args.prompts,
        gen_tokens=args.gen_tokens,
        block=args.block,
        drafters=args.drafters,
        block_ks=args.block_k,
        lams=args.lams,
        cpu_copies=args.cpu_copies,
        n=args.prefetch,
        progress=progress(args),
    )
    return 0
