"""`psr serve` (an OpenAI-compatible server) and `psr bench serve`."""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from psr.cli.args import (
    QUIET_HELP,
    command,
    model_config,
    model_path,
    nonempty,
    nonnegative_int,
    positive_int,
    progress,
    writable_file,
)
from psr.cli.generate import (
    add_model_option,
    add_placement_options,
    add_policy_options,
    check_policy_options,
    load_model,
)

SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
DEFAULT_PROMPT_CACHE_MIB = 1024


def port(s: str) -> int:
    try:
        v = int(s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {s!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {s!r}")
    return v


def _parallel(s: str) -> int | None:
    """--parallel: 'auto' (None) or a count >= 1."""
    if s.strip().lower() == "auto":
        return None
    return positive_int(s)


def _load_args(p: argparse.ArgumentParser) -> None:
    """The load options `psr generate` takes, with its defaults."""
    add_model_option(p)
    add_policy_options(p)
    add_placement_options(p)


def add_serve(sub: Any) -> None:
    s = command(sub, "serve", "an OpenAI-compatible streaming server for an offloaded checkpoint")
    _load_args(s)
    s.add_argument(
        "--host",
        type=nonempty,
        default=DEFAULT_HOST,
        help="address to listen on (0.0.0.0: every interface)",
    )
    s.add_argument("--port", type=port, default=DEFAULT_PORT, help="port to listen on")
    s.add_argument(
        "--served-model-name",
        type=nonempty,
        default=None,
        help="the model's name in the API (default: a GGUF file's stem, a cached repo's id, "
        "else the checkpoint folder's name)",
    )
    s.add_argument(
        "--max-queue",
        type=nonnegative_int,
        default=16,
        help="requests that may wait while one decodes; more are answered 429",
    )
    s.add_argument(
        "--parallel",
        type=_parallel,
        default=None,
        metavar="N|auto",
        help="requests that decode at once in one batch, each token as it would be alone, "
        "sharing the prompt cache; N > 1 on CUDA sizes the slab for N sequences' caches where "
        "memory allows (default auto: on the CPU backend as many KV caches of the context as "
        "fit half the memory left after loading, at most 4; 1 on CUDA)",
    )
    _access_args(s)
    s.add_argument(
        "--max-body",
        type=positive_int,
        default=8 * 2**20,
        help="largest request body in bytes; larger ones are answered 413 (default 8 MiB)",
    )
    s.add_argument(
        "--strict",
        action="store_true",
        help="refuse unknown request fields with a 400 (default: ignored, with a Warning "
        "header and a log line, as vLLM)",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file, used instead of the checkpoint's (or the fallback)",
    )
    s.add_argument(
        "--tool-parser",
        default=None,
        metavar="NAME",
        help="the tool-call format of the model's replies (default: read from the chat "
        "template): hermes, qwen3_coder, glm45, minimax_m2, mistral, llama4_json, deepseek_v3",
    )
    s.add_argument(
        "--prompt-cache",
        type=nonnegative_int,
        default=DEFAULT_PROMPT_CACHE_MIB,
        metavar="MIB",
        help="memory for the prefill states of earlier prompts, so a request extending one "
        f"(a conversation's next turn) resumes from it, with one slot or --parallel N; "
        f"tokens unchanged (default {DEFAULT_PROMPT_CACHE_MIB}; 0: off)",
    )
    s.add_argument(
        "--cache-answers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="while no request runs or waits, prefill each finished request's prompt and "
        "answer into the prompt cache (the 4 most recent, one chunk at a time, stopped when "
        "a request arrives), so a conversation's next turn resumes after the answer; with "
        "the row-invariant CPU forward (default on)",
    )
    s.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    s.set_defaults(fn=run_serve)


def _access_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require Authorization: Bearer KEY on /v1 routes (repeatable; default: "
        "$PSR_API_KEY if set, else no key)",
    )
    s.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="more keys, one per line (blank lines and # comments skipped)",
    )
    s.add_argument(
        "--protect-all",
        action="store_true",
        help="/health and /metrics need the key too (default: they are open)",
    )
    s.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="answer CORS requests (preflight included) from these comma-separated "
        "origins, or * for any (default: no CORS)",
    )


def add_bench_serve(bsub: Any) -> None:
    b = command(
        bsub,
        "serve",
        "streaming requests against a local server (sequential, then concurrent) vs "
        "model.generate on the same prompts: time to first token, tokens/s, overhead",
    )
    _load_args(b)
    b.add_argument("--requests", type=positive_int, default=8, help="prompts (N)")
    b.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per request")
    b.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="repeat the three runs R times: R x N request pairs behind the overhead's 95%% "
        "interval",
    )
    b.add_argument(
        "--json", default=None, help="also write the result as JSON here (default: no JSON)"
    )
    b.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    b.set_defaults(fn=run_bench_serve)


def _check(args: argparse.Namespace) -> str:
    """Up-front checks shared by serve and bench serve; returns the model folder."""
    check_policy_options(args)
    missing = []
    for name in SERVE_PACKAGES:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        # A missing package is missing files: reported in one line, as other OSErrors.
        raise OSError(
            f"psr serve needs {', '.join(missing)}: pip install 'psr[serve]' "
            "(scripts/install.sh installs them)"
        )
    path = model_path(args.model)
    model_config(path)
    from psr.models.sources import describe_missing_tokenizer, has_tokenizer

    if not has_tokenizer(path):
        raise ValueError(
            f"--model: {path} has {describe_missing_tokenizer(path)}; "
            "psr serve reads text prompts and writes text"
        )
    return str(path)


def _check_bind(host: str, port: int) -> None:
    """Bind once before loading (as uvicorn will: IPv6 if the host has a colon), so that a
    taken port or a foreign address fails now, in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise OSError(
                f"--host {host} --port {port}: cannot listen: {e.strerror or e}"
            ) from None


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys from --api-key, --api-key-file and $PSR_API_KEY (when no --api-key)."""
    keys = list(args.api_key or [])
    if not keys and os.environ.get("PSR_API_KEY"):
        keys.append(os.environ["PSR_API_KEY"])
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise OSError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
        found = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {args.api_key_file}: no keys in it")
        keys += found
    if any(not k.strip() or any(c.isspace() for c in k) for k in keys):
        raise ValueError("--api-key: a key must be non-empty, without whitespace")
    return tuple(dict.fromkeys(keys))


def _origins(value: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    out = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    if not out:
        raise ValueError("--allowed-origins: give origins (https://host:port) or *")
    return out


def _chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise OSError(f"--chat-template {path}: {e.strerror or e}") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    return text


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_options(args: argparse.Namespace) -> Any:
    """The app's options (psr.serve.app.Options) from the command line."""
    from psr.serve.access import Access
    from psr.serve.app import Options

    return Options(
        access=Access(api_keys(args), args.protect_all),
        allowed_origins=_origins(args.allowed_origins),
        max_body=args.max_body,
        strict=args.strict,
        chat_template=_chat_template(args.chat_template),
        tool_parser=_tool_parser(args.tool_parser),
    )


def _tool_parser(name: str | None) -> str | None:
    from psr.serve.tools import FORMATS

    if name is not None and name not in FORMATS:
        raise ValueError(f"--tool-parser {name!r}: one of {', '.join(sorted(FORMATS))}")
    return name


def run_serve(args: argparse.Namespace) -> int:
    path = _check(args)
    options = serve_options(args)
    _check_bind(args.host, args.port)
    from psr.models.names import served_name

    # A GGUF file's stem, a cached repo's id, else the folder's name.
    name = args.served_model_name or served_name(path)
    if not options.access.keys and not is_loopback(args.host):
        logging.getLogger("psr.serve").warning(
            "listening on %s without an API key: anyone who can reach it can use the model "
            "(--api-key or PSR_API_KEY)",
            args.host,
        )

    import uvicorn

    from psr.runtime.chunked import PromptCache
    from psr.serve.app import create_app
    from psr.serve.metrics import Metrics
    from psr.serve.worker import Engine

    show_progress = progress(args)
    cache_mib = args.prompt_cache
    engine = Engine(
        lambda: _load_for_slots(path, args, show_progress),
        max_queue=args.max_queue,
        metrics=Metrics(name),
        prompt_cache=PromptCache(cache_mib * 2**20) if cache_mib else None,
        parallel=args.parallel,
        cache_answers=args.cache_answers,
    )
    config = uvicorn.Config(
        create_app(engine, served_name=name, options=options),
        host=args.host,
        port=args.port,
        log_config=_log_config(),
        access_log=False,  # psr.serve logs one line per request itself
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)

    def stop() -> None:
        server.should_exit = True

    engine.on_fatal = stop
    server.run()
    if engine.load_error is not None:
        raise engine.load_error
    return 0


def _load_for_slots(path: str, args: argparse.Namespace, show_progress: bool) -> Any:
    """The model, with --parallel N > 1 (and no --batch-slots) its slab sized for N
    sequences where memory allows (LoadConfig.batch: CUDA only); a slab that does not fit
    the memory plan or the device falls back to the solo slots, logged."""
    n = args.parallel
    if n is None or n == 1 or args.batch_slots is not None:
        return load_model(path, args, show_progress)
    import torch

    from psr.models.memory_plan import MemoryPlanError

    try:
        return load_model(path, args, show_progress, batch=n)
    except (MemoryPlanError, torch.OutOfMemoryError) as e:
        logging.getLogger("psr.serve").warning(
            "--parallel %d: a slab for %d sequences does not fit (%s); the solo slots", n, n, e
        )
    return load_model(path, args, show_progress)


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, with psr.serve's request lines through its default handler."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = json.loads(json.dumps(LOGGING_CONFIG))  # a deep copy
    cfg["loggers"]["psr.serve"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return dict(cfg)


def run_bench_serve(args: argparse.Namespace) -> int:
    path = _check(args)
    out = writable_file(args.json, "--json") if args.json else None
    from psr.serve.overhead import bench_serve

    model = load_model(path, args, progress(args))
    result = bench_serve(
        model,
        requests=args.requests,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        progress=progress(args),
    )
    print(result.table())
    if out is not None:
        out.write_text(json.dumps(result.as_dict(), indent=2))
    return 0
