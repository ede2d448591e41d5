"""Second-turn time to first token at `psr serve --parallel 4`, with and without the prompt
cache (issues 36 item 4, 38 item 4): `--conversations` two-turn conversations at once,
each a `--prompt`-token first turn answered with `--answer` tokens, then a second turn
that extends it by `--extend` tokens (its answer and new text); greedy, through the
server's app (the Engine and the FastAPI app of `psr serve`, in this process so both
configurations run the same model object and forward), alternating the two configurations
`--rounds` times. Written as markdown and JSON with the command.

    OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python bench/serve_cache.py \
        --out bench/results/serve

The model: the embedded model (psr.DEFAULT_MODEL) with its context raised from 512 to
`--context` tokens (a copy of its folder whose config says so; RoPE takes any position:
its text beyond 512 is not what it was trained on, which changes no timing), loaded with
`psr.load`'s defaults (as `psr serve --model <it> --threads 1` loads it), the
row-invariant forward on in both configurations (`psr serve` turns it on with its prompt
cache; kept on without it so the two answer with the same forward and their tokens
compare). Prompts: windows of the model's held-out text.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

from common import write_json  # noqa: E402


def _model_copy(context: int, into: Path) -> Path:
    """The embedded model's folder with `context` as its max_position_embeddings (its
    files linked; its operating points and drafters left out: tuned for the original)."""
    from psr.models import DEFAULT_MODEL

    src = Path(DEFAULT_MODEL)
    for f in src.iterdir():
        if f.name not in ("config.json", "operating_points.json") and f.is_file():
            (into / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (into / "config.json").write_text(json.dumps(cfg))
    return into


class _Server:
    """`psr serve`'s app over an Engine (parallel slots, a prompt cache or none) served by
    uvicorn in a thread on a free loopback port."""

    def __init__(
        self, model: Any, parallel: int, cache_bytes: int, cache_answers: bool = True
    ) -> None:
        import socket

        import uvicorn

        from psr.runtime.chunked import PromptCache
        from psr.serve.app import create_app
        from psr.serve.metrics import Metrics
        from psr.serve.worker import Engine

        cache = PromptCache(cache_bytes) if cache_bytes else None
        self.engine = Engine(lambda: model, metrics=Metrics("bench"), prompt_cache=cache,
                             parallel=parallel, cache_answers=cache_answers)  # fmt: skip
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(self.engine, served_name="bench"), host="127.0.0.1",
                                port=port, log_level="warning", access_log=False)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not (self.server.started and self.engine.ready.is_set()):
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def _turn(url: str, ids: list[int], n: int) -> dict[str, Any]:
    """One streamed greedy completion: its tokens, time to first token, cached tokens."""
    import httpx

    body = {"model": "bench", "prompt": ids, "max_tokens": n, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    tokens: list[int] = []
    first, cached = None, None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                got = ch.get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter() - t0
                tokens += got
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"prompt": len(ids), "tokens": tokens, "ttft_s": first, "cached": cached,
            "total_s": time.perf_counter() - t0}  # fmt: skip


def _round(url: str, firsts: list[list[int]], news: list[list[int]], answer: int) -> list:
    """Every conversation's two turns, the first turns at once, then the second turns at
    once (a barrier between: each second turn extends its own first turn's answer)."""
    out: list[Any] = [None] * len(firsts)
    barrier = threading.Barrier(len(firsts))
    errors: list[BaseException] = []

    def conversation(i: int) -> None:
        try:
            barrier.wait()
            one = _turn(url, firsts[i], answer)
            barrier.wait()
            second = [*firsts[i], *one["tokens"], *news[i]]
            out[i] = [one, _turn(url, second, answer)]
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(len(firsts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2000, help="first turn's prompt tokens")
    ap.add_argument("--answer", type=int, default=20, help="tokens each turn answers")
    ap.add_argument("--extend", type=int, default=100, help="second turn's added tokens")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-mib", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.extend <= a.answer:
        ap.error("--extend must exceed --answer (the second turn adds the answer and new text)")

    from psr.models import load

    tmp = tempfile.TemporaryDirectory()
    path = _model_copy(a.context, Path(tmp.name))
    model = load(str(path), threads=1, progress=False)  # psr serve's defaults, one thread
    model.set_row_invariant(True)
    text = (path / "heldout.txt").read_text()
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    span = a.prompt + a.extend - a.answer
    firsts = [ids[i * span : i * span + a.prompt] for i in range(a.conversations)]
    news = [ids[i * span + a.prompt : (i + 1) * span] for i in range(a.conversations)]
    assert all(len(f) == a.prompt for f in firsts) and all(len(n) == span - a.prompt for n in news)

    load0 = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for cache in (False, True):
            s = _Server(model, a.parallel, a.cache_mib * 2**20 if cache else 0)
            try:
                t0 = time.perf_counter()
                convs = _round(s.url, firsts, news, a.answer)
                runs.append({"round": r, "cache": cache, "wall_s": time.perf_counter() - t0,
                             "conversations": convs})  # fmt: skip
            finally:
                s.close()
            print(f"round {r} cache {cache}: "
                  + ", ".join(f"{c[1]['ttft_s']:.2f}" for c in convs), flush=True)  # fmt: skip

    def turns(cache: bool, k: int) -> list[dict[str, Any]]:
        return [c[k] for run in runs if run["cache"] == cache for c in run["conversations"]]

    def tokens(run: dict[str, Any]) -> list[list[list[int]]]:
        return [[t["tokens"] for t in c] for c in run["conversations"]]

    same = all(tokens(x) == tokens(runs[0]) for x in runs)
    rows = []
    for r in range(a.rounds):
        off, on = (next(x for x in runs if x["round"] == r and x["cache"] == c) for c in (0, 1))
        t1 = [c[0]["ttft_s"] for c in off["conversations"]]
        off2 = [c[1]["ttft_s"] for c in off["conversations"]]
        on2 = [c[1]["ttft_s"] for c in on["conversations"]]
        on1 = [c[0]["ttft_s"] for c in on["conversations"]]
        rows.append((r, statistics.mean(t1), statistics.mean(on1), statistics.mean(off2),
                     statistics.mean(on2), max(off2), max(on2)))  # fmt: skip
    cached = [t["cached"] for t in turns(True, 1)]
    load = os.getloadavg()[0]
    command = "OMP_NUM_THREADS=1 PYTHONPATH=python .venv/bin/python bench/serve_cache.py " + (
        shlex.join(sys.argv[1:])
    )
    lines = [
        f"psr serve --parallel {a.parallel}: {a.conversations} concurrent two-turn "
        f"conversations, {a.prompt}-token first turns, second turns extending them by "
        f"{a.extend} tokens ({a.answer} answered + {a.extend - a.answer} new), {a.answer} "
        f"greedy tokens per turn; the embedded model at context {a.context}, policy "
        f"{model.policy.describe()}, {a.rounds} rounds alternating without / with the prompt "
        f"cache ({a.cache_mib} MiB); the shared 2-core VM's load average {load0:.1f} at the "
        f"start, {load:.1f} at the end (other people's work: the wall figures are noisy, the "
        "ratios within a round the figure to read)",
        "",
        f"    {command}",
        "",
        "| round | turn 1 TTFT, no cache (s, mean) | turn 1 TTFT, cache (s, mean) | turn 2 TTFT, "
        "no cache (s, mean) | turn 2 TTFT, cache (s, mean) | turn 2 cache / no cache | turn 2 "
        "max, no cache / cache (s) | turn 2 (cache) / turn 1 (no cache) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, t1, on1, off2, on2, mx_off, mx_on in rows:
        lines.append(
            f"| {r} | {t1:.2f} | {on1:.2f} | {off2:.2f} | {on2:.2f} | {on2 / off2:.3f}x | "
            f"{mx_off:.2f} / {mx_on:.2f} | {on2 / t1:.3f} |"
        )
    lines += [
        "",
        "TTFT: from the request sent to its first streamed token, under the other "
        f"{a.conversations - 1} conversations' concurrent turns (the batch prefills one "
        "newcomer's chunk at a time between decode steps, so a turn's TTFT includes the "
        "prefills queued before it). Cached prompt tokens of the second turns (usage."
        f"prompt_tokens_details.cached_tokens): {sorted(set(cached))} (the first turn's "
        "prompt end).",
        "Tokens identical with and without the cache, every turn of every conversation, "
        f"every round: {'yes' if same else 'NO'}.",
    ]
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "serve_cache.md").write_text(md)
        write_json(a.out / "serve_cache.json", {"command": command, "args": vars(a),
                                                "identical": same, "runs": runs})  # fmt: skip
    tmp.cleanup()


if __name__ == "__main__":
    main()
