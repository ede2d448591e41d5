"""Fixed-decode snapshot: the tokens and counts of the embedded model under every policy and
expert format, written as JSON, so a refactor or a new decode path can be compared exactly.

    python bench/decode_snapshot.py --out before.json
    python bench/decode_snapshot.py --out after.json --compare before.json

Each case: greedy generation from fixed prompts (tokens, per-call stats) and one
teacher-forced scored window (its counts). `cache-prior-async` reads copy timing by
design: its tokens and counts are recorded but not compared. `--triton`
adds the Triton path under the interpreter (TRITON_INTERPRET=1 is set before
psr_kernels is imported) for a subset.
The comparison exits 1 naming every case whose tokens or counts differ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

POLICIES = ("exact", "exact-prefetch", "cache-prior", "psr", "cache-prior-async")
FORMATS = ("native", "bf16", "int8", "fp8", "int4")
PROMPTS = ("HAMLET. To be, or not to be", "KING. What news")
COUNTS = ("tokens", "routed", "hits", "misses", "prefetches", "prefetch_used", "copies")


def _case(psr: Any, policy: str, fmt: str, residency: float, compute: str, new: int) -> dict:
    model = psr.load(
        psr.DEFAULT_MODEL,
        policy,
        residency,
        expert_format=fmt,
        compute=compute,
        dtype="float32",
        progress=False,
    )
    out: dict[str, Any] = {"generate": [], "score": None}
    tok = model.tokenizer
    with model:
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            model.reset_stats()
            gen = model.generate(ids, max_new_tokens=new)
            s = model.stats
            row = {"tokens": gen[0].tolist(), "counts": {k: int(s[k]) for k in COUNTS}}
            # cache-prior-async reads copy timing by design: recorded, not compared.
            key = "timing" if policy == "cache-prior-async" else "fixed"
            out["generate"].append({key: row})
        if policy != "cache-prior-async":  # scoring reads a logical cache only
            text = " ".join(PROMPTS) * 4
            ids = tok(text, return_tensors="pt").input_ids[:, :48]
            model.reset_stats()
            model.score(ids, prompt_len=16)
            s = model.stats
            out["score"] = {k: int(s[k]) for k in COUNTS}
    return out


def _fixed(case: dict) -> dict:
    """A case without its timing-dependent results."""
    gen = [{k: v for k, v in g.items() if k != "timing"} for g in case["generate"]]
    return {"generate": gen, "score": case["score"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compare", type=Path, help="a snapshot to compare against")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--triton", action="store_true", help="also the Triton path (interpreter)")
    args = ap.parse_args(argv)
    if args.triton:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tqdm.auto import tqdm

    import psr

    cases = [(p, f, "torch") for p in POLICIES for f in FORMATS]
    if args.triton:
        cases += [(p, f, "triton") for p in ("exact", "psr") for f in ("native", "int8")]
    snap: dict[str, Any] = {}
    for policy, fmt, compute in tqdm(cases, desc="cases"):
        key = f"{policy}/{fmt}/{compute}"
        snap[key] = _case(psr, policy, fmt, args.residency, compute, args.new_tokens)
    args.out.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    print(f"{len(snap)} cases -> {args.out}")
    if args.compare is None:
        return 0
    ref = json.loads(args.compare.read_text())
    common = sorted(set(ref) & set(snap))
    bad = [k for k in common if _fixed(ref[k]) != _fixed(snap[k])]
    only = sorted(set(ref) ^ set(snap))
    if only:
        print(f"in one snapshot only (not compared): {', '.join(only)}")
    if bad or not common:
        print(f"DIFFER ({len(bad)} of {len(common)} common cases): {', '.join(bad)}")
        return 1
    print(f"identical: {len(common)} cases (tokens and counts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
