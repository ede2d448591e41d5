"""What the command families share: the argument types (checked while the line is parsed),
the checks of model folders and outputs (run before any model loads), and the helpers that
make a command's parser.

Nothing here imports torch: `psr --help` and argument errors stay fast.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from psr.vocab import DRAFTERS, DTYPE_ALIASES, EXPERT_FORMATS
from psr.vocab import host_memory as _host_memory

T = TypeVar("T")

MODEL_HELP = (
    "checkpoint folder, .gguf file, or Hugging Face repo id from the local cache (org/name, "
    "org/name:FILE.gguf; `psr list` shows them)"
)
QUIET_HELP = "no progress bars (they are shown only when stderr is a terminal)"
EMBEDDED = "(default: the embedded model)"


class UsageError(Exception):
    """Arguments that cannot work together (exit status 2, as argparse's own errors)."""


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: ...)` unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help.lower():
            return help
        return super()._get_help_string(action) or ""


def command(parent: Any, name: str, help: str) -> argparse.ArgumentParser:
    """Add the command `name` to the subparsers `parent`; its description is its help."""
    parser: argparse.ArgumentParser = parent.add_parser(
        name, help=help, description=help.replace("%%", "%"), formatter_class=Formatter
    )
    return parser


def progress(args: argparse.Namespace) -> bool:
    """Progress bars only on a terminal, and not with --quiet."""
    return sys.stderr.isatty() and not getattr(args, "quiet", False)


# ------------------------------------------------------------------ argument types

# Each raises argparse.ArgumentTypeError, which argparse reports as
# `argument --option: <message>`.


def _int(s: str) -> int:
    try:
        return int(s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        v = _int(s)
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


positive_int = _int_at_least(1)
nonnegative_int = _int_at_least(0)


def _float(s: str) -> float:
    try:
        v = float(s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v


def fraction(s: str) -> float:
    """A number in (0, 1]."""
    v = _float(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s!r}")
    return v


def nonnegative_float(s: str) -> float:
    """A finite number >= 0."""
    v = _float(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {s!r}")
    return v


def positive_float(s: str) -> float:
    """A finite number > 0."""
    v = _float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {s!r}")
    return v


def drafter_kind(s: str) -> str:
    """`psr bench speculative`'s drafters: the shipped ones, or the oracle (an upper bound:
    exact greedy decoding's own tokens, free)."""
    kinds = (*DRAFTERS, "oracle")
    if s not in kinds:
        raise argparse.ArgumentTypeError(f"unknown drafter {s!r}: {', '.join(kinds)}")
    return s


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """`'a,b,c'`, each entry parsed by `item`; at least one entry, none empty."""

    def parse(s: str) -> list[T]:
        parts = [p.strip() for p in s.split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {s!r}")
        out = []
        for i, p in enumerate(parts, 1):
            if not p:
                raise argparse.ArgumentTypeError(f"entry {i} of {s!r} is empty")
            try:
                out.append(item(p))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"entry {i} of {s!r}: {e}") from None
        return out

    parse.__name__ = "comma-separated list"
    return parse


residencies = comma_list(fraction)


def hybrid_m(s: str) -> int | list[int]:
    """--hybrid-m: one miss-copy cap (an int >= 0) for every MoE layer, or one per layer
    ('2,2,3'); range-checked against top_k when the model loads."""
    caps = comma_list(nonnegative_int)(s)
    return caps[0] if len(caps) == 1 and "," not in s else caps


def expert_format(s: str) -> str:
    """One of EXPERT_FORMATS (psr.load's expert_format; native: the model's dtype)."""
    if s not in EXPERT_FORMATS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(EXPERT_FORMATS)}, got {s!r}")
    return s


def policies(s: str) -> list[Any] | None:
    """`';'`-separated policy specs, parsed by psr.policy.parse_policies (exact added);
    `tuned` (None): the model's operating points at each residency."""
    from psr.policy import parse_policies

    if s.strip() == "tuned":
        return None
    try:
        return parse_policies(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def token_ids(s: str) -> list[int]:
    """`'1,2,3'` or `'1 2 3'`: token ids (integers >= 0), at least one."""
    parts = s.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError(f"expected token ids such as '1,2,3', got {s!r}")
    out = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise argparse.ArgumentTypeError(f"token id {p!r} is not an integer") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"token id {p!r} is negative")
        out.append(v)
    return out


def nonempty(s: str) -> str:
    if not s:
        raise argparse.ArgumentTypeError("expected a non-empty string")
    return s


def shape(s: str) -> tuple[int, ...]:
    """`'3x2048x1024'`: positive integers joined by x."""
    try:
        dims = tuple(int(d) for d in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers joined by 'x' (e.g. 3x2048x1024), got {s!r}"
        ) from None
    if min(dims) < 1:
        raise argparse.ArgumentTypeError(f"every dimension must be >= 1, got {s!r}")
    return dims


def device(s: str) -> str:
    """'cpu', 'cuda' or 'cuda:N'."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", s.strip()):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {s!r}")
    return s.strip()


def host_memory(s: str) -> str:
    """psr.load's host_memory: 'unlimited' or a size ('48GB', '48GiB', bytes)."""
    try:
        return str(_host_memory(s.strip()))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("host_memory ")) from None


def size(option: str) -> Callable[[str], str]:
    """A memory size (psr.vocab.parse_bytes: 24GiB, 24GB, 512MiB, bytes) for `option`."""

    def parse(s: str) -> str:
        from psr.vocab import parse_bytes

        try:
            parse_bytes(s.strip(), option)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{s!r} is not a size like 24GiB (or 24GB, 512MiB, bytes)"
            ) from None
        return s.strip()

    return parse


def context_tokens(s: str) -> int:
    """Tokens: an int >= 1, or N k (N x 1024: 32k)."""
    m = re.fullmatch(r"([0-9]+)([kK]?)", s.strip())
    n = (int(m[1]) * (1024 if m[2] else 1)) if m else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{s!r} is not a token count like 32768 or 32k")
    return n


def dtype(s: str) -> str:
    """A dtype psr.models.load accepts, in its canonical name."""
    name = s.strip().removeprefix("torch.")
    if name not in DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPE_ALIASES)}, got {s!r}")
    return DTYPE_ALIASES[name]


# ------------------------------------------------------------------ threads (issue 42)

THREADS_HELP = (
    "CPU threads for torch and psr's CPU expert kernels (default: $PSR_THREADS, else "
    "$OMP_NUM_THREADS, else the physical cores available to the process; `psr info` says)"
)


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help=THREADS_HELP)


def check_threads(threads: int | None) -> int:
    """The thread count a command will run with (psr.machine.resolve_threads), checked
    before anything loads: too many is a usage error naming the option."""
    from psr.machine import resolve_threads

    try:
        return resolve_threads(threads)
    except ValueError as e:
        msg = str(e)
        raise UsageError(f"--threads {msg.removeprefix('threads=')}" if threads else msg) from None


def apply_threads(args: argparse.Namespace) -> int:
    """For commands that run models without psr.load's `threads` (eval, tune, ...): set
    torch's threads, which psr's CPU expert kernels follow, from --threads, and
    $PSR_THREADS, so that every psr.load the command makes keeps them."""
    n = check_threads(getattr(args, "threads", None))
    os.environ["PSR_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)
    return n


# ------------------------------------------------------------------ paths, checked up front


def _probe_dir(folder: Path, what: str) -> None:
    """Create and remove a file in `folder`: the one reliable test of writability."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".psr-write-check-")
    except OSError as e:
        raise OSError(f"{what}: cannot write to {folder}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(tmp)


def _check_ancestors(folder: Path, what: str) -> None:
    """The nearest existing one of `folder` and its parents must be a folder."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{what}: {folder} is not a folder")


def writable_file(path: str | Path, option: str) -> Path:
    """Make sure `path` can be written when the run ends: its folder is created now and
    probed; an existing file must be writable (it is left as it is)."""
    p = Path(path)
    what = f"{option} {path}"
    if p.is_dir():
        raise IsADirectoryError(f"{what}: is a folder")
    _check_ancestors(p.parent, what)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{what}: cannot create folder {p.parent}: {e.strerror or e}") from None
    _probe_dir(p.parent, what)
    if p.exists():
        try:
            with p.open("ab"):
                pass
        except OSError as e:
            raise OSError(f"{what}: cannot write: {e.strerror or e}") from None
    return p


def writable_dir(path: str | Path, option: str) -> Path:
    """Create the folder `path` (with its parents) and make sure files can be written in it."""
    p = Path(path)
    what = f"{option} {path}"
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(f"{what}: exists and is not a folder")
    _check_ancestors(p, what)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{what}: cannot create folder: {e.strerror or e}") from None
    _probe_dir(p, what)
    return p


def model_path(name: str | None, option: str = "--model") -> str:
    """--model as a local path: the embedded model when not given; a Hub repo id
    (`org/name`, `org/name:FILE.gguf`) from the local Hub cache, never downloaded
    (psr.models.names.resolve_model); errors name the option."""
    from psr.models import DEFAULT_MODEL
    from psr.models.names import resolve_model

    if name is None:
        return str(DEFAULT_MODEL)
    try:
        return resolve_model(name)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{option} {e}") from None


def model_config(path: str | Path, option: str = "--model") -> dict[str, Any]:
    """config.json of a supported checkpoint folder (psr.models.read_config: no weights are
    read), with errors that name the option."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{option} {path}: no such folder or file")
    from psr.models import SUPPORTED, CheckpointError
    from psr.models.gguf_load import is_gguf
    from psr.models.sources import model_config as config_of

    if not p.is_dir() and not is_gguf(p):
        raise NotADirectoryError(
            f"{option} {path}: is not a folder (give a checkpoint folder or a .gguf file)"
        )
    try:
        cfg = config_of(p)
    except CheckpointError as e:
        raise CheckpointError(f"{option}: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{option}: config.json in {path} is not a JSON object")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        from psr.models.families import unsupported

        raise ValueError(f"{option} {path}: {unsupported(str(mt))}")
    return cfg


def eval_model(path: str | None) -> str:
    """The model of eval / sweep / tune / bench speculative: a checkpoint folder with its
    held-out text."""
    from psr.models.embedded import heldout_text

    path = model_path(path)
    model_config(path)
    try:
        heldout_text(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model: {e}") from None
    return path
