"""psr command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _bench_copy(args: argparse.Namespace) -> int:
    from psr.eval.microbench import run_copy_overlap

    shape = tuple(int(x) for x in args.shape.split("x"))
    r = run_copy_overlap(shape, args.experts, args.slots, args.repeats, backend=args.backend)
    print(r.table())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r.as_dict(), indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from psr.models import DEFAULT_MODEL, load

    model = load(
        args.model or DEFAULT_MODEL,
        policy=args.policy,
        residency=args.residency,
        slots=args.slots,
        lam=args.lam,
        n=args.n,
        device=args.device,
        dtype=args.dtype,
        compute=args.compute,
        progress=not args.quiet,
    )
    tok = model.tokenizer
    if args.prompt_ids is not None:
        ids = [int(x) for x in args.prompt_ids.replace(",", " ").split()]
    elif args.prompt is not None:
        if tok is None:
            raise SystemExit(f"psr: {args.model} has no tokenizer; pass --prompt-ids instead")
        ids = tok(args.prompt)["input_ids"]
    else:
        raise SystemExit("psr: give --prompt TEXT or --prompt-ids IDS")
    out = model.generate(
        ids,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=getattr(tok, "eos_token_id", None),
        progress=not args.quiet,
    )
    new = out[0, len(ids) :].tolist()
    print(tok.decode(ids + new) if tok is not None else " ".join(map(str, ids + new)))
    print()
    print(
        f"policy {model.policy.describe()}, {model.runtime.capacity} of "
        f"{model.runtime.spec.num_experts} experts resident per layer, "
        f"backend {model.runtime.store.backend}, compute {model.runtime.ops.path}"
    )
    print(model.stats.table())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"tokens": out[0].tolist(), "stats": model.stats.summary()}, indent=2)
        )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from psr.eval.runs import demo

    demo(args.out, progress=not args.quiet, quick=args.quick)
    return 0


def _residencies(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _eval(args: argparse.Namespace) -> int:
    from psr.eval.runs import evaluate, grid
    from psr.policy import parse_policies

    evaluate(
        args.model,
        grid(parse_policies(args.policies), _residencies(args.residency)),
        args.out,
        windows=args.windows,
        cloze=args.cloze,
        prompts=args.prompts,
        gen_tokens=args.gen_tokens,
        progress=not args.quiet,
        traces=args.traces,
    )
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from psr.eval.runs import sweep

    sweep(
        args.model,
        args.out,
        _residencies(args.residency),
        [float(x) for x in args.lams.split(",")],
        [int(x) for x in args.ns.split(",")],
        tolerance=args.tolerance,
        windows=args.windows,
        write_points=args.write_operating_points,
        progress=not args.quiet,
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from psr.store import backend_info

    print(json.dumps(backend_info(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="psr", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="what the extension was built with and can use")
    info.set_defaults(fn=_info)
    from psr.models.embedded import DEFAULT_MODEL
    from psr.policy import DEFAULT_RESIDENCY, POLICIES, default_policy_specs

    g = sub.add_parser("generate", help="decode a prompt with an offloaded checkpoint")
    g.add_argument(
        "--model", default=None, help="local HF checkpoint folder (default: the embedded model)"
    )
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-ids", default=None, help="token ids instead of text: '1,2,3'")
    g.add_argument("--policy", choices=POLICIES, default="psr")
    g.add_argument("--residency", type=float, default=DEFAULT_RESIDENCY)
    g.add_argument("--slots", type=int, default=None, help="slots per layer (overrides residency)")
    g.add_argument("--lam", type=float, default=None)
    g.add_argument("--n", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--compute", choices=["auto", "triton", "torch"], default="auto")
    g.add_argument("--sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", default=None, help="also write tokens and stats as JSON here")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.set_defaults(fn=_generate)

    d = sub.add_parser("demo", help="the embedded model under four policies at 50%%/25%% residency")
    d.add_argument("--out", default="bench/results/demo")
    d.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(fn=_demo)

    ev = sub.add_parser("eval", help="quality suite (perplexity, cloze, greedy) vs exact")
    ev.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint with heldout.txt")
    ev.add_argument(
        "--policies",
        default=default_policy_specs(),
        help="';'-separated name[:lam=..,n=..] (exact is always added)",
    )
    ev.add_argument("--residency", default="0.5,0.25")
    ev.add_argument("--windows", type=int, default=24, help="perplexity windows")
    ev.add_argument("--cloze", type=int, default=24, help="cloze multiple-choice items")
    ev.add_argument("--prompts", type=int, default=4)
    ev.add_argument("--gen-tokens", type=int, default=48)
    ev.add_argument("--out", default="bench/results/eval")
    ev.add_argument("--traces", action="store_true", help="keep routing traces in the JSON")
    ev.add_argument("--quiet", action="store_true")
    ev.set_defaults(fn=_eval)

    bench = sub.add_parser("bench", help="benchmarks: copy engine, lam x n sweep")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bc = bsub.add_parser("copy", help="copy engine bandwidth and copy/compute overlap")
    bc.add_argument("--shape", default="3x2048x1024", help="expert shape (default: OLMoE FFN)")
    bc.add_argument("--experts", type=int, default=8)
    bc.add_argument("--slots", type=int, default=4)
    bc.add_argument("--repeats", type=int, default=5)
    bc.add_argument("--backend", choices=["cpu", "cuda"], default=None)
    bc.add_argument("--json", default=None, help="also write the result as JSON here")
    bc.set_defaults(fn=_bench_copy)
    sw = bsub.add_parser("sweep", help="lam x n: Pareto front of modeled latency vs quality")
    sw.add_argument("--model", default=DEFAULT_MODEL)
    sw.add_argument("--residency", default="0.5,0.25")
    sw.add_argument("--lams", default="0.1,0.2,0.3,0.5,0.8")
    sw.add_argument("--ns", default="0,1,2")
    sw.add_argument("--tolerance", type=float, default=0.01, help="Δ nats/token allowed")
    sw.add_argument("--windows", type=int, default=16)
    sw.add_argument("--out", default="bench/results/sweep")
    sw.add_argument(
        "--write-operating-points",
        action="store_true",
        help="store the chosen points beside the model (the demo reads them)",
    )
    sw.add_argument("--quiet", action="store_true")
    sw.set_defaults(fn=_sweep)

    # Handled in main(): the rest of the line goes to lm_eval's parser untouched.
    sub.add_parser("lm-eval", help="lm_eval's CLI with the 'psr' model registered")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:  # everything after it belongs to lm_eval's own parser
        from psr.eval.lm_eval_adapter import main as lm_eval_main

        return lm_eval_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
