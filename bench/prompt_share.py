"""Prefill saved when a prompt parts from a cached one (the row-invariant forward's
any-length resume): time to first token and prompt tokens computed, with the prompt cache
resuming where a prompt leaves a cached one ("parts") against the exact-prefix rule before
it ("prefix": the longest cached prefix, which for a prompt that leaves a cached one
inside it is that one's last chunk boundary) and no cache, side by side in one process.

    OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python bench/prompt_share.py \
        --out bench/results/cpu/prompt_share

Cases (`--cases`), each `--requests` prompts after one that fills the cache:
  shared    requests with one `--system`-token system prompt and their own `--user`-token
            message (sub-agents, parallel tool calls, several users of one assistant);
  rewrite   a conversation's next turn whose template rewrites the end of the last one
            (a chat template that renders the generation prompt's empty think block, or
            a reasoning turn, differently in history): the first turn's prompt less its
            last `--rewrite` tokens, then `--reply` + `--user` new tokens;
  answer    a conversation's next turn: the first turn's prompt, its `--answer`-token
            answer, `--user` new tokens (one request a round), also under "idle": `psr
            serve`'s idle prefill of the finished answer (psr.serve.idle, one chunk at a
            time through generate) run between the turns, untimed (the user's reading
            and typing time).
Each request is `generate(prompt, max_new_tokens=1)` (the prefill and the first token),
greedy; the configurations alternate per round (`--rounds`), each with a fresh cache
filled by the same first prompt, and their first tokens must agree. The model: `--model`
(a GGUF file or checkpoint folder), else the embedded model with its context raised to
`--context` (bench/serve_cache.py's copy); `psr.load`'s defaults at `--threads`, the
row-invariant forward on (as `psr serve` turns it on with its prompt cache), prefill chunk
`--chunk`. Prompts: windows of the embedded model's held-out text (its tokenizer: the
synthetic GGUF files of bench/llamacpp_side.py carry it). Writes prompt_share.md / .json
(median per configuration and case).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

from common import write_json  # noqa: E402
from serve_cache import _model_copy  # noqa: E402

CONFIGS = ("parts", "prefix", "none")
ANSWER_CONFIGS = ("idle", *CONFIGS)


def _cases(ids: list[int], a: argparse.Namespace) -> dict[str, tuple[list[int], list[list[int]]]]:
    """case -> (the prompt that fills the cache, the requests after it)."""
    system, user = ids[: a.system], ids[a.system :]
    tail = [user[i * a.user : (i + 1) * a.user] for i in range(a.requests + 1)]
    shared = ([*system, *tail[0]], [[*system, *t] for t in tail[1:]])
    first = ids[: a.system + a.user]
    rest = ids[a.system + a.user :]
    new = a.reply + a.user
    turns = [[*first[: -a.rewrite], *rest[i * new : (i + 1) * new]] for i in range(a.requests)]
    answer = (first, [[*first, *rest[: a.answer + a.user]]])  # its answer, then new text
    every = {"shared": shared, "rewrite": (first, turns), "answer": answer}
    return {c: every[c] for c in a.cases}


def _idle(model: Any, cache: Any, fill: list[int], ask: list[int], answer: int) -> None:
    """psr serve's idle prefill of the first turn's answer (ask's next `answer` tokens)."""
    from psr.serve.idle import IdlePrefill

    idle = IdlePrefill()
    idle.note(model, fill, ask[len(fill) : len(fill) + answer], cache)
    while idle:
        idle.solo_step(model, cache)


def _run(
    model: Any, config: str, fill: list[int], asks: list[list[int]], answer: int
) -> list[dict]:
    """The requests after `fill` under `config`: time to first token, cached tokens."""
    import torch

    from psr.runtime.chunked import PromptCache

    cache = None if config == "none" else PromptCache(1 << 31)
    if cache is not None and config == "prefix":  # the exact-prefix rule only
        cache._shared = lambda config, ids, best, key: (best, key)  # type: ignore[method-assign]
    model.generate(torch.tensor([fill]), max_new_tokens=1, prompt_cache=cache)
    out = []
    for ask in asks:
        if config == "idle":
            _idle(model, cache, fill, ask, answer)
        t = time.perf_counter()
        tok = model.generate(torch.tensor([ask]), max_new_tokens=1, prompt_cache=cache)
        out.append({"ttft_s": time.perf_counter() - t, "token": int(tok[0, -1]),
                    "cached": 0 if cache is None else cache.last_cached})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", type=int, default=700, help="shared prompt tokens")
    ap.add_argument("--user", type=int, default=40, help="each request's own tokens")
    ap.add_argument("--reply", type=int, default=60, help="rewrite: the answer's tokens")
    ap.add_argument("--answer", type=int, default=200, help="answer: the answer's tokens")
    ap.add_argument("--rewrite", type=int, default=6, help="rewrite: last-turn tokens changed")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None, help="default: the embedded model")
    ap.add_argument("--cases", type=lambda t: t.split(","), default=["shared", "rewrite", "answer"])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import torch

    import psr

    torch.set_num_threads(a.threads)
    path = a.model or _model_copy(a.context, Path(tempfile.mkdtemp(prefix="psr-share-")))
    model = psr.load(path, threads=a.threads, progress=False)
    model.set_row_invariant(True)
    model.set_prefill_chunk(a.chunk)
    text = (Path(psr.DEFAULT_MODEL) / "heldout.txt").read_text()
    ids = model.tokenizer(text, add_special_tokens=False)
    cases = _cases(ids["input_ids"], a)
    model.generate(torch.tensor([cases["shared"][0][:64]]), max_new_tokens=1)  # warm-up
    configs = {c: ANSWER_CONFIGS if c == "answer" else CONFIGS for c in cases}
    runs: dict[str, dict[str, list[list[dict]]]] = {c: {k: [] for k in configs[c]} for c in cases}
    for r in range(a.rounds):
        for case, (fill, asks) in cases.items():
            order = configs[case] if r % 2 == 0 else configs[case][::-1]
            for config in order:
                got = _run(model, config, fill, asks, a.answer)
                runs[case][config].append(got)
                print(f"round {r} {case} {config}: {[round(x['ttft_s'], 3) for x in got]}")
    command = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} PYTHONPATH=python " + (
        shlex.join(["python", *sys.argv])
    )

    def per_round(case: str, config: str, base: str) -> list[float]:
        pairs = zip(runs[case][config], runs[case][base], strict=True)
        return [statistics.median(p["ttft_s"] / q["ttft_s"] for p, q in zip(rp, rq, strict=True))
                for rp, rq in pairs]  # fmt: skip

    rows = []
    for case in cases:
        first = [x["token"] for x in runs[case]["none"][0]]
        for config in configs[case]:
            got = runs[case][config]
            rows.append({
                "case": case, "config": config, "prompt": len(cases[case][1][0]),
                "cached": got[0][0]["cached"],
                "ttft_s": statistics.median(x["ttft_s"] for run in got for x in run),
                "over_prefix": per_round(case, config, "prefix"),
                "over_parts": per_round(case, config, "parts"),
                "tokens_agree": all([x["token"] for x in run] == first for run in got),
            })  # fmt: skip
    doc = {"command": command, "args": vars(a) | {"out": str(a.out), "model": str(path)},
           "rows": rows, "runs": runs, "load": os.getloadavg()}  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "prompt_share.json", doc)
    lines = [
        f"`{command}`",
        "",
        f"Model: `{a.model.name if a.model else f'embedded (context {a.context})'}`, "
        f"{a.threads} thread(s), prefill chunk {a.chunk}, {a.rounds} rounds "
        f"of {a.requests} requests (answer: 1) after the one that fills the cache.",
        "",
        "| case | configuration | prompt tokens | cached tokens | time to first token, median s "
        "| / prefix per round | / parts per round | first tokens agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['config']} | {row['prompt']} | {row['cached']} "
            f"| {row['ttft_s']:.3f} | {', '.join(f'{x:.2f}x' for x in row['over_prefix'])} "
            f"| {', '.join(f'{x:.2f}x' for x in row['over_parts'])} "
            f"| {'yes' if row['tokens_agree'] else 'NO'} |"
        )
    lines.append(f"\nLoad average at the end: {os.getloadavg()[0]:.2f}.")
    (a.out / "prompt_share.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
