"""`psr info`: what the extension was built with and can use; `psr inspect`: what psr
would load from a checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from psr.cli.args import MODEL_HELP, UsageError, command


def add_info(sub: Any) -> None:
    info = command(sub, "info", "what the extension was built with and can use")
    info.set_defaults(fn=run_info)
    ins = command(
        sub,
        "inspect",
        "what psr would load from a checkpoint, before loading it: family, router and expert "
        "kinds, sparse layers, expert bytes per format, host and device memory, graphs",
    )
    ins.add_argument("--model", help=f"{MODEL_HELP} (default: the embedded model)")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_plan_options(ins)
    ins.set_defaults(fn=run_inspect)
    ls = command(
        sub,
        "list",
        "the checkpoints in the local Hugging Face cache that psr can load, with their family "
        "and size (names for --model; nothing is downloaded)",
    )
    ls.set_defaults(fn=run_list)


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """The memory plan's flags (psr.models.memory_plan): --gpu-memory asks for a plan."""
    from psr.cli.args import context_tokens, dtype, nonnegative_int, size
    from psr.models.memory_plan import DENSE_FORMATS
    from psr.vocab import EXPERTS_ON, KV_CHOICES

    g = p.add_argument_group("memory plan (with --gpu-memory; exit 1 when it does not fit)")
    g.add_argument(
        "--gpu-memory",
        type=size("--gpu-memory"),
        metavar="SIZE",
        help="device memory to plan for (24GiB, 24GB, bytes): dense part, KV cache, "
        "workspace, and the expert slots that fit in the rest (default: no plan)",
    )
    g.add_argument(
        "--host-memory",
        type=size("--host-memory"),
        metavar="SIZE",
        help="host memory for expert rows; the rest stay pageable in the file (default: "
        "every expert held)",
    )
    g.add_argument(
        "--context",
        "--ctx-size",
        dest="context",
        type=context_tokens,
        metavar="TOKENS",
        help="KV cache length (32768 or 32k; default: the model's max_position_embeddings)",
    )
    g.add_argument("--experts-on", choices=EXPERTS_ON, help="where misses run (default: gpu)")
    g.add_argument(
        "--dense-format",
        choices=DENSE_FORMATS,
        default=None,
        help="dense weights as stored in the file (native) or dequantized to the model "
        "dtype (float; default: what psr.load does)",
    )
    g.add_argument(
        "--dtype",
        type=dtype,
        help="compute dtype (psr.load's --dtype): dequantized dense weights, KV values, "
        "activations (default: the checkpoint's)",
    )
    g.add_argument(
        "--kv-format",
        choices=list(KV_CHOICES),
        help="KV values as psr.load's --kv-format keeps them: the dtype (auto), bf16, or "
        "int8 / fp8 with a scale per token and head, or fit: the first of auto, int8, fp8 "
        "that fits (default: auto)",
    )
    g.add_argument(
        "--slots",
        type=nonnegative_int,
        help="check these slots per layer (default: the most that fit)",
    )
    g.add_argument(
        "--profile",
        metavar="NAME",
        help="the device whose rates price the plan's modeled decode ms/token (a batch-1 "
        "roofline): a latency profile (rtx4090, h200) or a Profile JSON file (default: "
        "rtx4090)",
    )


def _budget(args: argparse.Namespace) -> Any:
    """The plan's Budget from the flags, or None without --gpu-memory."""
    from psr.eval.defaults import PROFILE
    from psr.models.memory_plan import Budget
    from psr.vocab import parse_bytes

    if args.gpu_memory is None:
        flags = ("host_memory", "context", "experts_on", "dense_format", "dtype", "kv_format")
        for flag in (*flags, "slots", "profile"):
            if getattr(args, flag) is not None:
                name = "--" + flag.replace("_", "-")
                raise UsageError(f"{name} is part of the memory plan: give --gpu-memory too")
        return None
    host = None if args.host_memory is None else parse_bytes(args.host_memory)
    return Budget(
        rates=plan_rates(args.profile or PROFILE),
        gpu_memory=parse_bytes(args.gpu_memory),
        host_memory=host,
        context=args.context,
        experts_on=args.experts_on or "gpu",
        dense_format=args.dense_format,
        kv_format=args.kv_format or "auto",
        slots=args.slots,
        dtype=args.dtype,
    )


def plan_rates(profile: str) -> Any:
    """The memory plan's Rates from a latency profile (psr.eval.latency: a built-in name or
    a Profile JSON file)."""
    from psr.eval.latency import get_profile

    try:
        return get_profile(profile).rates()
    except ValueError as e:
        raise UsageError(f"--profile: {e}") from None


def run_info(args: argparse.Namespace) -> int:
    from psr.cli.args import check_threads
    from psr.machine import allowed_cpus, physical_cores
    from psr.store import backend_info

    cpus = {
        "cpus_available": len(allowed_cpus()),  # the affinity mask's logical CPUs
        "physical_cores": physical_cores(),
        "threads": check_threads(None),  # what psr.load uses by default (issue 42)
    }
    print(json.dumps(backend_info() | cpus, indent=2))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """Exit 0 for a checkpoint psr loads, 1 (with the one line saying what is missing)
    for one it does not."""
    from psr.cli.args import model_path
    from psr.models.inspect import inspect

    path = model_path(args.model)
    if not Path(path).is_dir() and not str(path).endswith(".gguf"):
        raise FileNotFoundError(f"--model {path}: no such folder (or .gguf file)")
    if not Path(path).exists():
        raise FileNotFoundError(f"--model {path}: no such file")
    found = inspect(path, _budget(args))
    print(json.dumps(found.to_dict(), indent=2) if args.json else found.table())
    return 0 if found.supported and (found.plan is None or found.plan.fits) else 1


def run_list(args: argparse.Namespace) -> int:
    from psr.models.names import cached_models, hub_cache, table

    cache = hub_cache()
    print(table(cached_models(cache), cache))
    return 0
