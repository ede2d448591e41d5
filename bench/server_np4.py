"""Issue 38: `llama-server -np 4` against `psr serve --parallel 4` over HTTP, one thread each.

Both servers load the same GGUF file; per round (order reversed every other round) each is
started, warmed up, then sent 1 stream (solo) and 4 concurrent streams (the `openai` client,
one thread per stream) of `/v1/completions` with token-id prompts (bench/llamacpp_side.py's
four 32-token prompts), greedy, the same max_tokens; tokens counted from the responses'
`usage.completion_tokens`. Each figure in wall and CPU time (the server process's user + sys
from /proc around the requests), with the load average: the machine is shared. Ratios only
between runs of the same round: aggregate(4) / solo per program, psr / llama.cpp at 4.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python bench/server_np4.py \
        /work/cache/gguf/olmoe-L4-Q4_K_M.gguf --rounds 3 --out bench/results/batch/server-np4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_side import _proc_cpu, _stream_prompts, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def _server_cmd(prog: str, path: str, a: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    if prog == "llama.cpp":
        cmd = [str(Path(a.llama) / "llama-server"), "-m", path, "-np", str(a.streams)]
        cmd += ["-t", str(a.threads), "-c", str(a.streams * 256), "--port", str(a.port)]
        return [*cmd, "--no-warmup"], env
    env["PYTHONPATH"] = f"{ROOT / 'python'}:{ROOT}"
    cmd = [sys.executable, "-m", "psr.cli", "serve", "--model", path, "--policy", "exact"]
    cmd += ["--residency", "1.0", "--device", "cpu", "--experts-on", "cpu"]
    cmd += ["--threads", str(a.threads), "--parallel", str(a.streams), "--port", str(a.port)]
    return [*cmd, "--quiet"], env


def serve_run(prog: str, path: str, a: argparse.Namespace) -> dict[str, Any]:
    """One server of `prog`: best of a.reps for 1 stream and for a.streams streams."""
    import openai

    cmd, env = _server_cmd(prog, path, a)
    log = open(f"/tmp/server_np4-{prog}.log", "ab")
    srv = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{a.port}"
    extra = {"ignore_eos": True} if prog == "llama.cpp" else {}
    try:
        wait_healthy(url, srv)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=1200)
        model = client.models.list().data[0].id  # psr answers 404 to any other name
        prompts = _stream_prompts()[: a.streams]

        def one(p: list[int], n: int) -> int:
            r = client.completions.create(
                model=model, prompt=p, max_tokens=n, temperature=0.0, extra_body=extra
            )
            assert r.usage is not None
            return int(r.usage.completion_tokens)

        one(prompts[0][:8], 2)  # warm-up
        out: dict[str, Any] = {"cmd": " ".join(cmd), "load": [os.getloadavg()[0]]}
        with concurrent.futures.ThreadPoolExecutor(a.streams) as ex:
            for name, ps in (("solo", prompts[:1]), ("agg", prompts)):
                best: dict[str, Any] | None = None
                for _ in range(a.reps):
                    t, c = time.perf_counter(), _proc_cpu(srv.pid)
                    n = sum(ex.map(lambda p: one(p, a.max_tokens), ps))
                    w, c = time.perf_counter() - t, _proc_cpu(srv.pid) - c
                    if best is None or n / w > best["tok_s"]:
                        best = {"tok_s": n / w, "cpu_tok_s": n / c, "tokens": n, "wall_s": w}
                out[name] = best
        out["load"].append(os.getloadavg()[0])
        return out
    finally:
        srv.terminate()
        srv.wait()
        log.close()


def report(rounds: list[dict[str, Any]]) -> str:
    lines = [
        "| round | prog | solo tok/s wall (CPU) | 4 streams tok/s wall (CPU) | agg/solo wall (CPU) "
        "| load |",
        "|---|---|---|---|---|---|",
    ]
    ratio: list[float] = []
    ratio_c: list[float] = []
    for i, rd in enumerate(rounds):
        for prog in ("llama.cpp", "psr"):
            r = rd[prog]
            s, g = r["solo"], r["agg"]
            lines.append(
                f"| {i} | {prog} | {s['tok_s']:.2f} ({s['cpu_tok_s']:.2f}) | "
                f"{g['tok_s']:.2f} ({g['cpu_tok_s']:.2f}) | {g['tok_s'] / s['tok_s']:.2f}x "
                f"({g['cpu_tok_s'] / s['cpu_tok_s']:.2f}x) | "
                f"{r['load'][0]:.2f}-{r['load'][1]:.2f} |"
            )
        ratio.append(rd["psr"]["agg"]["tok_s"] / rd["llama.cpp"]["agg"]["tok_s"])
        ratio_c.append(rd["psr"]["agg"]["cpu_tok_s"] / rd["llama.cpp"]["agg"]["cpu_tok_s"])
    lines.append("")
    lines.append(
        "psr / llama.cpp at 4 streams per round, wall: "
        + ", ".join(f"{x:.2f}x" for x in ratio)
        + f" (median {statistics.median(ratio):.2f}x); CPU: "
        + ", ".join(f"{x:.2f}x" for x in ratio_c)
        + f" (median {statistics.median(ratio_c):.2f}x)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--llama", default="/work/cache/llama/build/bin")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1, help="timed runs per server, mode and round")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18191)
    ap.add_argument("--out", required=True, help="folder: writes runs-*.json")
    ap.add_argument("--report", action="store_true", help="the table of --out's runs-*.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.report:
        rounds = [r for f in sorted(out.glob("runs-*.json")) for r in json.loads(f.read_text())]
        print(report(rounds))
        return
    dest = out / f"runs-{time.strftime('%Y%m%dT%H%M%S')}.json"
    rounds = []
    for i in range(a.rounds):
        progs = ("llama.cpp", "psr") if i % 2 == 0 else ("psr", "llama.cpp")
        rd: dict[str, Any] = {"file": a.gguf, "max_tokens": a.max_tokens}
        for prog in progs:
            rd[prog] = serve_run(prog, a.gguf, a)
            print(prog, i, json.dumps(rd[prog]), flush=True)
        rounds.append(rd)
        dest.write_text(json.dumps(rounds, indent=1))
    print(report(rounds))


if __name__ == "__main__":
    main()
