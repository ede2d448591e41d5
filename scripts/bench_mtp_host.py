"""The MTP drafter at equal memory, host-free against host-aware modeled latency (issue 41):
`psr bench speculative`'s comparison (psr.eval.spec_compare) with each configuration's
host schedule measured from a real decode (`compare_speculative(host=True)`), for verify
blocks of B = 1, 2, 4 under both verify rules, against the autoregressive psr point with
experts on gpu / cpu / hybrid:2.

    OMP_NUM_THREADS=1 python scripts/bench_mtp_host.py --threads 1 --residency 0.5 \
        --blocks 1,2,4 --windows 24 --prompts 4 --gen-tokens 40 \
        --out bench/results/speculative

Schedules are measured on psr's GPU path, the Triton kernels, here under Triton's
interpreter (set before psr_kernels is imported): the same calls, launches and syncs.
Writes NAME.{md,json} (--name; default speculative_host).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # the schedules' Triton path on a CPU


def specs(blocks: list[int], top_k: int, prefetch2: bool, drafter: str = "mtp") -> list[Any]:
    """Per B: budget K_b = 2k at lam 0 / 0.1 (B = 4 also 3k), exact verify with CPU experts
    M = 0 and 2 at lam 0 / 0.1; B = 1 also n = 2 prefetched (M = 0 at lam 0.1 / 0.15, M = 1
    at lam 0.1). The oracle drafter (an upper bound): exact verify, M = 0 and 2, lam 0."""
    from psr.eval.spec_compare import SpecConfig
    from psr.policy import make_policy

    out = []
    if drafter == "oracle":
        for b in blocks:
            for m in (0, 2):
                out.append(SpecConfig("oracle", b, None, make_policy("psr", 0.0, 1), f"cpu:{m}"))
        return out
    for b in blocks:
        for kb in (top_k * 2, top_k * 3) if b == 4 else (top_k * 2,):
            for lam in (0.0, 0.1):
                out.append(SpecConfig("mtp", b, kb, make_policy("psr", lam, 1)))
        for m in (0, 2):
            for lam in (0.0, 0.1):
                out.append(SpecConfig("mtp", b, None, make_policy("psr", lam, 1), f"cpu:{m}"))
        if b == 1 and prefetch2:
            for m, lam in ((0, 0.1), (0, 0.15), (1, 0.1)):
                out.append(SpecConfig("mtp", 1, None, make_policy("psr", lam, 2), f"cpu:{m}"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--residency", type=float, default=0.5)
    p.add_argument("--blocks", default="1,2,4")
    p.add_argument("--windows", type=int, default=24)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--gen-tokens", type=int, default=40)
    p.add_argument("--drafter", choices=("mtp", "oracle"), default="mtp")
    p.add_argument("--no-prefetch2", action="store_true", help="skip the B = 1, n = 2 rows")
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="speculative_host", help="the files' name, .md / .json")
    args = p.parse_args(argv)

    import torch

    from psr.cli.args import eval_model
    from psr.eval.defaults import PROMPT_TOKENS, WINDOW_TOKENS
    from psr.eval.harness import EvalData
    from psr.eval.runs import describe
    from psr.eval.spec_compare import compare_speculative, host_markdown, markdown
    from psr.models.loader import load

    torch.set_num_threads(args.threads)
    path = eval_model(args.model)
    data = EvalData.from_heldout(
        path,
        "B",
        windows=args.windows,
        window_tokens=WINDOW_TOKENS,
        prompt_tokens=PROMPT_TOKENS,
        prompts=args.prompts,
        gen_tokens=args.gen_tokens,
    )
    probe = load(path, "exact", 1.0, progress=False)
    k = probe.runtime.spec.top_k
    probe.close()
    blocks = [int(b) for b in args.blocks.split(",")]
    grid = specs(blocks, k, not args.no_prefetch2, args.drafter)
    rows = compare_speculative(path, [args.residency], grid, data, host=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k != "generated"} for r in rows]
    cmd = "OMP_NUM_THREADS=1 python scripts/bench_mtp_host.py " + " ".join(sys.argv[1:])
    (out / f"{args.name}.json").write_text(
        json.dumps({"model": path, "data": describe(data), "command": cmd, "rows": slim}, indent=1)
    )
    text = (
        f"measured on {describe(data)}\n\n`{cmd}`\n\n## host-free and host-aware\n\n"
        f"{host_markdown(rows)}\n\n## all columns (host-free)\n\n{markdown(rows)}\n"
    )
    (out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
