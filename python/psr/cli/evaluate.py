"""`psr demo`, `psr eval` and `psr tune`, and the tuning options `psr bench sweep` shares."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psr.cli.args import (
    EMBEDDED,
    MODEL_HELP,
    QUIET_HELP,
    UsageError,
    add_threads_option,
    apply_threads,
    check_threads,
    comma_list,
    command,
    eval_model,
    expert_format,
    model_config,
    model_path,
    nonempty,
    nonnegative_float,
    nonnegative_int,
    policies,
    positive_float,
    positive_int,
    progress,
    residencies,
    writable_dir,
    writable_file,
)

if TYPE_CHECKING:
    from psr.eval.workers import Workers

# Relative to where psr runs, as `psr eval`'s; committed results pass --out explicitly.
DEMO_OUT = "psr-results/demo"


WORKERS_HELP = (
    "worker processes the configurations are measured in, each with --threads threads "
    "(default: the physical cores available to the process; threads then default to the "
    "thread default shared out among them, at least 1 each); the same results whatever "
    "the count"
)


def add_workers_option(p: argparse.ArgumentParser) -> None:
    """--workers and --threads: the processes measuring configurations and their threads."""
    p.add_argument("--workers", type=positive_int, default=None, metavar="N", help=WORKERS_HELP)
    add_threads_option(p)


def apply_workers(args: argparse.Namespace) -> Workers:
    """The worker processes of --workers, each with --threads threads (also this
    process's), by default the thread default shared out among the workers."""
    from psr.eval.workers import check_workers, default_workers

    n = default_workers() if args.workers is None else args.workers
    try:
        check_workers(n)
    except ValueError as e:
        raise UsageError(f"--workers {str(e).removeprefix('workers=')}") from None
    if n > 1 and args.threads is None:
        args.threads = max(1, check_threads(None) // n)
    threads = apply_threads(args)
    from psr.eval.workers import Workers

    return Workers(n, threads)


def add_demo(sub: Any) -> None:
    d = command(sub, "demo", "the embedded model under four policies at 50%% and 25%% residency")
    d.add_argument("--out", default=DEMO_OUT, help="folder for demo.{md,json,png}")
    d.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    d.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    add_workers_option(d)
    d.set_defaults(fn=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    writable_dir(args.out, "--out")
    from psr.eval.runs import demo

    with apply_workers(args) as workers:
        demo(args.out, progress=progress(args), quick=args.quick, workers=workers)
    return 0


def add_eval(sub: Any) -> None:
    ev = command(sub, "eval", "quality suite (perplexity, cloze, greedy) vs exact")
    ev.add_argument("--model", default=None, help=f"checkpoint folder with heldout.txt {EMBEDDED}")
    ev.add_argument(
        "--policies",
        type=policies,
        default="tuned",
        help="';'-separated name[:lam=..,n=..] (exact is always added), or 'tuned': exact, "
        "exact + prefetch and the model's tuned Cache-Prior and PSR points at each residency",
    )
    ev.add_argument(
        "--residency", type=residencies, default="0.5,0.25", help="comma list, each in (0, 1]"
    )
    ev.add_argument(
        "--expert-format",
        type=comma_list(expert_format),
        default="native",
        help="comma list of expert formats to run every policy in (native, bf16, int8, fp8, "
        "int4); exact in the native format is always the reference",
    )
    ev.add_argument(
        "--split",
        choices=["A", "B"],
        default="B",
        help="held-out set: A (operating points are selected on it) or B (replication)",
    )
    ev.add_argument(
        "--windows",
        type=positive_int,
        default=160,
        help="teacher-forced windows of 128 decode-path tokens each",
    )
    ev.add_argument(
        "--cloze",
        type=nonnegative_int,
        default=0,
        help="cloze multiple-choice items (0: none; report them with 2000 or more)",
    )
    ev.add_argument("--prompts", type=positive_int, default=4, help="greedy-decoded prompts")
    ev.add_argument("--gen-tokens", type=positive_int, default=48, help="greedy tokens per prompt")
    ev.add_argument("--out", default="psr-results/eval", help="folder for eval.{md,json,png}")
    ev.add_argument("--traces", action="store_true", help="keep routing traces in the JSON")
    ev.add_argument(
        "--record-modes",
        action="store_true",
        help="gpu / cpu / hybrid tables for biased policies too: their windows scored again "
        "with experts_on cpu and hybrid, traces recorded (exact's are replayed either way)",
    )
    ev.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    add_workers_option(ev)
    ev.set_defaults(fn=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    path = eval_model(args.model)
    writable_dir(args.out, "--out")
    from psr.eval.runs import evaluate, grid

    with apply_workers(args) as workers:
        evaluate(
            path,
            grid(args.policies, args.residency, args.expert_format, path),
            args.out,
            split=args.split,
            windows=args.windows,
            cloze=args.cloze,
            prompts=args.prompts,
            gen_tokens=args.gen_tokens,
            progress=progress(args),
            traces=args.traces,
            record_modes=args.record_modes,
            workers=workers,
        )
    return 0


def tuning_args(
    c: argparse.ArgumentParser, rho: str, model_help: str = "checkpoint folder with heldout.txt"
) -> None:
    """The options of `psr tune` and `psr bench sweep`; `rho`: the default residencies."""
    from psr.eval.defaults import BUDGET, PROFILE, SWEEP_LAMS, SWEEP_NS, WINDOWS

    c.add_argument("--model", default=None, help=f"{model_help} {EMBEDDED}")
    c.add_argument("--residency", type=residencies, default=rho, help="comma list, each in (0, 1]")
    c.add_argument(
        "--lams",
        type=comma_list(nonnegative_float),
        default=",".join(f"{x:g}" for x in SWEEP_LAMS),
        help="comma list of lam values, each >= 0",
    )
    c.add_argument(
        "--ns",
        type=comma_list(nonnegative_int),
        default=",".join(map(str, SWEEP_NS)),
        help="comma list of n values, each >= 0 (0: cache-prior)",
    )
    c.add_argument(
        "--budget",
        type=nonnegative_float,
        default=BUDGET,
        help="quality budget: the 95%% upper bound of Δ nats/token a point may cost",
    )
    c.add_argument(
        "--profile",
        type=nonempty,
        default=PROFILE,
        help="latency profile: a built-in name (rtx4090, h200) or a JSON file, e.g. the "
        "GPU run's calibrated bench/results/gpu/profile.json",
    )
    c.add_argument(
        "--windows",
        type=positive_int,
        default=WINDOWS,
        help="teacher-forced windows of 128 decode-path tokens per configuration",
    )
    c.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    add_workers_option(c)


def check_profile(name: str) -> None:
    """--profile names a built-in profile or a readable profile file."""
    from psr.eval.latency import get_profile

    try:
        get_profile(name)
    except (ValueError, TypeError, KeyError) as e:
        raise UsageError(f"argument --profile: {e}") from None


def add_tune(sub: Any) -> None:
    tu = command(
        sub,
        "tune",
        "choose Cache-Prior and PSR operating points per residency: selected on held-out "
        "set A within a quality budget (lams screened coarse to fine on 1/8 of set A's "
        "windows, the finalists measured on all of them), replicated on set B; "
        "psr.load uses them. Each configuration's result is saved as it completes, and the "
        "same command again resumes from them",
    )
    tuning_args(tu, "0.5,0.375,0.25", f"{MODEL_HELP}; with heldout.txt unless --text")
    tu.add_argument("--out", default="psr-results/tune", help="folder for the sweep reports")
    tu.add_argument(
        "--write",
        default=None,
        help="write the points here (default: the user's psr folder, keyed by model)",
    )
    tu.add_argument(
        "--select-from",
        default=None,
        help="reuse an earlier selection's sweep.json (set A) and only replicate on set B",
    )
    tu.add_argument(
        "--text",
        default=None,
        metavar="FILE|DIR",
        help="tune on your own text instead of the model's heldout.txt: plain text, JSONL "
        "with a 'text' field, or a folder of .txt / .jsonl files (sorted); split into a "
        "selection set A and a replication set B, each long enough for the budget",
    )
    tu.add_argument(
        "--max-minutes",
        type=positive_float,
        default=None,
        metavar="M",
        help="start no configuration after M minutes: report the best points so far, marked "
        "as such, and write none; every result is saved under --out, so the same command "
        "again resumes (default: no limit)",
    )
    tu.set_defaults(fn=run_tune)


def tune_model(model: str | None, text: str | None) -> str:
    """`psr tune`'s checkpoint: with --text any supported checkpoint folder (its tokenizer
    reads the text), else one with its held-out text."""
    if text is None:
        return eval_model(model)
    path = model_path(model)
    model_config(path)
    if not Path(text).exists():
        raise FileNotFoundError(f"--text {text}: no such file or folder")
    return path


def run_tune(args: argparse.Namespace) -> int:
    path = tune_model(args.model, args.text)
    writable_dir(args.out, "--out")
    check_profile(args.profile)
    if args.write:
        writable_file(args.write, "--write")
    from psr.eval.runs import tune

    with apply_workers(args) as workers:
        tune(
            path,
            args.out,
            args.residency,
            budget=args.budget,
            profile=args.profile,
            lams=args.lams,
            ns=args.ns,
            windows=args.windows,
            write=args.write,
            progress=progress(args),
            select_from=args.select_from,
            text=args.text,
            max_minutes=args.max_minutes,
            workers=workers,
        )
    return 0
