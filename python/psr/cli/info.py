"""`psr info`: what the extension was built with and can use; `psr inspect`: what psr
would load from a checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from psr.cli.args import MODEL_HELP, command


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
    ins.set_defaults(fn=run_inspect)
    ls = command(
        sub,
        "list",
        "the checkpoints in the local Hugging Face cache that psr can load, with their family "
        "and size (names for --model; nothing is downloaded)",
    )
    ls.set_defaults(fn=run_list)


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
    found = inspect(path)
    print(json.dumps(found.to_dict(), indent=2) if args.json else found.table())
    return 0 if found.supported else 1


def run_list(args: argparse.Namespace) -> int:
    from psr.models.names import cached_models, hub_cache, table

    cache = hub_cache()
    print(table(cached_models(cache), cache))
    return 0
