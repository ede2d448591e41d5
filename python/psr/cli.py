"""psr command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _bench_copy(args: argparse.Namespace) -> int:
    from psr.microbench import run_copy_overlap

    shape = tuple(int(x) for x in args.shape.split("x"))
    r = run_copy_overlap(shape, args.experts, args.slots, args.repeats, backend=args.backend)
    print(r.table())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r.as_dict(), indent=2))
    return 0


def _info(args: argparse.Namespace) -> int:
    import psr

    print(json.dumps(psr.backend_info(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="psr", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="what the extension was built with and can use")
    info.set_defaults(fn=_info)
    bc = sub.add_parser("bench-copy", help="copy engine bandwidth and copy/compute overlap")
    bc.add_argument("--shape", default="3x2048x1024", help="expert shape (default: OLMoE FFN)")
    bc.add_argument("--experts", type=int, default=8)
    bc.add_argument("--slots", type=int, default=4)
    bc.add_argument("--repeats", type=int, default=5)
    bc.add_argument("--backend", choices=["cpu", "cuda"], default=None)
    bc.add_argument("--json", default=None, help="also write the result as JSON here")
    bc.set_defaults(fn=_bench_copy)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
