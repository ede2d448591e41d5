"""Prefill tok/s before (another tree's psr, e.g. main) and after (this tree), side by side
in one run, and a two-turn conversation's time to first token with and without the
prompt cache (issue 36), on this CPU at one thread.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefill.py --before /work/main \
        --out bench/results/prefill

Models: the embedded one (bf16 rows, context 512) and a GGUF written by tests/gguf_files.py
(OLMoE-shaped, H 1024 x F 512, 64 experts top-8, 4 layers, Q4_K_M-like types: Q4_K gate and
up, Q6_K down, Q8_0 dense; context 4096). Each figure is the best of `--reps` timed
`generate(prompt, max_new_tokens=1)` calls (prefill and the first token) in a worker
process with the tree's python/ on PYTHONPATH, before and after alternating per round.
The conversation: a 2000-token first turn, then a second turn extending it by 100 tokens,
its time to first token without the cache and with it (resumed from the longest cached
boundary), and the second turn's 16 greedy tokens with and without the cache compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 504  # the embedded model's context is 512
FIRST, EXTRA = 2000, 100


def _load(path: str, chunk: int | None):  # type: ignore[no-untyped-def]
    import psr

    model = psr.load(path, "exact", 1.0, device="cpu", progress=False)
    if chunk is not None:
        model.set_prefill_chunk(chunk)
    return model


def _ids(n: int, vocab: int, seed: int):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def worker_prefill(path: str, reps: int) -> dict:
    """Best prefill tok/s of `reps` runs of a PROMPT-token prompt (any psr version)."""
    import torch

    torch.set_num_threads(1)
    model = _load(path, None)
    ids = _ids(PROMPT, model.config.vocab_size, 0)
    model.generate(ids[:, :32], max_new_tokens=1)  # warm-up
    best = min(_timed(lambda: model.generate(ids, max_new_tokens=1)) for _ in range(reps))
    return {"tok_s": PROMPT / best, "s": best}


def worker_conversation(path: str, chunk: int, reps: int) -> dict:
    """Second-turn TTFT with and without the prompt cache (this tree only)."""
    import torch

    from psr.runtime.chunked import PromptCache

    torch.set_num_threads(1)
    model = _load(path, chunk)
    ids = _ids(FIRST + EXTRA, model.config.vocab_size, 1)
    first, second = ids[:, :FIRST], ids
    model.generate(ids[:, :32], max_new_tokens=1)  # warm-up
    out: dict = {"chunk": chunk, "first_tokens": FIRST, "second_tokens": FIRST + EXTRA}
    t1, hit, cold, cached = [], [], [], 0

    def ttft(ids: torch.Tensor, cache: PromptCache | None) -> float:
        return _timed(lambda: model.generate(ids, max_new_tokens=1, prompt_cache=cache))

    for _ in range(reps):
        cache = PromptCache(8 << 30)
        t1.append(ttft(first, cache))
        hit.append(ttft(second, cache))
        cached = cache.last_cached
        cold.append(ttft(second, None))
    cache = PromptCache(8 << 30)
    model.generate(first, max_new_tokens=1, prompt_cache=cache)
    with_cache = model.generate(second, max_new_tokens=16, prompt_cache=cache)
    without = model.generate(second, max_new_tokens=16)
    out |= {
        "first_turn_s": min(t1),
        "second_no_cache_s": min(cold),
        "second_cache_s": min(hit),
        "cached_tokens": cached,
        "identical_tokens": bool(torch.equal(with_cache, without)),
    }
    out["second_cache_over_first"] = out["second_cache_s"] / out["first_turn_s"]
    return out


def write_gguf(path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_files import gguf_tiny_model
    from gguf_files import write_gguf as write

    model = gguf_tiny_model("olmoe", hidden=1024, ffn=512, layers=4, experts=64, vocab=2112)
    model.config.num_experts_per_tok = 8
    model.config.max_position_embeddings = 4096
    types = {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K", "dense": "Q8_0"}
    write(model, path, types)


def run(tree: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'python'}:{tree}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} ({tree}) failed:\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, default=None, help="the tree to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--chunks", default="128,512", help="conversation: prefill chunks")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        kind, path, *rest = a.worker
        fn = worker_prefill if kind == "prefill" else worker_conversation
        print(json.dumps(fn(path, *map(int, rest))))
        return
    from psr.models import DEFAULT_MODEL

    tmp = Path(tempfile.mkdtemp())
    gguf = tmp / "olmoe-q4km.gguf"
    write_gguf(gguf)
    models = {"embedded (bf16 rows)": DEFAULT_MODEL, "GGUF Q4_K_M-like": str(gguf)}
    trees = {"after": ROOT} | ({"before": a.before} if a.before else {})
    rows: dict = {}
    for r in range(a.rounds):
        for label, path in models.items():
            for name in trees if r % 2 == 0 else reversed(list(trees)):
                got = run(trees[name], "prefill", path, str(a.reps))
                rows.setdefault(label, {}).setdefault(name, []).append(got["tok_s"])
                print(f"round {r} {label} {name}: {got['tok_s']:.1f} tok/s", flush=True)
    conv = [run(ROOT, "conversation", str(gguf), c, str(a.reps)) for c in a.chunks.split(",")]
    lines = [
        "| model | prompt | before tok/s | after tok/s | after / before |",
        "|---|---|---|---|---|",
    ]
    for label, by in rows.items():
        after = max(by["after"])
        before = max(by["before"]) if "before" in by else float("nan")
        lines.append(f"| {label} | {PROMPT} | {before:.1f} | {after:.1f} | {after / before:.2f}x |")
    lines += [
        "",
        "| chunk | first turn (2000) TTFT s | second (2100) no cache s | second with cache s "
        "| cached tokens | with cache / first turn | identical tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in conv:
        lines.append(
            f"| {c['chunk']} | {c['first_turn_s']:.2f} | {c['second_no_cache_s']:.2f} | "
            f"{c['second_cache_s']:.2f} | {c['cached_tokens']} | "
            f"{c['second_cache_over_first']:.1%} | {c['identical_tokens']} |"
        )
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "prefill.json").write_text(
            json.dumps({"prefill": rows, "conversation": conv}, indent=1) + "\n"
        )
        (a.out / "README.md").write_text(
            "# Prefill before / after and the prompt cache (issue 36)\n\n"
            "    OMP_NUM_THREADS=1 .venv/bin/python bench/prefill.py "
            f"--before {a.before} --rounds {a.rounds} --reps {a.reps} --chunks {a.chunks} "
            f"--out {a.out}\n\n"
            "(one thread; before = that tree's psr, after = this one; tok/s the best "
            "of the rounds; module docstring of bench/prefill.py for the models)\n\n" + table + "\n"
        )


if __name__ == "__main__":
    main()
