"""Memory the prompt cache holds for a few long prompts, with a row-invariant prompt's end
entry replacing its boundary entries (now) and keeping them all (before; each boundary
entry holds a KV buffer of its own): entries, MiB held, and the prompts' KV bytes.

    OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python bench/prompt_cache_bytes.py

The embedded model with its context raised to 2048 (bench/serve_cache.py's copy), the
row-invariant forward (psr serve's with its cache), chunk 512; `--prompts` windows of
`--tokens` tokens of its held-out text, each prefilled once (`generate`, one new token)
into one cache. "before" is the same code with `keep(any_length=False)`: entries not
cuttable, so none replaces another (what the cache did before).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

from serve_cache import _model_copy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1800)
    a = ap.parse_args()
    import torch

    import psr
    from psr.runtime import chunked

    torch.set_num_threads(1)
    path = _model_copy(2048, Path(tempfile.mkdtemp(prefix="psr-bytes-")))
    model = psr.load(path, threads=1, progress=False)
    model.set_row_invariant(True)
    text = (Path(psr.DEFAULT_MODEL) / "heldout.txt").read_text()
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [ids[i * a.tokens : (i + 1) * a.tokens] for i in range(a.prompts)]
    kv = model.memory(1)["device_kv"] * a.tokens * a.prompts / 2**20
    keep = chunked.PromptCache.keep
    print("| entries kept | entries | MiB held | KV of the prompts, MiB |\n|---|---|---|---|")
    for mode in ("before: every boundary", "now: the end replaces them"):
        cache = chunked.PromptCache(1 << 34)
        if mode.startswith("before"):
            cache.keep = lambda c, i, k, h, any_length=False, s=cache: keep(s, c, i, k, h)  # type: ignore[method-assign]
        for p in prompts:
            model.generate(p, max_new_tokens=1, prompt_cache=cache)
        print(f"| {mode} | {len(cache)} | {cache.nbytes / 2**20:.1f} | {kv:.1f} |")


if __name__ == "__main__":
    main()
