"""Modeled time to first token (issue 36 item 5): psr.eval.ttft's table for 512 / 4k /
16k-token prompts on the GPU profiles, with the embedded model's recorded routing beside
uniform routing, written as markdown and JSON with the command that made them.

    OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python bench/ttft.py --out bench/results/ttft

Recorded routing: the embedded model (64 experts, top-8, OLMoE's routing shape; context
512) prefills `--prompts` windows of 512 tokens of its held-out text (exact routing, on
the CPU); the mean distinct experts per MoE layer of every n-token window (n = 1, 2, 4,
.., 512, non-overlapping) is its union u(n), priced as OLMoE-1B-7B's experts (as the
latency model prices the embedded model's traces). Past 512 tokens it is held at u(512).
`--dry-run`: uniform routing only (no model run), printed, nothing written.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

from common import write_json  # noqa: E402

from psr.eval import ttft  # noqa: E402

WINDOW = 512  # the embedded model's context
NOTES = """Notes (what the model says; costs are the profiles' and MFU an assumption, so these
are estimates, not measurements):
- Goal (within 1.2x of max(used experts' bytes / link, compute) on the RTX 4090 profile):
  psr's prefill schedule today meets it only for prompts of one chunk (64, 512 tokens:
  1.00-1.01x). At 4k / 16k it is 8-18x off (8-31x on the H200 profile): every chunk
  copies its layer's used set again, and a 512-token chunk already uses (nearly) every
  expert of a layer (recorded: 63.6 of 64 on the embedded model; uniform: all of them for
  the four shapes), so a T-token prompt moves T / 512 times the experts the bound moves.
  The copies do not overlap across layers (layer L+1's used set is known once it routes)
  or chunks. Copying layer L+1's set during layer L ("+ prefetch L+1") gains under 3%:
  each chunk is copy-bound, so the overlap hides only its small compute. What reaches the
  goal is layer-major prefill (every chunk of the prompt through layer L while its
  experts are resident, layer L+1's set in flight): 1.00-1.03x on the 4090 profile, 1.05x
  worst on the H200. Its price: the prompt's hidden states per layer ([T, H] bf16: 64
  MiB at 16k for OLMoE / Qwen3, 224 MiB for DeepSeek-V3), two layers' used experts in
  slots (OLMoE bf16 1.6 GB, Qwen3-30B-A3B Q8_0 1.3 GB, gpt-oss-120b 3.4 GB, DeepSeek-V3
  Q4_K 12.7 GB), and a forward driven layer by layer across chunks (transformers' forward
  is chunk-major; attention per chunk is unchanged, so the chunking's numerics are kept).
- The model assumes a slab much smaller than the experts (the offloaded case): with
  every expert of a layer resident (OLMoE's 12.9 GB fit a 4090 at residency 1.0) later
  chunks copy nothing and today's schedule is compute-bound.
- Second turn with the prompt cache: it computes only the tokens after the last cached
  boundary (at most a chunk plus the 100 new ones), so its TTFT is about one chunk's
  copies: 0.53 s against 17 s for a 16k conversation (OLMoE, 4090 profile, today).
- The per-expert CPU split (psr.machine.PrefillSplit) prices a token of an expert on the
  CPU at its bytes / cpu_gbps (the kernels read the row once per token): thresholds of 3
  (4090 profile) and 4 (H200) tokens. Chunks of 512 give ~32-64 tokens per expert, so the
  split moves nothing at 512+ tokens; it halves a 64-token prompt's TTFT for the big
  shapes (DeepSeek-V3 12.9 -> 6.1 s, gpt-oss-120b 2.1 -> 1.0 s, 4090 profile). A grouped
  CPU kernel reading a row once for t tokens would raise the thresholds.
- The peers' figures are theirs, on their hardware: KTransformers' Qwen3-30B-A3B 4k prompt
  in ~1.33 s (RTX 5090) against psr's modeled 10 s today / 1.28 s layer-major (4090
  profile); llama.cpp's gpt-oss-120b at 2,091 tok/s (RTX 3090, micro-batch 8192) against
  psr's modeled 4k prompt in 20 s today / 2.5 s layer-major.
"""


def record_union(prompts: int) -> dict[int, float]:
    """Mean distinct experts per MoE layer of n-token windows of the embedded model's
    routing over `prompts` held-out windows of WINDOW tokens."""
    import torch

    import psr
    from psr.models.embedded import DEFAULT_MODEL, heldout_text

    torch.set_num_threads(1)
    model = psr.load(DEFAULT_MODEL, "exact", 1.0, device="cpu", progress=False)
    ids = model.tokenizer(heldout_text(DEFAULT_MODEL), return_tensors="pt").input_ids
    sums: dict[int, list[float]] = {}
    for p in range(prompts):
        window = ids[:, p * WINDOW : (p + 1) * WINDOW]
        if window.shape[1] < WINDOW:
            break
        model.generate(window[:, : WINDOW - 1], max_new_tokens=1)
        for hist in model.runtime.histories():
            n = 1
            while n <= len(hist):
                for s in range(0, len(hist) - n + 1, n):
                    got = {e for row in hist[s : s + n] for e in row}
                    sums.setdefault(n, []).append(len(got))
                n *= 2
    return {n: sum(v) / len(v) for n, v in sorted(sums.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/ttft")
    ap.add_argument("--prompts", type=int, default=8, help="held-out windows of 512 tokens")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dry-run", action="store_true", help="uniform routing only, print")
    a = ap.parse_args()
    table = None if a.dry_run else record_union(a.prompts)
    unions = {} if table is None else {"olmoe-1b-7b": ttft.recorded_union(table, 64)}
    rows = ttft.ttft_rows(chunk=a.chunk, unions=unions)
    md = ttft.ttft_report(unions=unions, chunk=a.chunk)
    if a.dry_run:
        print(md)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python " + " ".join(sys.argv)
    union_md = "\n".join(
        ["| tokens n | distinct experts per layer, recorded | uniform |", "|---|---|---|"]
        + [
            f"| {n} | {u:.1f} | {ttft.uniform_union(64, 8)(n):.1f} |"
            for n, u in (table or {}).items()
        ]
    )
    (out / "README.md").write_text(
        f"# Modeled time to first token (issue 36 item 5)\n\n    {cmd}\n\n"
        f"(module docstrings of bench/ttft.py and psr.eval.ttft for the model)\n\n{md}\n\n"
        f"The embedded model's recorded union (its {WINDOW}-token held-out windows):\n\n"
        f"{union_md}\n\n{NOTES}"
    )
    write_json(
        out / "ttft.json",
        {
            "command": cmd,
            "mfu": ttft.MFU,
            "gpu_tflops": ttft.GPU_TFLOPS,
            "shapes": {k: vars(v) for k, v in ttft.SHAPES.items()},
            "recorded_union": table,
            "rows": rows,
            "goal": ttft.goal(rows),
            "published": [asdict(p) for p in ttft.PUBLISHED],
        },
    )
    print(md)


if __name__ == "__main__":
    main()
