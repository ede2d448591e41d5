"""`psr bench serve`: what the server adds to decoding, measured in one run.

One loaded model decodes N prompts three ways, greedy, `max_tokens` each:
  model.generate      the library call, timed by a streamer (no server), before the
                      server's runs and again after them (2N calls)
  sequential          N streaming requests, one after another, against a local server
  concurrent          N streaming requests at once (they queue: batch 1)
The server runs in this process (uvicorn in a thread, over the same model); the clients
run in a process of their own (one asyncio loop), as real clients do. Time to first token
is taken from the call (request sent) to the first token; ms/token is the median of every
gap between two consecutive tokens (of all requests); overhead/token compares it with
model.generate's.
The three are repeated in R rounds. Every server request is paired with a model.generate
call on its prompt next to it in time (sequential: just before or after, alternating;
concurrent: the calls right after the batch, in its order), so a shared machine's slow
spells hit both; a run's overhead is the mean of its requests' relative differences from
their pairs (median gaps), with a Student-t 95% interval over the R x N requests.
Every greedy output must equal model.generate's, token for token.
Grammars' cost: the N prompts decoded by model.generate under each grammar mask the
server applies (llguidance: a JSON object; a forced tool call; tool_choice auto's lazy
grammar), its host time per token (computing the mask, consuming the token) next to the
whole token's time, and the same prompts decoded without a mask, alternating.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

# Short, varied openings (the embedded model writes plays).
PROMPTS = (
    "The quick brown fox",
    "To be, or not to be,",
    "Now is the winter of our discontent",
    "Friends, Romans, countrymen,",
    "All the world's a stage,",
    "Once more unto the breach,",
    "What light through yonder window breaks?",
    "If music be the food of love,",
)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass
class Run:
    """One way of decoding the N prompts."""

    name: str
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)  # every gap between two tokens
    request_ms: list[float] = field(default_factory=list)  # per request: its median gap
    decode_cpu_s: float = 0.0  # CPU time of the thread that decoded (prefill included)
    loop_cpu_s: float = 0.0  # CPU time of the server's event-loop thread (server runs)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def merge(self, other: Run) -> None:
        """Append `other`'s requests (and its wall time)."""
        self.wall_s += other.wall_s
        self.ttft_s += other.ttft_s
        self.gaps_ms += other.gaps_ms
        self.request_ms += other.request_ms
        self.decode_cpu_s += other.decode_cpu_s
        self.loop_cpu_s += other.loop_cpu_s
        self.outputs += other.outputs

    def decode_ms_per_token(self) -> float:
        """The median gap between consecutive tokens, over every token of every request:
        a machine's passing interruptions (this is a shared CPU) move it far less than a
        mean over the request does."""
        return statistics.median(self.gaps_ms) if self.gaps_ms else float("nan")


@dataclass(frozen=True)
class Overhead:
    """A server run's overhead per token against model.generate's: the mean of its
    requests' relative differences from their pairs, with a Student-t 95% interval over
    the requests (None: a single one)."""

    mean: float
    lo: float | None
    hi: float | None
    values: list[float]  # per request

    @classmethod
    def of(cls, values: list[float]) -> Overhead:
        mean = statistics.fmean(values)
        if len(values) < 2:
            return cls(mean, None, None, values)
        from scipy.stats import t  # type: ignore[import-untyped]

        n = len(values)
        half = t.ppf(0.975, n - 1) * statistics.stdev(values) / n**0.5
        return cls(mean, mean - half, mean + half, values)

    def __str__(self) -> str:
        if self.lo is None or self.hi is None:
            return f"{self.mean * 100:+.1f}%"
        return f"{self.mean * 100:+.1f}% [{self.lo * 100:+.1f}, {self.hi * 100:+.1f}]"


@dataclass
class BenchResult:
    """`rounds[i]` holds round i's runs: model.generate (2N calls), sequential, concurrent."""

    requests: int
    max_tokens: int
    policy: str
    rounds: list[list[Run]]
    grammar: dict[str, Any] | None = None  # the grammar masks' cost (_grammar_cost)

    @property
    def runs(self) -> list[Run]:
        """Each way of decoding, its rounds merged."""
        merged = [Run(r.name) for r in self.rounds[0]]
        for runs in self.rounds:
            for into, run in zip(merged, runs, strict=True):
                into.merge(run)
        return merged

    def overheads(self) -> list[Overhead]:
        """Per server run (sequential, concurrent): each request's median gap against its
        pair's, model.generate on the same prompt next to it in time (sequential: just
        before or after it; concurrent: the calls right after the batch, in its order)."""
        n = self.requests
        seq: list[float] = []
        conc: list[float] = []
        for ref, s, c in self.rounds:
            seq += [b / a - 1 for a, b in zip(ref.request_ms[:n], s.request_ms, strict=True)]
            conc += [b / a - 1 for a, b in zip(ref.request_ms[n:], c.request_ms, strict=True)]
        return [Overhead.of(seq), Overhead.of(conc)]

    @property
    def greedy_equal(self) -> bool:
        want = self.rounds[0][0].outputs[: self.requests]
        return all(
            ref.outputs == want * 2 and all(r.outputs == want for r in served)
            for ref, *served in self.rounds
        )

    def table(self) -> str:
        runs = self.runs
        overs = ["-", *map(str, self.overheads())]
        rows = []
        for r, over in zip(runs, overs, strict=True):
            ms = r.decode_ms_per_token()
            ttft = sorted(r.ttft_s)
            server = r is not runs[0]
            rows.append(
                [
                    r.name,
                    str(len(r.outputs)),
                    str(r.tokens),
                    f"{statistics.median(ttft) * 1e3:.1f}",
                    f"{ttft[-1] * 1e3:.1f}",
                    f"{ms:.2f}",
                    f"{r.tokens / r.wall_s:.1f}",
                    f"{r.decode_cpu_s / r.tokens * 1e3:.2f}",
                    f"{r.loop_cpu_s / r.tokens * 1e3:.3f}" if server else "-",
                    over,
                ]
            )
        n = len(self.rounds)
        pairs = n * self.requests
        head = [
            "run",
            "requests",
            "tokens",
            "TTFT p50 (ms)",
            "TTFT max (ms)",
            "ms/token",
            "tokens/s",
            "decode thread CPU ms/token",
            "event loop CPU ms/token",
            "overhead/token" + (" [95% interval]" if pairs > 1 else ""),
        ]
        lines = [
            f"psr bench serve: {self.requests} prompts x {self.max_tokens} tokens, greedy, "
            f"policy {self.policy}, {n} round{'s' if n > 1 else ''}",
            "",
            markdown_table(head, rows),
            "",
            "TTFT: from the call (request sent) to the first token; concurrent requests "
            "queue (batch 1). ms/token: the median gap between two consecutive tokens, over "
            "all tokens of all requests. overhead/token: each request's median gap against "
            "that of model.generate on its prompt next to it in time (its pair); the mean "
            "over requests"
            + (
                f" with a Student-t 95% interval over the {pairs} pairs"
                if pairs > 1
                else " (one pair: no interval)"
            )
            + ". tokens/s: all tokens / wall time. CPU ms/token: CPU time of the thread that "
            "decodes (model.generate's caller; the server's worker) and of the server's event "
            "loop (HTTP, SSE chunks), per token: what the server adds, without the wall "
            "clock's noise.",
            "greedy outputs equal to model.generate, token for token: "
            + ("yes" if self.greedy_equal else "NO"),
        ]
        g = self.grammar
        if g is not None:
            plain = g["ms_per_token_plain"]
            for way in GRAMMARS:
                w = g[way]
                lines.append(
                    f"grammar mask ({way}, llguidance): {w['mask_ms_per_token']:.3f} ms/token "
                    f"of host time over {w['tokens']:.0f} tokens; model.generate "
                    f"{w['ms_per_token']:.2f} ms/token with the mask, {plain:.2f} without "
                    "(the same prompts, alternating)"
                )
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "max_tokens": self.max_tokens,
            "policy": self.policy,
            "greedy_equal": self.greedy_equal,
            "overheads": {
                r.name: asdict(o) for r, o in zip(self.rounds[0][1:], self.overheads(), strict=True)
            },
            "rounds": [[asdict(r) | {"tokens": r.tokens} for r in runs] for runs in self.rounds],
            "grammar": self.grammar,
        }


# The grammars measured: structured output's, and tool calls' (hermes: a forced call, and
# the lazy grammar of tool_choice auto, free text until the call marker).
_NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
}
GRAMMARS = ("JSON object", "tool call, forced", "tool call, auto (lazy)")


def _grammar_cost(model: Any, ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """model.generate on `ids` under each of GRAMMARS and without a mask, alternating
    per prompt: each mask's host ms per token, and each way's ms per token."""
    from psr.serve import tools
    from psr.serve.decoding import Grammars
    from psr.serve.protocol import Structured, parse_tools

    tok = model.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    grammars = Grammars(tok, model.config.vocab_size, () if eos is None else (eos,))
    hermes, note = tools.FORMATS["hermes"], parse_tools([_NOTE])
    compiled: dict[str, str | None] = {
        "JSON object": grammars.grammar(Structured("json", None)),
        "tool call, forced": grammars.grammar(
            Structured("lark", tools.grammar(hermes, note, True, False))
        ),
        "tool call, auto (lazy)": grammars.grammar(
            Structured("lark", tools.grammar(hermes, note, False, False))
        ),
        "plain": None,
    }
    seconds = dict.fromkeys(compiled, 0.0)
    tokens = dict.fromkeys(compiled, 0)
    mask_s = dict.fromkeys(compiled, 0.0)
    masks = dict.fromkeys(compiled, 0)
    for prompt in ids:
        for way, grammar in compiled.items():
            mask = grammars.mask(grammar) if grammar is not None else None
            timer = _Timer()
            t0 = time.perf_counter()
            model.generate(
                prompt,
                max_new_tokens=max_tokens,
                eos_token_id=eos,
                streamer=_Feed(timer, mask),
                logits_processor=mask,
            )
            seconds[way] += time.perf_counter() - t0
            tokens[way] += len(timer.tokens)
            if mask is not None:
                mask_s[way] += mask.seconds
                masks[way] += mask.masks
    out: dict[str, Any] = {"ms_per_token_plain": seconds["plain"] * 1e3 / max(tokens["plain"], 1)}
    for way in GRAMMARS:
        out[way] = {
            "mask_ms_per_token": mask_s[way] * 1e3 / max(masks[way], 1),
            "tokens": float(masks[way]),
            "ms_per_token": seconds[way] * 1e3 / max(tokens[way], 1),
        }
    return out


class _Feed:
    """A streamer that feeds each token to the grammar mask (as the server's does)."""

    def __init__(self, timer: _Timer, mask: Any) -> None:
        self.timer, self.mask, self._prompt = timer, mask, True

    def put(self, value: Any) -> None:
        self.timer.put(value)
        if self._prompt:
            self._prompt = False
        elif self.mask is not None:
            for t in value.reshape(-1).tolist():
                self.mask.consume(int(t))

    def end(self) -> None:
        pass


class _Timer:
    """A streamer that notes when each new token is made."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt = True

    def put(self, value: Any) -> None:
        if self._prompt:
            self._prompt = False
            return
        for t in value.reshape(-1).tolist():
            self.times.append(time.perf_counter())
            self.tokens.append(int(t))

    def end(self) -> None:
        pass


def _record(run: Run, start: float, times: list[float], tokens: list[int]) -> None:
    run.outputs.append(tokens)
    run.ttft_s.append(times[0] - start if times else float("nan"))
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    run.gaps_ms += gaps
    run.request_ms.append(statistics.median(gaps) if gaps else float("nan"))


def _thread_cpu(t: threading.Thread) -> float:
    """CPU seconds `t` has used so far (its POSIX thread CPU clock)."""
    assert t.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def bench_serve(
    model: Any,
    *,
    requests: int = 8,
    max_tokens: int = 64,
    rounds: int = 3,
    prompts: tuple[str, ...] = PROMPTS,
    progress: bool = True,
) -> BenchResult:
    """Decode `requests` prompts (cycling through `prompts`) with model.generate and
    through a local server, sequentially and concurrently, `rounds` times (see the module
    docstring)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    from tqdm.auto import tqdm

    tok = model.tokenizer
    ids = [list(tok(prompts[i % len(prompts)])["input_ids"]) for i in range(requests)]
    eos = getattr(tok, "eos_token_id", None)

    def generate(prompt: list[int], run: Run) -> None:
        timer = _Timer()
        cpu, start = time.thread_time(), time.perf_counter()
        model.generate(prompt, max_new_tokens=max_tokens, eos_token_id=eos, streamer=timer)
        run.wall_s += time.perf_counter() - start
        run.decode_cpu_s += time.thread_time() - cpu
        _record(run, start, timer.times, timer.tokens)

    with _local_server(model, requests) as (url, threads):
        clients = _Clients(url, max_tokens)
        try:

            def served(prompts: list[list[int]], name: str) -> Run:
                """`prompts` at once through the server, with its threads' CPU time."""
                before = [_thread_cpu(t) for t in threads]
                run = clients.run(prompts, name)
                run.decode_cpu_s, run.loop_cpu_s = (
                    _thread_cpu(t) - b for t, b in zip(threads, before, strict=True)
                )
                return run

            generate(ids[0][:4], Run("warm-up"))  # first-call allocations, both ways
            clients.run([ids[0][:4]], "warm-up")
            done = [
                _paired_round(ids, generate, served)
                for _ in tqdm(range(rounds), desc="bench serve rounds", disable=not progress)
            ]
            grammar = _grammar_cost(model, ids, max_tokens) if model.drafter is None else None
        finally:
            clients.close()
    return BenchResult(requests, max_tokens, model.policy.describe(), done, grammar)


def _paired_round(
    ids: list[list[int]],
    generate: Callable[[list[int], Run], None],
    served: Callable[[list[list[int]], str], Run],
) -> list[Run]:
    """One round: each server request next to a model.generate call on its prompt (its
    pair), so a shared machine's slow spells hit both. Sequential: the pair's order
    alternates; concurrent: the batch, then its pairs in its order."""
    ref, seq = Run("model.generate"), Run("server, sequential")
    for i, prompt in enumerate(ids):
        if i % 2 == 0:
            generate(prompt, ref)
        seq.merge(served([prompt], seq.name))
        if i % 2 == 1:
            generate(prompt, ref)
    conc = served(ids, f"server, {len(ids)} concurrent")
    for prompt in ids:
        generate(prompt, ref)
    return [ref, seq, conc]


@contextlib.contextmanager
def _local_server(
    model: Any, requests: int
) -> Iterator[tuple[str, tuple[threading.Thread, threading.Thread]]]:
    """A server for `model` on a free local port, started and ready: its URL and its two
    threads (the engine's worker, the event loop's); stopped on exit."""
    import uvicorn

    from psr.serve.app import create_app
    from psr.serve.worker import Engine

    engine = Engine(lambda: model, max_queue=requests)
    port = _free_port()
    config = uvicorn.Config(
        create_app(engine, served_name="bench"),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="psr-bench-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not (server.started and engine.ready.is_set()):
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the benchmark's server did not start")
            time.sleep(0.01)
        assert engine.thread is not None
        yield f"http://127.0.0.1:{port}", (engine.thread, thread)
    finally:
        server.should_exit = True
        thread.join(30)


class _Clients:
    """The clients, in a process of their own (as real clients are): their work does not
    compete with the server's threads for this interpreter's lock. One JSON line in (the
    prompts to send at once), one out (their Run)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        code = "from psr.serve.overhead import client_main; client_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, url, str(max_tokens)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, prompts: list[list[int]], name: str) -> Run:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "name": name}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr is not None else ""
            raise RuntimeError(f"the benchmark's clients failed: {err.strip()[-2000:]}")
        return Run(**json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def client_main() -> None:
    """The client process (argv: url, max_tokens): see _Clients."""
    url, max_tokens = sys.argv[1], int(sys.argv[2])
    loop = asyncio.new_event_loop()
    try:
        for line in sys.stdin:
            job = json.loads(line)
            run = loop.run_until_complete(_send(url, job["prompts"], max_tokens, job["name"]))
            print(json.dumps(asdict(run)), flush=True)
    finally:
        loop.close()


async def _send(url: str, prompts: list[list[int]], max_tokens: int, name: str) -> Run:
    """`prompts` as streaming requests, all at once; each keeps its place in the Run."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=None) as client:

        async def one(prompt: list[int]) -> Run:
            run = Run(name)
            body = {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "return_token_ids": True,
            }
            times: list[float] = []
            tokens: list[int] = []
            start = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"the server answered {r.status_code}: {await r.aread()!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"the server failed: {chunk['error']['message']}")
                    for choice in chunk["choices"]:
                        new = choice.get("token_ids") or []
                        now = time.perf_counter()
                        times += [now] * len(new)
                        tokens += new
            _record(run, start, times, tokens)
            return run

        t0 = time.perf_counter()
        parts = await asyncio.gather(*(one(p) for p in prompts))
        out = Run(name, wall_s=time.perf_counter() - t0)
        for part in parts:
            out.merge(part)
        return out
