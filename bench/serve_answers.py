"""A conversation's next turn through `psr serve`, with the server's idle prefill of the
finished answer (psr.serve.idle) on and off: time to first token of the second turn and
the prompt tokens it resumed, the same model object and server code, alternating.

    OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python bench/serve_answers.py \
        --model /work/cache/gguf/olmoe-L16-Q4_K_M.gguf --out bench/results/serve/answers

Per round and configuration: a fresh server (the Engine and FastAPI app of `psr serve`,
`--parallel`, a 1 GiB prompt cache, `--cache-answers` or not) in this process; a first
turn of `--prompt` tokens answered with `--answer` greedy tokens (ignore_eos), then the
user's think time (`--think` s, the same for both configurations; the idle prefill
counter read at its end), then the second turn (the first
turn's prompt, the answer's tokens, `--user` new tokens), streamed. The model: `--model`,
else the embedded model with its context raised to 4096 (bench/serve_cache.py's copy),
`psr.load`'s defaults at one thread, the row-invariant forward on (as `psr serve` with its
cache). Prompts: the embedded model's held-out text.
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
from serve_cache import _model_copy, _Server, _turn  # noqa: E402


def _idle_tokens(url: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("psr_idle_prefill_tokens_total"):
            return float(line.split()[-1])
    return 0.0


def _think(seconds: float) -> float:
    """The user's reading and typing time: the same for both configurations."""
    time.sleep(seconds)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--prompt", type=int, default=700)
    ap.add_argument("--answer", type=int, default=100)
    ap.add_argument("--user", type=int, default=40)
    ap.add_argument("--think", type=float, default=8.0, help="seconds between the turns")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import psr

    path = a.model or _model_copy(4096, Path(tempfile.mkdtemp(prefix="psr-answers-")))
    model = psr.load(path, threads=1, progress=False)
    model.set_row_invariant(True)
    text = (Path(psr.DEFAULT_MODEL) / "heldout.txt").read_text()
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    first, user = ids[: a.prompt], ids[a.prompt : a.prompt + a.user]
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for answers in (True, False) if r % 2 == 0 else (False, True):
            s = _Server(model, a.parallel, 1 << 30, cache_answers=answers)
            try:
                one = _turn(s.url, first, a.answer)
                think = _think(a.think)
                idle = _idle_tokens(s.url)
                two = _turn(s.url, [*first, *one["tokens"], *user], a.answer)
            finally:
                s.close()
            runs.append({"round": r, "answers": answers, "first": one, "second": two,
                         "think_s": think, "idle_tokens": idle})  # fmt: skip
            print(f"round {r} cache_answers={answers}: turn 2 TTFT {two['ttft_s']:.2f} s, "
                  f"cached {two['cached']}, idle prefill {idle:.0f} tokens")  # fmt: skip
    command = "OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python bench/serve_answers.py " + (
        shlex.join(sys.argv[1:])
    )
    same = all(x["second"]["tokens"] == runs[0]["second"]["tokens"] for x in runs)
    lines = [
        f"`{command}`",
        "",
        f"Model `{path.name if a.model else 'embedded (context 4096)'}`, psr serve "
        f"--parallel {a.parallel}, one thread; first turn {a.prompt} tokens answered with "
        f"{a.answer}, second turn + {a.user} new tokens; load average {os.getloadavg()[0]:.2f} "
        "at the end.",
        "",
        "| round | --cache-answers | think s | idle prefill tokens | turn 2 cached tokens "
        "| turn 2 time to first token, s | on / off |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in range(a.rounds):
        on, off = (next(x for x in runs if x["round"] == r and x["answers"] is c)
                   for c in (True, False))  # fmt: skip
        ratio = on["second"]["ttft_s"] / off["second"]["ttft_s"]
        for x in (on, off):
            lines.append(
                f"| {r} | {'on' if x['answers'] else 'off'} | {x['think_s']:.1f} "
                f"| {x['idle_tokens']:.0f} | {x['second']['cached']} "
                f"| {x['second']['ttft_s']:.2f} | {f'{ratio:.2f}x' if x is on else ''} |"
            )
    med = {c: statistics.median(x["second"]["ttft_s"] for x in runs if x["answers"] is c)
           for c in (True, False)}  # fmt: skip
    lines += ["", f"Median turn 2 time to first token: on {med[True]:.2f} s, off "
              f"{med[False]:.2f} s. Second-turn tokens identical in every run: "
              f"{'yes' if same else 'NO'}."]  # fmt: skip
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "serve_answers.md").write_text(md)
        write_json(a.out / "serve_answers.json", {"command": command, "args": vars(a) | {
            "out": str(a.out), "model": str(path)}, "identical": same, "runs": runs})  # fmt: skip


if __name__ == "__main__":
    main()
