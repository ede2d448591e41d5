"""Batched decode (issue 38): throughput against sequential runs, and determinism.

    OMP_NUM_THREADS=1 python bench/batch.py --threads 1 --out bench/results/batch

throughput   the embedded model on the CPU backend, experts on the CPU (experts_on="cpu",
             psr at its tuned point, residency 0.5), `--threads` CPU threads: for b in
             --batches, b prompts (--prompt-tokens each, from the held-out text) decoded
             --tokens new tokens each, side by side in one run, --repeats times
             (interleaved; ratios within a repeat, their median): sequentially with
             `generate`, with `generate_batch` (batch-invariant, the default) and with
             the plain batched path
             (batch_invariant=False). Aggregate tok/s = b x tokens / wall time (prefill
             included); per-request ms/token: sequential, the mean of each run's own wall
             time / tokens; batched, the batch's wall time / tokens (every request lives
             for all of it). Differing tokens: against the sequential runs.
determinism  --det-prompts prompts x --det-tokens tokens decoded alone, then inside batches
             of each --det-batches size with random co-runners (the prompts shuffled),
             random join times (each prompt's earliest step uniform in [0, tokens]) and
             random copy delays (PSR_COPY_DELAY-style, up to --delay-us), the members read
             through the shared slab (as on CUDA: copies, runs of rows, spills) with the
             default placement: the count of tokens that differ from the solo runs.
Writes batch.json and batch.md (rewritten after each part).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

import psr
from psr.models.embedded import heldout_text, tokenizer_of
from psr.runtime.batch import BatchDecoder


def prompts_from_text(n: int, length: int, seed: int) -> list[list[int]]:
    tok = tokenizer_of(psr.DEFAULT_MODEL)
    ids = tok(heldout_text(psr.DEFAULT_MODEL))["input_ids"]
    rng = random.Random(seed)
    starts = rng.sample(range(len(ids) - length), n)
    return [ids[s : s + length] for s in starts]


def _differ(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def _timed_runs(model: psr.OffloadedModel, ps: list[list[int]], N: int) -> dict[str, Any]:
    """One repeat at one b: the sequential runs, then both batched paths, back to back."""
    times, solo = [], []
    for p in ps:
        t = time.perf_counter()
        solo.append(model.generate(p, max_new_tokens=N)[0, len(p) :].tolist())
        times.append(time.perf_counter() - t)
    r: dict[str, Any] = {"sequential": sum(times), "per_request": times}
    for name, inv in (("batched", True), ("plain", False)):
        t = time.perf_counter()
        got = model.generate_batch(ps, N, batch_invariant=inv)
        r[name] = time.perf_counter() - t
        r[f"{name}_differ"] = _differ(got, solo)
    return r


def throughput(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Repeats interleave the batch sizes and, inside each, the three ways (a loaded
    machine's load drifts): the ratios are taken within a repeat, their median reported,
    and the times are each way's fastest repeat."""
    model = psr.load(psr.DEFAULT_MODEL, "psr", 0.5, experts_on="cpu", threads=args.threads,
                     progress=False)  # fmt: skip
    prompts = prompts_from_text(max(args.batches), args.prompt_tokens, 1)
    N = args.tokens
    model.generate(prompts[0], max_new_tokens=4)  # warm-up
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in args.batches}
    for _ in range(args.repeats):
        for b in args.batches:
            runs[b].append(_timed_runs(model, prompts[:b], N))
    rows = []
    for b, rs in runs.items():
        best = {k: min(r[k] for r in rs) for k in ("sequential", "batched", "plain")}
        fastest = min(rs, key=lambda r: r["sequential"])["per_request"]
        rows.append({
            "b": b,
            "repeats": len(rs),
            "sequential_tok_s": b * N / best["sequential"],
            "batched_tok_s": b * N / best["batched"],
            "plain_tok_s": b * N / best["plain"],
            "speedup_median": statistics.median(r["sequential"] / r["batched"] for r in rs),
            "plain_over_invariant_median": statistics.median(r["batched"] / r["plain"] for r in rs),
            "solo_ms_per_token": 1000 * sum(fastest) / len(fastest) / N,
            "batched_ms_per_token": 1000 * best["batched"] / N,
            "plain_ms_per_token": 1000 * best["plain"] / N,
            "batched_differing_tokens": max(r["batched_differ"] for r in rs),
            "plain_differing_tokens": max(r["plain_differ"] for r in rs),
        })  # fmt: skip
        print(rows[-1], flush=True)
    out["throughput"] = rows
    out["throughput_command"] = out["command"]
    write(args, out)


def schedule(model: psr.OffloadedModel, prompts: list[list[int]], T: int, b: int,
             rng: random.Random) -> list[list[int]]:  # fmt: skip
    """Greedy decoding of `prompts` through one BatchDecoder of `b`: in a random order, each
    joining at a random step (when a place is free), leaving after T tokens."""
    order = list(range(len(prompts)))
    rng.shuffle(order)
    earliest = {j: rng.randint(0, T) for j in order}
    dec = BatchDecoder(model, b)
    which: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in prompts]
    step = 0
    while order or dec.live:
        for j in [j for j in order if earliest[j] <= step][: b - len(dec.live)]:
            order.remove(j)
            which[dec.add(prompts[j])] = j
        feed = {}
        for s, logits in dec.ready().items():
            j = which[s]
            out[j].append(int(logits.float().argmax()))
            if len(out[j]) == T:
                dec.remove(s)
            else:
                feed[s] = out[j][-1]
        dec.feed(feed)
        step += 1
    return out


def determinism(args: argparse.Namespace, out: dict[str, Any]) -> None:
    model = psr.load(psr.DEFAULT_MODEL, "psr", 0.5, threads=args.threads, progress=False)
    model.runtime.prefill_reads = "slab"  # members through the shared slab, as on CUDA
    prompts = prompts_from_text(args.det_prompts, args.prompt_tokens, 2)
    T = args.det_tokens
    t = time.perf_counter()
    solo = [model.generate(p, max_new_tokens=T)[0, len(p) :].tolist() for p in prompts]
    res: dict[str, Any] = {"prompts": len(prompts), "tokens": T, "solo_s": time.perf_counter() - t}
    out["determinism"] = res
    out["determinism_command"] = out["command"]
    rng = random.Random(3)
    for b in args.det_batches:
        model.runtime.store.set_copy_delay(args.delay_us, seed=b)
        t = time.perf_counter()
        got = schedule(model, prompts, T, b, rng)
        model.runtime.store.set_copy_delay(0)
        res[f"b{b}"] = {"differing_tokens": _differ(got, solo), "s": time.perf_counter() - t,
                        "of": len(prompts) * T}  # fmt: skip
        print(b, res[f"b{b}"], flush=True)
        write(args, out)


def write(args: argparse.Namespace, out: dict[str, Any]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "batch.json", out)
    lines = []
    if "throughput" in out:
        lines += [
            f"`{out['throughput_command']}`",
            "",
            "| b | sequential tok/s | batched tok/s | plain tok/s | batched / sequential "
            "(median ratio) | invariance cost (median invariant / plain time) | solo "
            "ms/token | batched ms/token | plain ms/token | differing tokens (batched / plain) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in out["throughput"]:
            lines.append(
                f"| {r['b']} | {r['sequential_tok_s']:.1f} | {r['batched_tok_s']:.1f} | "
                f"{r['plain_tok_s']:.1f} | {r['speedup_median']:.2f}x | "
                f"{r['plain_over_invariant_median']:.2f}x | {r['solo_ms_per_token']:.1f} | "
                f"{r['batched_ms_per_token']:.1f} | {r['plain_ms_per_token']:.1f} | "
                f"{r['batched_differing_tokens']} / {r['plain_differing_tokens']} |"
            )
    if "determinism" in out:
        d = out["determinism"]
        lines += ["", f"`{out['determinism_command']}`", "",
                  f"Determinism: {d['prompts']} prompts x {d['tokens']} tokens", "",
                  "| b | differing tokens | of | seconds |", "|---|---|---|---|"]  # fmt: skip
        for k, v in d.items():
            if k.startswith("b"):
                lines.append(f"| {k[1:]} | {v['differing_tokens']} | {v['of']} | {v['s']:.0f} |")
    (args.out / "batch.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--det-prompts", type=int, default=64)
    ap.add_argument("--det-tokens", type=int, default=128)
    ap.add_argument("--det-batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2, 4, 8])  # fmt: skip
    ap.add_argument("--delay-us", type=int, default=300)
    ap.add_argument("--skip", choices=("throughput", "determinism"), default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/results/batch"))
    args = ap.parse_args()
    # Each part keeps its own command; a run of one part keeps the other's results.
    old = args.out / "batch.json"
    out: dict[str, Any] = json.loads(old.read_text()) if old.exists() else {}
    out["command"] = "OMP_NUM_THREADS=1 python bench/batch.py " + " ".join(sys.argv[1:])
    if args.skip != "throughput":
        throughput(args, out)
    if args.skip != "determinism":
        determinism(args, out)


if __name__ == "__main__":
    main()
