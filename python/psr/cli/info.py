"""`psr info`: what the extension was built with and can use."""

from __future__ import annotations

import argparse
import json
from typing import Any

from psr.cli.args import command


def add_info(sub: Any) -> None:
    info = command(sub, "info", "what the extension was built with and can use")
    info.set_defaults(fn=run_info)


def run_info(args: argparse.Namespace) -> int:
    from psr.store import backend_info

    print(json.dumps(backend_info(), indent=2))
    return 0
