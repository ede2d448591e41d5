"""CPU-only greedy decoding with speculation (exact verify) against without, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/spec_cpu.py [--model DIR] [--drafter ar]
        [--threads 1] [--prompts 4] [--tokens 48] [--rounds 3] [--out DIR]

Both load the embedded model (or `--model`, a checkpoint with psr's drafters) on the CPU
at residency 1.0 under exact routing: autoregressive decoding (the device decode step, every
expert in the slab: no copies once loaded) and speculative decoding with the drafter and
verify='cpu' (each token's exact top-k; the experts the drafter's memory pushed out of the
slab computed from the host rows). Every prompt of held-out set B is decoded greedily by
both, the tokens asserted identical, and the wall time of each `generate` (prefill
included, the same prompt for both) summed; rounds interleave the two (A B A B ...) and
the table shows each round and the median ratio. The machine is shared: ratios only, with
the load (`os.getloadavg`) printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import psr
from psr.eval.defaults import PROMPT_TOKENS, WINDOW_TOKENS
from psr.eval.harness import EvalData


def _decode(model: Any, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Greedy continuations of every prompt and their summed wall time."""
    out, seconds = [], 0.0
    for p in prompts:
        t = time.perf_counter()
        ids = model.generate(p, tokens)
        seconds += time.perf_counter() - t
        out.append(ids[0, len(p) :].tolist())
    return out, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default="ar", choices=["ar", "block"])
    ap.add_argument("--block", type=int, default=4, help="drafted tokens per block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for spec_cpu.{md,json}")
    a = ap.parse_args()
    path = a.model or psr.DEFAULT_MODEL
    data = EvalData.from_heldout(
        path, "B", windows=1, window_tokens=WINDOW_TOKENS, prompt_tokens=PROMPT_TOKENS,
        prompts=a.prompts, gen_tokens=a.tokens,
    )  # fmt: skip
    common = dict(device="cpu", dtype="float32", threads=a.threads, progress=False)
    ar = psr.load(path, "exact", 1.0, **common)
    sp = psr.load(path, "exact", 1.0, speculative=a.drafter, block=a.block, verify="cpu", **common)
    rounds = []
    for _ in range(a.rounds):
        want, t_ar = _decode(ar, data.prompts, a.tokens)
        got, t_sp = _decode(sp, data.prompts, a.tokens)
        assert got == want, "speculative decoding (exact verify) changed the greedy tokens"
        n = sum(len(g) for g in got)
        st = sp.spec_stats
        rounds.append(
            {"ar_tok_s": n / t_ar, "spec_tok_s": n / t_sp, "ratio": t_ar / t_sp,
             "tokens": n, "load": os.getloadavg()[0], "last_tokens_per_block": st.tokens_per_block}
        )  # fmt: skip
    result = _report(a, path, sp, rounds)
    if a.out:
        o = Path(a.out)
        o.mkdir(parents=True, exist_ok=True)
        (o / "spec_cpu.json").write_text(json.dumps(result, indent=1))
        (o / "spec_cpu.md").write_text(result["markdown"] + "\n")


def _report(a: argparse.Namespace, path: str, sp: Any, rounds: list[dict[str, Any]]) -> Any:
    lines = [
        f"CPU-only greedy decode, {a.prompts} prompts x {a.tokens} tokens of held-out set B, "
        f"{a.threads} thread(s); speculative: {a.drafter} drafter, B={a.block}, verify=cpu "
        f"({sp.runtime.capacity} of {sp.runtime.spec.num_experts} experts per layer in the "
        "slab, the rest on the CPU); identical tokens asserted every round",
        "",
        "| round | autoregressive tok/s | speculative tok/s | ratio | load avg |",
        "|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        lines.append(
            f"| {i + 1} | {r['ar_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['ratio']:.2f}x | "
            f"{r['load']:.1f} |"
        )
    med = statistics.median(r["ratio"] for r in rounds)
    lines += ["", f"median ratio: {med:.2f}x"]
    md = "\n".join(lines)
    print(md)
    return {"model": path, "args": vars(a), "rounds": rounds, "median_ratio": med, "markdown": md}


if __name__ == "__main__":
    main()
