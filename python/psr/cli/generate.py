"""`psr generate`: decode a prompt with an offloaded checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from typing import Any

from psr.cli.args import (
    EMBEDDED,
    MODEL_HELP,
    QUIET_HELP,
    THREADS_HELP,
    UsageError,
    check_threads,
    command,
    device,
    dtype,
    fraction,
    host_memory,
    hybrid_m,
    model_config,
    model_path,
    nonempty,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    progress,
    size,
    token_ids,
    writable_file,
)
from psr.policy import DEFAULT_RESIDENCY, POLICIES
from psr.vocab import (
    COMPUTE_CHOICES,
    CPU_DOTS,
    DECODE_MODES,
    DENSE_FORMATS,
    DRAFTERS,
    EXPERT_FORMATS,
    EXPERTS_ON,
    KV_CHOICES,
)

# Files whose presence makes psr.models.load load a tokenizer.


def add_generate(sub: Any) -> None:
    g = command(sub, "generate", "decode a prompt with an offloaded checkpoint")
    add_model_option(g)
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
    add_policy_options(g)
    g.add_argument("--max-new-tokens", type=nonnegative_int, default=32, help="tokens to generate")
    add_placement_options(g)
    add_sampling_options(g)
    g.add_argument(
        "--json",
        default=None,
        help="also write tokens and stats as JSON here (default: no JSON)",
    )
    g.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    g.set_defaults(fn=run_generate)


def add_sampling_options(g: argparse.ArgumentParser) -> None:
    """--sample, --temperature, --top-k, --top-p, --seed (generate, chat)."""
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


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """model.generate's sampling keywords from add_sampling_options' options."""
    return {
        "do_sample": args.sample,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
    }


# ------------------------------------------------------------------ load options
# The options that say how a checkpoint loads, shared with `psr serve`: each helper adds
# its options in `psr generate --help`'s order.


def add_model_option(g: argparse.ArgumentParser) -> None:
    g.add_argument("--model", default=None, help=f"{MODEL_HELP} {EMBEDDED}")


# Each psr.load option the command line takes: its `psr.LoadConfig` field and the flag's
# argparse settings, in `--help`'s order; the default is LoadConfig's unless given here.
# tests/cli/test_load_config.py holds them equal: every field is a flag or in NOT_FLAGS.
POLICY_FLAGS: dict[str, dict[str, Any]] = {
    "policy": dict(choices=POLICIES, help="routing policy"),
    "residency": dict(
        type=fraction,
        help="fraction of each layer's experts with a device slot, in (0, 1] (default: "
        f"{DEFAULT_RESIDENCY:g}, or with --gpu-memory the most slots that fit)",
    ),
    "slots": dict(
        type=nonnegative_int,
        help="slots per layer, overriding --residency (default: from --residency); below "
        "top_k, down to 0, with --experts-on cpu / hybrid",
    ),
    "batch_slots": dict(
        type=positive_int,
        metavar="N",
        help="the slab's slots per layer for batched decode (several requests at once): "
        "each sequence's cache keeps --slots, a batch of b shares up to b x slots of these "
        "(default: --slots; more memory, fewer copies)",
    ),
    "lam": dict(
        type=nonnegative_float,
        help="bias toward cached experts, >= 0 (default: the policy's, psr.policy)",
    ),
    "n": dict(
        type=nonnegative_int,
        help="predicted experts inserted per layer and token (default: the policy's)",
    ),
    "quality_budget": dict(
        type=nonnegative_float,
        help="nats/token the policy may cost: require the operating point `psr tune` chose "
        "for this budget or a tighter one (cache-prior, psr)",
    ),
}
PLACEMENT_FLAGS: dict[str, dict[str, Any]] = {
    "device": dict(
        type=device,
        help="cpu, cuda or cuda:N (default: cuda when psr's backend is cuda, else cpu)",
    ),
    "dtype": dict(type=dtype, help="float32, bfloat16 or float16 (default: the checkpoint's)"),
    "compute": dict(
        choices=COMPUTE_CHOICES,
        help="kernels: Triton, torch references, or auto (Triton on CUDA)",
    ),
    "decode": dict(
        choices=DECODE_MODES,
        help="decode steps on device-resident caches with no host read (device), or "
        "host-driven (host)",
    ),
    "experts_on": dict(
        choices=EXPERTS_ON,
        help="where misses are computed: gpu (each copied into the slab), cpu (none copied: "
        "computed on the CPU from the host rows) or hybrid (at most --hybrid-m per layer "
        "copied, the rest on the CPU); CPU and GPU round differently, so tokens may differ",
    ),
    "hybrid_m": dict(  # joined into experts_on ('hybrid:M1,M2,...')
        type=hybrid_m,
        default=None,
        metavar="M[,M...]",
        help="with --experts-on hybrid: misses copied per layer step, one for every MoE layer "
        "or one per layer (default: chosen from `psr bench machine`'s profile)",
    ),
    "graphs": dict(
        action=argparse.BooleanOptionalAction,
        default=None,  # None: 'auto'
        help="decode each token as one captured graph over a static KV cache (default: on "
        "for CUDA, off elsewhere; on the CPU it compiles with torch.compile)",
    ),
    "expert_format": dict(
        choices=EXPERT_FORMATS,
        default="native",
        help="how the host store keeps experts and copies move them: native (the model's "
        "dtype), bf16, or quantized int8 / fp8 / int4 (dequantized on the fly)",
    ),
    "dense_format": dict(
        choices=DENSE_FORMATS,
        help="dense weights on the device: native (a GGUF file's blocks as stored, computed "
        "by psr's dense kernels), float (dequantized to --dtype: more memory), or int8 / fp8 "
        "(a float checkpoint's, quantized per output channel at load)",
    ),
    "kv_format": dict(
        choices=KV_CHOICES,
        help="how the KV cache keeps keys and values: auto (the dtype), bf16, or int8 / fp8 "
        "with a scale per token and head, dequantized when attention reads them (not with "
        "--graphs; linear-attention layers refused); fit (with --gpu-memory): the first of "
        "auto, int8, fp8 whose memory plan fits",
    ),
    "quant_cache": dict(
        nargs="?",
        const=True,
        metavar="DIR",
        help="with a quantized --expert-format: keep the quantized experts on disk and read "
        "them on later loads (in DIR, else $PSR_CACHE/quantized or the user cache folder; "
        "never in the model folder)",
    ),
    "host_memory": dict(
        type=host_memory,
        metavar="SIZE",
        help="host-memory budget ('48GB', '48GiB', bytes or 'unlimited'): experts beyond it "
        "stay in the memory-mapped checkpoint and are read from it when copied (default: "
        "every expert when the model fits 80%% of available memory; `psr inspect` says)",
    ),
    "gpu_memory": dict(
        type=size("--gpu-memory"),
        metavar="SIZE",
        help="device memory the model may take ('24GiB', '24GB', bytes): the memory plan "
        "(`psr inspect --gpu-memory`) picks the slots unless --residency / --slots is given, "
        "and a model that cannot fit is refused before loading, with the shortfall "
        "(default: no plan)",
    ),
    "speculative": dict(
        choices=list(DRAFTERS),
        help="greedy speculative decoding with the checkpoint's block heads, AR drafter or "
        "MTP layer; a resident drafter's memory comes out of the expert slots (default: off)",
    ),
    "block": dict(type=positive_int, help="with --speculative: drafted tokens per block"),
    "block_k": dict(
        type=positive_int,
        help="with --speculative: experts per layer and verify block (default: min(2 top_k, "
        "slots))",
    ),
    "verify": dict(
        metavar="MODE",
        help="with --speculative: 'budget' (one set of --block-k experts per layer and block) "
        "or 'cpu' / 'cpu:M' (each token's own top-k, the experts outside the slab computed on "
        "the CPU, at most M misses copied per layer and block) (default: %(default)s)",
    ),
    "prefill_chunk": dict(
        type=positive_int,
        help="tokens per prefill chunk, at fixed boundaries (default 512, at most the "
        "context): part of the configuration, as the prompt cache keys it, unless the "
        "forward is row-invariant (psr serve's with a prompt cache on the CPU)",
    ),
    "threads": dict(type=positive_int, metavar="N", help=THREADS_HELP),
    "cpu_dot": dict(
        choices=CPU_DOTS,
        help="CPU kernels on GGUF blocks: integer dots on Q8-quantized activations where "
        "faster (auto), fp32 activations (f32), or integer dots throughout (q8)",
    ),
    "context": dict(
        flag="--ctx-size",
        type=positive_int,
        metavar="TOKENS",
        help="context in tokens: prompt + new tokens beyond it are refused, the server's "
        "max_model_len (default: the checkpoint's max_position_embeddings; more is an error)",
    ),
}
# LoadConfig fields without a flag, and why.
NOT_FLAGS = {
    "host_profile": "a routing profile is a Python value (nested lists) or a JSON file",
    "copy_retries": "$PSR_COPY_RETRIES",
    "progress": "--quiet, and only on a terminal",
    "batch": "psr serve --parallel N sets it",
}


def _add_flags(g: argparse.ArgumentParser, flags: dict[str, dict[str, Any]]) -> None:
    from psr.load_config import LoadConfig

    defaults = {f.name: f.default for f in dataclasses.fields(LoadConfig)}
    for name, kw in flags.items():
        kw = {"default": defaults.get(name), "dest": name, **kw}
        g.add_argument(kw.pop("flag", "--" + name.replace("_", "-")), **kw)


def add_policy_options(g: argparse.ArgumentParser) -> None:
    """--policy, --residency, --slots, --lam, --n, --quality-budget."""
    _add_flags(g, POLICY_FLAGS)


def add_placement_options(g: argparse.ArgumentParser) -> None:
    """The other load options: where and how experts are kept and computed."""
    _add_flags(g, PLACEMENT_FLAGS)


def check_policy_options(args: argparse.Namespace) -> None:
    """The policy with its --lam / --n, and --threads, checked before anything loads
    (UsageError)."""
    from psr.policy import make_policy

    check_threads(args.threads)
    if args.slots == 0 and args.experts_on == "gpu":
        raise UsageError("--slots 0 needs --experts-on cpu or hybrid (a gpu slab holds top_k)")
    try:
        make_policy(args.policy, args.lam, args.n)
    except ValueError as e:
        raise UsageError(f"--policy {args.policy}: {e}") from None


def _experts_on(args: argparse.Namespace) -> str:
    """psr.load's experts_on from --experts-on and --hybrid-m ('hybrid:M1,M2,...')."""
    m = args.hybrid_m
    if m is None:
        return str(args.experts_on)
    if args.experts_on != "hybrid":
        raise UsageError(f"--hybrid-m is for --experts-on hybrid, not {args.experts_on}")
    return "hybrid:" + ",".join(map(str, m if isinstance(m, list) else [m]))


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """psr.models.load's keyword arguments from the load options (progress apart)."""
    out = {name: getattr(args, name) for name in (*POLICY_FLAGS, *PLACEMENT_FLAGS)}
    del out["hybrid_m"]
    out["experts_on"] = _experts_on(args)
    out["graphs"] = "auto" if args.graphs is None else args.graphs
    return out


def load_model(path: str, args: argparse.Namespace, show_progress: bool, **extra: Any) -> Any:
    """psr.models.load with the load options (and `extra` keywords). In the `psr` command's
    own process the heap is then frozen: the ~400k objects of torch, transformers and the
    model made each full garbage collection a ~155 ms stall in the middle of a decode
    (OLMoE on this CPU); frozen (gc.freeze), later collections skip them. main() called
    in-process (tests, notebooks) leaves its caller's collector alone."""
    from psr.models import load

    model = load(path, **load_options(args), **extra, progress=show_progress)
    if getattr(args, "own_process", False):
        gc.collect()  # what is garbage now is not frozen with the rest
        gc.freeze()
    return model


def run_generate(args: argparse.Namespace) -> int:
    check_policy_options(args)
    path = model_path(args.model)
    cfg = model_config(path)
    from psr.models.sources import describe_missing_tokenizer, has_tokenizer

    if args.prompt is not None and not has_tokenizer(path):
        raise ValueError(
            f"--prompt: {path} has {describe_missing_tokenizer(path)}; pass --prompt-ids instead"
        )
    vocab = cfg.get("vocab_size")
    if args.prompt_ids is not None and isinstance(vocab, int):
        bad = [i for i in args.prompt_ids if i >= vocab]
        if bad:
            raise ValueError(f"--prompt-ids: id {bad[0]} is outside the vocabulary of {vocab}")
    out = writable_file(args.json, "--json") if args.json else None
    show_progress = progress(args)

    model = load_model(path, args, show_progress)
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
        **sampling_options(args),
        eos_token_id=getattr(tok, "eos_token_id", None),
        progress=show_progress,
    )
    new = gen[0, len(ids) :].tolist()
    # The text alone on stdout (`psr generate ... > out.txt`); what the run did on stderr.
    print(tok.decode(ids + new) if tok is not None else " ".join(map(str, ids + new)))
    sys.stdout.flush()
    print(f"\n{_summary(model, args)}", file=sys.stderr)
    speculative: dict[str, Any] | None = None
    if model.spec_stats is not None:
        st = model.spec_stats
        print(
            f"speculative ({args.speculative}, B={args.block}, "
            f"{model.verify_rule().describe()}): "
            f"{st.blocks} verify blocks, {st.accepted_per_block:.2f} drafts accepted and "
            f"{st.tokens_per_block:.2f} tokens per block",
            file=sys.stderr,
        )
        # The same figures as the line above, plus the per-block counts behind them.
        speculative = {
            "drafter": args.speculative,
            "block": args.block,
            "block_k": model.block_k,
            "verify": model.verify,
            **st.as_dict(),
        }
    print(model.stats.table(), file=sys.stderr)
    if out is not None:
        result: dict[str, Any] = {
            "tokens": gen[0].tolist(),
            "policy": model.policy.describe(),
            "policy_source": model.policy_source,
            "stats": model.stats.summary(),
        }
        if speculative is not None:
            result["speculative"] = speculative
        out.write_text(json.dumps(result, indent=2))
    return 0


def _summary(model: Any, args: argparse.Namespace) -> str:
    """The line after the text: how the model ran."""
    rt = model.runtime
    return (
        f"policy {model.policy.describe()} ({model.policy_source}), "
        f"{rt.capacity} of {rt.spec.num_experts} experts resident per "
        f"layer, backend {rt.store.backend}, compute {rt.ops.path}, "
        f"experts {_experts_shown(model, args.expert_format)}, decode {args.decode}, "
        + (f"experts on {_experts_on(args)}, " if args.experts_on != "gpu" else "")
        + f"graphs {model.graph_status}"
    )


def _experts_shown(model: Any, asked: str) -> str:
    """The expert format as loaded: the option, or a GGUF / pre-quantized file's blocks."""
    fmts = list(dict.fromkeys(f for f in model.runtime.row_formats if f.is_blocks))
    if fmts:
        return " / ".join(f.shown for f in fmts) + " (the file's blocks)"
    return asked
