"""Prefill tok/s before (another tree's psr, e.g. main) and after (this tree), side by side
in one run, and a two-turn conversation's time to first token with and without the
prompt cache (issue 36), on this CPU at one thread.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefill.py --before /work/main \
        --out bench/results/prefill

Models: the embedded one (bf16 rows, context 512) and a GGUF written by tests/gguf_files.py
(OLMoE-shaped, H 1024 x F 512, 64 experts top-8, 4 layers, Q4_K_M-like types: Q4_K gate and
up, Q6_K down, Q8_0 dense; context 4096). Each prefill figure is the best of `--reps`
timed `generate(prompt, max_new_tokens=1)` calls (prefill and the first token) in a worker
process with the tree's python/ on PYTHONPATH, before and after alternating per round,
in tokens per second of the process's CPU time (the machine is shared; wall time beside).
Each tree's figure with its default forward; this tree's also with the row-invariant CPU
forward (`set_row_invariant`, what `psr serve` runs with its prompt cache).
The conversation (this tree): a 2000-token first turn, then a second turn extending it by
100 tokens, each generating 16 greedy tokens; the second turn's time to its first token
without the cache and with it (resumed from the longest cached prefix: the first turn's
end with the row-invariant forward, else its last chunk boundary), and its tokens
compared.
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
DECODE = 32  # decode tokens timed


def _load(path: str, chunk: int | None, rows: int = 0):  # type: ignore[no-untyped-def]
    """The model; `rows`: with the row-invariant CPU forward (a tree that has it)."""
    import psr

    model = psr.load(path, "exact", 1.0, device="cpu", progress=False)
    if chunk is not None:
        model.set_prefill_chunk(chunk)
    if hasattr(model, "set_row_invariant"):
        model.set_row_invariant(bool(rows))
    return model


def _ids(n: int, vocab: int, seed: int):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


def _timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall seconds, this process's CPU seconds) of fn(): on a machine shared with other
    work the CPU time is the figure that compares (one thread: it is the work done)."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def worker_prefill(path: str, reps: int, rows: int = 0) -> dict:
    """Best prefill tok/s of `reps` runs of a PROMPT-token prompt, and decode tok/s (DECODE
    greedy tokens after a 32-token prompt, less that prompt's prefill and first token):
    any psr version (`rows`: row-invariant forward on, where the tree has it)."""
    import torch

    torch.set_num_threads(1)
    model = _load(path, None, rows)
    ids = _ids(PROMPT, model.config.vocab_size, 0)
    model.generate(ids[:, :32], max_new_tokens=1)  # warm-up
    runs = [_timed(lambda: model.generate(ids, max_new_tokens=1)) for _ in range(reps)]
    wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
    short = [_timed(lambda: model.generate(ids[:, :32], max_new_tokens=1)) for _ in range(reps)]
    long = [
        _timed(lambda: model.generate(ids[:, :32], max_new_tokens=DECODE + 1)) for _ in range(reps)
    ]
    dec = [min(r[i] for r in long) - min(r[i] for r in short) for i in (0, 1)]
    return {
        "tok_s": PROMPT / cpu, "wall_tok_s": PROMPT / wall, "cpu_s": cpu, "wall_s": wall,
        "decode_tok_s": DECODE / dec[1], "decode_wall_tok_s": DECODE / dec[0],
        "row_invariant": bool(getattr(model, "row_invariant", False)),
    }  # fmt: skip


class _FirstToken:
    """A streamer that notes when the first new token arrives (put #2: #1 is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.t0, self.c0 = 0, time.perf_counter(), time.process_time()
        self.ttft: tuple[float, float] | None = None

    def put(self, _value: object) -> None:
        self.puts += 1
        if self.puts == 2:
            self.ttft = (time.perf_counter() - self.t0, time.process_time() - self.c0)

    def end(self) -> None:
        pass


def worker_conversation(path: str, chunk: int, rows: int) -> dict:
    """Second-turn TTFT with and without the prompt cache, and its 16 tokens compared
    (this tree only; `rows`: the row-invariant forward, any-length resume)."""
    import torch

    from psr.runtime.chunked import PromptCache

    torch.set_num_threads(1)
    model = _load(path, chunk, rows)
    ids = _ids(FIRST + EXTRA, model.config.vocab_size, 1)
    first, second = ids[:, :FIRST], ids
    model.generate(ids[:, :32], max_new_tokens=1)  # warm-up
    out: dict = {"chunk": chunk, "rows": bool(rows), "first_tokens": FIRST}

    def turn(ids: torch.Tensor, cache: PromptCache | None) -> tuple[torch.Tensor, tuple]:
        s = _FirstToken()
        toks = model.generate(ids, max_new_tokens=16, prompt_cache=cache, streamer=s)
        assert s.ttft is not None
        return toks, s.ttft

    cache = PromptCache(8 << 30)
    _, t1 = turn(first, cache)
    with_cache, hit = turn(second, cache)
    cached = cache.last_cached
    without, cold = turn(second, None)
    for i, kind in enumerate(("wall", "cpu")):
        out |= {
            f"first_turn_{kind}_s": t1[i],
            f"second_no_cache_{kind}_s": cold[i],
            f"second_cache_{kind}_s": hit[i],
            f"second_cache_over_first_{kind}": hit[i] / t1[i],
        }
    out |= {"cached_tokens": cached, "identical_tokens": bool(torch.equal(with_cache, without))}
    return out


def worker_identity(path: str, length: int, rows: int) -> dict:
    """Across prefill chunks: the same tokens? logits bit-identical? (this tree only)"""
    import torch

    torch.set_num_threads(1)
    model = _load(path, None, rows)
    ids = _ids(length, model.config.vocab_size, 2)
    out: dict = {}
    base = None
    seen: list = []

    def keep(_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen.append(scores.clone())
        return scores

    for chunk in (length, 64, 16, 5):
        model.set_prefill_chunk(chunk)
        seen.clear()
        toks = model.generate(ids, max_new_tokens=8, logits_processor=keep)
        got = (toks, torch.stack(seen))
        base = base or got
        out[str(chunk)] = {
            "tokens_equal": bool(torch.equal(got[0], base[0])),
            "logits_bit_identical": bool(torch.equal(got[1], base[1])),
            "max_abs_diff": float((got[1] - base[1]).abs().max()),
        }
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
    ap.add_argument("--reps", type=int, default=2, help="timed prefills per worker")
    ap.add_argument("--chunks", default="128,512", help="conversation: prefill chunks")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        kind, path, *rest = a.worker
        fns = {"prefill": worker_prefill, "conversation": worker_conversation}
        fn = fns.get(kind, worker_identity)
        print(json.dumps(fn(path, *map(int, rest))))  # type: ignore[operator]
        return
    from psr.models import DEFAULT_MODEL

    tmp = Path(tempfile.mkdtemp())
    gguf = tmp / "olmoe-q4km.gguf"
    write_gguf(gguf)
    models = {"embedded (bf16 rows)": DEFAULT_MODEL, "GGUF Q4_K_M-like": str(gguf)}
    # (tree, row-invariant forward): after = this tree with it, as the prompt cache runs
    trees = {"after": (ROOT, 1), "after, rows off": (ROOT, 0)}
    trees |= {"before": (a.before, 0)} if a.before else {}
    rows: dict = {}
    for r in range(a.rounds):
        for label, path in models.items():
            for name in trees if r % 2 == 0 else reversed(list(trees)):
                tree, on = trees[name]
                got = run(tree, "prefill", path, str(a.reps), str(on))
                rows.setdefault(label, {}).setdefault(name, []).append(got)
                print(f"round {r} {label} {name}: {got}", flush=True)
    conv = []
    for c, on in [(c, 1) for c in a.chunks.split(",")] + [(a.chunks.split(",")[-1], 0)]:
        conv.append(run(ROOT, "conversation", str(gguf), c, str(on)))
        print(conv[-1], flush=True)
    ident = {label: run(ROOT, "identity", path, str(PROMPT), "1") for label, path in models.items()}
    lines = [
        "| model | measure | before tok/s (CPU time) | after: row-invariant | after / before "
        "| after: rows off | rows off / before | before / after / rows off (wall) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    measures = {f"prefill {PROMPT}": "tok_s", f"decode {DECODE}": "decode_tok_s"}
    nan = float("nan")
    for label, by in rows.items():
        for measure, name in measures.items():
            wname = name.replace("tok_s", "wall_tok_s")
            best = {k: max(r.get(name, nan) for r in v) for k, v in by.items()}
            wall = {k: max(r.get(wname, nan) for r in v) for k, v in by.items()}
            b, on, off = best.get("before", nan), best["after"], best["after, rows off"]
            w = [wall.get(k, nan) for k in ("before", "after", "after, rows off")]
            lines.append(
                f"| {label} | {measure} | {b:.1f} | {on:.1f} | {on / b:.2f}x | {off:.1f} | "
                f"{off / b:.2f}x | {w[0]:.1f} / {w[1]:.1f} / {w[2]:.1f} |"
            )
    lines += [
        "",
        "| chunk | forward | first turn (2000) TTFT s | second (2100) no cache s "
        "| second with cache s | cached tokens | with cache / first turn | identical tokens (16) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in conv:
        kind = "row-invariant" if c["rows"] else "chunked"
        lines.append(
            f"| {c['chunk']} | {kind} | "
            f"{c['first_turn_cpu_s']:.2f} ({c['first_turn_wall_s']:.2f}) | "
            f"{c['second_no_cache_cpu_s']:.2f} ({c['second_no_cache_wall_s']:.2f}) | "
            f"{c['second_cache_cpu_s']:.2f} ({c['second_cache_wall_s']:.2f}) | "
            f"{c['cached_tokens']} | {c['second_cache_over_first_cpu']:.1%} "
            f"({c['second_cache_over_first_wall']:.1%}) | {c['identical_tokens']} |"
        )
    lines.append("\n(seconds of CPU time, wall time in parentheses)")
    lines += [
        "",
        f"Across prefill chunks, row-invariant forward ({PROMPT}-token prompt, 8 new tokens; "
        "against one chunk):",
        "",
        "| model | chunk | same tokens | logits bit-identical | max abs logit diff |",
        "|---|---|---|---|---|",
    ]
    for label, by in ident.items():
        for chunk, r in by.items():
            lines.append(
                f"| {label} | {chunk} | {r['tokens_equal']} | {r['logits_bit_identical']} "
                f"| {r['max_abs_diff']:.3g} |"
            )
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "prefill.json").write_text(
            json.dumps({"prefill": rows, "conversation": conv, "chunks": ident}, indent=1) + "\n"
        )
        (a.out / "README.md").write_text(
            "# Prefill before / after and the prompt cache (issue 36)\n\n"
            "    OMP_NUM_THREADS=1 .venv/bin/python bench/prefill.py "
            f"--before {a.before} --rounds {a.rounds} --reps {a.reps} --chunks {a.chunks} "
            f"--out {a.out}\n\n"
            "(one thread; before = that tree's psr, after = this one; tok/s the best "
            "of the rounds, from the process's CPU time (the machine is shared: wall time "
            "beside it); module docstring of bench/prefill.py for the models)\n\n" + table + "\n"
        )


if __name__ == "__main__":
    main()
