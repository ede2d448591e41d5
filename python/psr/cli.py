"""psr command line.

Errors print one line, `psr: error: <message>`, and exit with status 2 (bad arguments)
or 1 (a failure while running); `psr --debug ...` or PSR_DEBUG=1 adds the traceback.
Arguments are checked before any model is loaded: their types and ranges while the
line is parsed, then the model folder (config.json only) and the outputs, which are
created and probed for writing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

# The dtypes psr.models.load accepts (psr.models.loader.DTYPES), by their canonical names:
# listed here so that parsing the command line does not import torch.
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
# Files whose presence makes psr.models.load load a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPT = 1, 2, 130


# ------------------------------------------------------------------ errors and the parser


class UsageError(Exception):
    """Arguments that cannot work together (exit status 2, as argparse's own errors)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr: `psr: error: <message>` (status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"psr: error: {_one_line(message)}\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: ...)` unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help.lower():
            return help
        return super()._get_help_string(action) or ""


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
    if s not in ("block", "ar"):
        raise argparse.ArgumentTypeError(f"unknown drafter {s!r}: block or ar")
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


EXPERT_FORMATS = ("native", "bf16", "int8", "fp8", "int4")


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


def dtype(s: str) -> str:
    """A dtype psr.models.load accepts, in its canonical name."""
    name = s.strip().removeprefix("torch.")
    if name not in DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPE_ALIASES)}, got {s!r}")
    return DTYPE_ALIASES[name]


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


def model_config(path: str | Path, option: str = "--model") -> dict:
    """config.json of a supported checkpoint folder (psr.models.read_config: no weights are
    read), with errors that name the option."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{option} {path}: no such folder")
    if not p.is_dir():
        raise NotADirectoryError(f"{option} {path}: is not a folder (give a checkpoint folder)")
    from psr.models import SUPPORTED, CheckpointError, read_config

    try:
        cfg = read_config(p)
    except CheckpointError as e:
        raise CheckpointError(f"{option}: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{option}: config.json in {path} is not a JSON object")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ValueError(
            f"{option} {path}: unsupported architecture {mt!r}; psr supports {', '.join(SUPPORTED)}"
        )
    return cfg


def _eval_model(path: str | None) -> str:
    """The model of eval / sweep: a checkpoint folder with its held-out text."""
    from psr.models import DEFAULT_MODEL
    from psr.models.embedded import heldout_text

    path = path or DEFAULT_MODEL
    model_config(path)
    try:
        heldout_text(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model: {e}") from None
    return path


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars only on a terminal, and not with --quiet."""
    return sys.stderr.isatty() and not getattr(args, "quiet", False)


# ------------------------------------------------------------------ commands


def _bench_copy(args: argparse.Namespace) -> int:
    if args.slots > args.experts:
        raise UsageError(f"--slots {args.slots} exceeds --experts {args.experts}")
    out = writable_file(args.json, "--json") if args.json else None
    from psr.eval.microbench import run_copy_overlap

    r = run_copy_overlap(args.shape, args.experts, args.slots, args.repeats, backend=args.backend)
    print(r.table())
    if out is not None:
        out.write_text(json.dumps(r.as_dict(), indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from psr.policy import make_policy

    try:
        make_policy(args.policy, args.lam, args.n)
    except ValueError as e:
        raise UsageError(f"--policy {args.policy}: {e}") from None
    from psr.models import DEFAULT_MODEL

    path = args.model or DEFAULT_MODEL
    cfg = model_config(path)
    if args.prompt is not None and not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"--prompt: {path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
            "pass --prompt-ids instead"
        )
    vocab = cfg.get("vocab_size")
    if args.prompt_ids is not None and isinstance(vocab, int):
        bad = [i for i in args.prompt_ids if i >= vocab]
        if bad:
            raise ValueError(f"--prompt-ids: id {bad[0]} is outside the vocabulary of {vocab}")
    out = writable_file(args.json, "--json") if args.json else None
    progress = _progress(args)

    from psr.models import load

    model = load(
        path,
        policy=args.policy,
        residency=args.residency,
        slots=args.slots,
        lam=args.lam,
        n=args.n,
        device=args.device,
        dtype=args.dtype,
        compute=args.compute,
        expert_format=args.expert_format,
        quant_cache=args.quant_cache,
        speculative=args.speculative,
        block=args.block,
        block_k=args.block_k,
        quality_budget=args.quality_budget,
        progress=progress,
    )
    tok = model.tokenizer
    if args.prompt_ids is not None:
        ids = list(args.prompt_ids)
    else:
        if tok is None:
            raise ValueError(f"--prompt: {path} has no tokenizer; pass --prompt-ids instead")
        ids = tok(args.prompt)["input_ids"]
        if not ids:
            raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens")
    gen = model.generate(
        ids,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=getattr(tok, "eos_token_id", None),
        progress=progress,
    )
    new = gen[0, len(ids) :].tolist()
    print(tok.decode(ids + new) if tok is not None else " ".join(map(str, ids + new)))
    print()
    print(
        f"policy {model.policy.describe()} ({model.policy_source}), "
        f"{model.runtime.capacity} of {model.runtime.spec.num_experts} experts resident per "
        f"layer, backend {model.runtime.store.backend}, compute {model.runtime.ops.path}, "
        f"experts {args.expert_format}"
    )
    if model.spec_stats is not None:
        st = model.spec_stats
        print(
            f"speculative ({args.speculative}, B={args.block}, K_b={model.block_k}): "
            f"{st.blocks} verify blocks, {st.accepted_per_block:.2f} drafts accepted and "
            f"{st.tokens_per_block:.2f} tokens per block"
        )
    print(model.stats.table())
    if out is not None:
        out.write_text(
            json.dumps({"tokens": gen[0].tolist(), "stats": model.stats.summary()}, indent=2)
        )
    return 0


def _demo(args: argparse.Namespace) -> int:
    writable_dir(args.out, "--out")
    from psr.eval.runs import demo

    demo(args.out, progress=_progress(args), quick=args.quick)
    return 0


def _eval(args: argparse.Namespace) -> int:
    path = _eval_model(args.model)
    writable_dir(args.out, "--out")
    from psr.eval.runs import evaluate, grid

    evaluate(
        path,
        grid(args.policies, args.residency, args.expert_format, path),
        args.out,
        split=args.split,
        windows=args.windows,
        cloze=args.cloze,
        prompts=args.prompts,
        gen_tokens=args.gen_tokens,
        progress=_progress(args),
        traces=args.traces,
    )
    return 0


def _check_profile(name: str) -> None:
    from psr.eval.latency import get_profile

    try:
        get_profile(name)
    except (ValueError, TypeError, KeyError) as e:
        raise UsageError(f"argument --profile: {e}") from None


def _sweep(args: argparse.Namespace) -> int:
    path = _eval_model(args.model)
    writable_dir(args.out, "--out")
    _check_profile(args.profile)
    from psr.eval.runs import sweep

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
        progress=_progress(args),
    )
    return 0


def _tune(args: argparse.Namespace) -> int:
    path = _eval_model(args.model)
    writable_dir(args.out, "--out")
    _check_profile(args.profile)
    if args.write:
        writable_file(args.write, "--write")
    from psr.eval.runs import tune

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
        progress=_progress(args),
        select_from=args.select_from,
    )
    return 0


def _speculative(args: argparse.Namespace) -> int:
    path = _eval_model(args.model)
    writable_dir(args.out, "--out")
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
        progress=_progress(args),
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from psr.store import backend_info

    print(json.dumps(backend_info(), indent=2))
    return 0


# ------------------------------------------------------------------ the parser


def build_parser() -> argparse.ArgumentParser:
    from psr.policy import DEFAULT_RESIDENCY, POLICIES

    p = _Parser(prog="psr", description=__doc__, formatter_class=_Formatter)
    p.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of an error (also PSR_DEBUG=1)",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    def command(parent: Any, name: str, help: str) -> argparse.ArgumentParser:
        return parent.add_parser(
            name, help=help, description=help.replace("%%", "%"), formatter_class=_Formatter
        )

    quiet_help = "no progress bars (they are shown only when stderr is a terminal)"
    embedded = "(default: the embedded model)"
    residencies = comma_list(fraction)

    info = command(sub, "info", "what the extension was built with and can use")
    info.set_defaults(fn=_info)

    g = command(sub, "generate", "decode a prompt with an offloaded checkpoint")
    g.add_argument("--model", default=None, help=f"local HF checkpoint folder {embedded}")
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        type=nonempty,
        default=None,
        help="prompt text (no default: this or --prompt-ids)",
    )
    prompt.add_argument(
        "--prompt-ids",
        type=token_ids,
        default=None,
        help="token ids instead of text: '1,2,3' (no default: this or --prompt)",
    )
    g.add_argument("--policy", choices=POLICIES, default="psr", help="routing policy")
    g.add_argument(
        "--residency",
        type=fraction,
        default=DEFAULT_RESIDENCY,
        help="fraction of each layer's experts with a device slot, in (0, 1]",
    )
    g.add_argument(
        "--slots",
        type=positive_int,
        default=None,
        help="slots per layer, overriding --residency (default: from --residency)",
    )
    g.add_argument(
        "--lam",
        type=nonnegative_float,
        default=None,
        help="bias toward cached experts, >= 0 (default: the policy's, psr.policy)",
    )
    g.add_argument(
        "--n",
        type=nonnegative_int,
        default=None,
        help="predicted experts inserted per layer and token (default: the policy's)",
    )
    g.add_argument(
        "--quality-budget",
        type=nonnegative_float,
        default=None,
        help="nats/token the policy may cost: require the operating point `psr tune` chose "
        "for this budget or a tighter one (cache-prior, psr)",
    )
    g.add_argument("--max-new-tokens", type=nonnegative_int, default=32, help="tokens to generate")
    g.add_argument(
        "--device",
        type=device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when psr's backend is cuda, else cpu)",
    )
    g.add_argument(
        "--dtype",
        type=dtype,
        default=None,
        help="float32, bfloat16 or float16 (default: the checkpoint's)",
    )
    g.add_argument(
        "--compute",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="kernels: Triton, torch references, or auto (Triton on CUDA)",
    )
    g.add_argument(
        "--expert-format",
        choices=EXPERT_FORMATS,
        default="native",
        help="how the host store keeps experts and copies move them: native (the model's "
        "dtype), bf16, or quantized int8 / fp8 / int4 (dequantized on the fly)",
    )
    g.add_argument(
        "--quant-cache",
        nargs="?",
        const=True,
        default=False,
        metavar="DIR",
        help="with a quantized --expert-format: keep the quantized experts on disk and read "
        "them on later loads (in DIR, else $PSR_CACHE/quantized or the user cache folder; "
        "never in the model folder)",
    )
    g.add_argument(
        "--speculative",
        choices=["block", "ar"],
        default=None,
        help="greedy speculative decoding with the checkpoint's block heads or AR drafter; "
        "its memory comes out of the expert slots (default: off)",
    )
    g.add_argument(
        "--block", type=positive_int, default=4, help="with --speculative: drafted tokens per block"
    )
    g.add_argument(
        "--block-k",
        type=positive_int,
        default=None,
        help="with --speculative: experts per layer and verify block (default: min(2 top_k, "
        "slots))",
    )
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=positive_float, default=1.0, help="with --sample: > 0")
    g.add_argument(
        "--top-k",
        type=nonnegative_int,
        default=0,
        help="with --sample: keep the k most likely tokens; 0 keeps all",
    )
    g.add_argument(
        "--top-p", type=fraction, default=1.0, help="with --sample: nucleus mass, in (0, 1]"
    )
    g.add_argument("--seed", type=nonnegative_int, default=0, help="with --sample: RNG seed")
    g.add_argument(
        "--json",
        default=None,
        help="also write tokens and stats as JSON here (default: no JSON)",
    )
    g.add_argument("--quiet", action="store_true", help=quiet_help)
    g.set_defaults(fn=_generate)

    d = command(sub, "demo", "the embedded model under four policies at 50%% and 25%% residency")
    d.add_argument("--out", default="bench/results/demo", help="folder for demo.{md,json,png}")
    d.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    d.add_argument("--quiet", action="store_true", help=quiet_help)
    d.set_defaults(fn=_demo)

    ev = command(sub, "eval", "quality suite (perplexity, cloze, greedy) vs exact")
    ev.add_argument("--model", default=None, help=f"checkpoint folder with heldout.txt {embedded}")
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
    ev.add_argument("--quiet", action="store_true", help=quiet_help)
    ev.set_defaults(fn=_eval)

    bench = command(sub, "bench", "benchmarks: copy engine, lam x n sweep")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
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
    bc.set_defaults(fn=_bench_copy)

    from psr.eval.defaults import BUDGET, PROFILE, SWEEP_LAMS, SWEEP_NS, WINDOWS

    def tuning_args(c: argparse.ArgumentParser, rho: str) -> None:
        c.add_argument(
            "--model", default=None, help=f"checkpoint folder with heldout.txt {embedded}"
        )
        c.add_argument(
            "--residency", type=residencies, default=rho, help="comma list, each in (0, 1]"
        )
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
        c.add_argument("--quiet", action="store_true", help=quiet_help)

    sw = command(bsub, "sweep", "lam x n: Pareto front of modeled latency vs quality")
    tuning_args(sw, "0.5,0.25")
    sw.add_argument("--split", choices=["A", "B"], default="A", help="held-out set to measure on")
    sw.add_argument("--out", default="psr-results/sweep", help="folder for sweep.{md,json,png}")
    sw.set_defaults(fn=_sweep)

    tu = command(
        sub,
        "tune",
        "choose Cache-Prior and PSR operating points per residency: selected on held-out "
        "set A within a quality budget, replicated on set B; psr.load uses them",
    )
    tuning_args(tu, "0.5,0.375,0.25")
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
    tu.set_defaults(fn=_tune)

    sp = command(
        bsub,
        "speculative",
        "speculative decoding (block heads, AR drafter; K_b x lam grid) vs autoregressive "
        "policies at equal device memory",
    )
    sp.add_argument("--model", default=None, help=f"checkpoint with drafters {embedded}")
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
        help="comma list of drafters to run: block, ar",
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
        help="comma list of lam biasing the block set toward the logical cache",
    )
    sp.add_argument(
        "--out", default="psr-results/speculative", help="folder for speculative.{md,json}"
    )
    sp.add_argument("--quiet", action="store_true", help=quiet_help)
    sp.set_defaults(fn=_speculative)

    # Handled in main(): the rest of the line goes to lm_eval's parser untouched.
    command(sub, "lm-eval", "lm_eval's CLI with the 'psr' model registered")
    return p


def _lm_eval(argv: list[str]) -> int:
    try:
        from psr.eval.lm_eval_adapter import main as lm_eval_main
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        raise UsageError("psr lm-eval needs lm-eval: pip install 'psr[lm-eval]'") from None
    return lm_eval_main(argv)


def main(argv: list[str] | None = None) -> int:
    """Run `psr`; errors exit (SystemExit) with status 2 (usage), 1 (runtime) or 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_from_env()
    try:
        lead = 0  # top-level options before the command: only --debug
        while lead < len(argv) and argv[lead] == "--debug":
            lead += 1
        if argv[lead : lead + 1] == ["lm-eval"]:  # the rest belongs to lm_eval's parser
            debug = debug or lead > 0
            return _lm_eval(argv[lead + 1 :])
        args = build_parser().parse_args(argv)
        debug = debug or args.debug
        return args.fn(args)
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


if __name__ == "__main__":
    sys.exit(main())
