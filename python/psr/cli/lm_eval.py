"""`psr lm-eval`: lm_eval's CLI with the 'psr' model registered.

main() hands the rest of the line to lm_eval's own parser untouched; the subparser here
only lists the command in `psr --help`.
"""

from __future__ import annotations

from typing import Any

from psr.cli.args import UsageError, command

NAME = "lm-eval"


def add_lm_eval(sub: Any) -> None:
    command(sub, NAME, "lm_eval's CLI with the 'psr' model registered")


def run_lm_eval(argv: list[str]) -> int:
    try:
        from psr.eval.lm_eval_adapter import main as lm_eval_main
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        raise UsageError("psr lm-eval needs lm-eval: pip install 'psr[lm-eval]'") from None
    result: int = lm_eval_main(argv)
    return result
