"""psr command line.

Errors print one line, `psr: error: <message>`, and exit with status 2 (bad arguments)
or 1 (a failure while running); `psr --debug ...` or PSR_DEBUG=1 adds the traceback.
Arguments are checked before any model is loaded: their types and ranges while the
line is parsed, then the model folder (config.json only) and the outputs, which are
created and probed for writing.
"""

# (The docstring above is `psr --help`'s description.) The package: `args` holds the
# argument types and up-front checks the commands share; each command family keeps its
# parser beside its handler (`generate`, `chat`, `serve`: serve / bench serve, `evaluate`:
# demo / eval / tune, `bench`, `info`: info / inspect / list, `lm_eval`); this module
# assembles the parser and turns errors into one line and an exit status. Parsing imports
# no torch: the handlers import what they run.

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn

from psr.cli.args import Formatter, UsageError
from psr.cli.bench import add_bench
from psr.cli.evaluate import add_demo, add_eval, add_tune
from psr.cli.generate import add_generate
from psr.cli.info import add_info
from psr.cli.lm_eval import NAME as LM_EVAL
from psr.cli.lm_eval import add_lm_eval, run_lm_eval
from psr.cli.repl import add_chat
from psr.cli.serve import add_serve

__all__ = ["EXIT_INTERRUPT", "EXIT_RUNTIME", "EXIT_USAGE", "UsageError", "build_parser", "main"]

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPT = 1, 2, 130

# In the order `psr --help` lists them.
COMMANDS = (
    add_info,
    add_generate,
    add_chat,
    add_serve,
    add_demo,
    add_eval,
    add_bench,
    add_tune,
    add_lm_eval,
)


# ------------------------------------------------------------------ errors and the parser


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr: `psr: error: <message>` (status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"psr: error: {_one_line(message)}\n")


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def _is_runtime_error(e: BaseException) -> bool:
    """The failures reported in one line: bad values and files, checkpoint and store errors."""
    if isinstance(e, (ValueError, TypeError, OSError)):  # CheckpointError is a ValueError
        return True
    store = sys.modules.get("psr.store")  # StoreError / CopyError live in the extension
    return store is not None and isinstance(e, store.StoreError)


def _debug_from_env() -> bool:
    return os.environ.get("PSR_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises no second error."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor behind stdout (captured)
        pass


def _fail(code: int, message: str, debug: bool) -> NoReturn:
    if debug:
        traceback.print_exc()
    sys.stderr.write(f"psr: error: {message}\n" if code != EXIT_INTERRUPT else f"psr: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="psr", description=__doc__, formatter_class=Formatter)
    p.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of an error (also PSR_DEBUG=1)",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run `psr`; errors exit (SystemExit) with status 2 (usage), 1 (runtime) or 130."""
    own_process = argv is None  # the `psr` command, not main() called in-process
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_from_env()
    try:
        lead = 0  # top-level options before the command: only --debug
        while lead < len(argv) and argv[lead] == "--debug":
            lead += 1
        if argv[lead : lead + 1] == [LM_EVAL]:  # the rest belongs to lm_eval's parser
            debug = debug or lead > 0
            return run_lm_eval(argv[lead + 1 :])
        args = build_parser().parse_args(argv)
        args.own_process = own_process
        debug = debug or args.debug
        threads_env = os.environ.get("PSR_THREADS")  # apply_threads sets it for the command
        try:
            code: int = args.fn(args)
        finally:  # main() called in-process (tests, notebooks) leaves the env as it was
            if threads_env is None:
                os.environ.pop("PSR_THREADS", None)
            else:
                os.environ["PSR_THREADS"] = threads_env
        return code
    except KeyboardInterrupt:
        _fail(EXIT_INTERRUPT, "interrupted", debug)
    except BrokenPipeError:  # stdout went to a reader that has stopped (`psr info | head`)
        _silence_stdout()
        raise SystemExit(EXIT_RUNTIME) from None
    except UsageError as e:
        _fail(EXIT_USAGE, _one_line(str(e)), debug)
    except Exception as e:
        if not _is_runtime_error(e):
            raise
        _fail(EXIT_RUNTIME, _one_line(str(e)) or type(e).__name__, debug)
