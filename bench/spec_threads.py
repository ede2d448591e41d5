"""Speculative decoding's verify blocks with torch's own ops on one thread (as a model
decoding on psr's kernels runs them) against torch's threads kept, in one process,
alternating round by round.

    OMP_NUM_THREADS=2 PYTHONPATH=python .venv/bin/python bench/spec_threads.py \\
        --model /work/cache/gguf/olmoe-L16-Q4_K_M.gguf --threads 2 --rounds 3

`psr.load(FILE, "exact", 1.0, device="cpu", threads=N)` with a drafter that drafts the last
token and 1 (mostly rejected: verify blocks of 3 tokens, about one token each, so the
figure is the verify step's speed), verify="cpu"; per round and configuration, `generate`
of 33 tokens from a 16-token prompt, tok/s of wall time over the 32 after the first; the
tokens of the two configurations compared.
"""

from __future__ import annotations

import argparse
import time

import torch

import psr


class Stubborn:
    """Drafts the last token and 1."""

    kind, block, memory_bytes = "stubborn", 2, 0

    def reset(self) -> None:
        pass

    def propose(self, tokens: list[int], hidden: object) -> list[int]:
        return [tokens[-1], 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = psr.load(a.model, "exact", 1.0, device="cpu", threads=a.threads, progress=False)
    m.set_speculative(Stubborn(), verify="cpu")
    prompt = list(range(3, 19))
    on_kernels = m.decodes_on_kernels
    tok_s: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    m.generate(prompt, max_new_tokens=8)  # warm-up
    for r in range(a.rounds):
        for one in (True, False) if r % 2 == 0 else (False, True):
            m.decodes_on_kernels = lambda one=one: one and on_kernels()  # type: ignore[method-assign]
            t0 = time.perf_counter()
            out = m.generate(prompt, max_new_tokens=33)
            tok_s[one].append(32 / (time.perf_counter() - t0))
            tokens[one] = out[0].tolist()
        print(f"round {r}: verify on one torch thread {tok_s[True][-1]:.2f} tok/s, torch's "
              f"threads kept {tok_s[False][-1]:.2f} tok/s, "
              f"ratio {tok_s[True][-1] / tok_s[False][-1]:.2f}", flush=True)  # fmt: skip
    print(f"same tokens: {tokens[True] == tokens[False]}; blocks {m.spec_stats.blocks}")


if __name__ == "__main__":
    main()
