"""psr side by side with llama.cpp on the same synthetic GGUF files, on this CPU (the
"Measure" sections of issues 36 and 39): prefill of 512 tokens (`--prompts`: each length
given), decode of 64, and the dense part per byte, alternating the two programs over rounds.

    PYTHONPATH=python:. .venv/bin/python bench/llamacpp_side.py \
        --llama /work/cache/llama/build/bin --cache /work/cache/gguf --layers 4 \
        --models olmoe,qwen3 --quants Q4_K_M,Q8_0 --threads 1,2 --rounds 2 \
        --out bench/results/llamacpp

Files (written once into `--cache`, outside the repo): OLMoE-1B-7B- and Qwen3-30B-A3B-shaped
(published widths, heads, experts, top-k and vocabularies; `--layers` decoder layers, not
the published 16 / 48: reduced depth, so the per-token ratios at that depth are what is
compared), random F16 weights (std 0.02, norms near 1) with llama.cpp's tensor names and
metadata (the config through tests/gguf_files.py's writer), the embedded model's tokenizer
padded to the vocabulary; then `llama-quantize` makes the Q4_K_M and Q8_0 files from the F16
one (llama.cpp's own type mix). A "dense twin" of each shape has the same dense tensors
but 2 experts of FFN 256, top-1: per token it reads almost only dense weights (attention
projections, router, LM head), so its decode time per byte is each program's dense part.

Per round, per file and thread count: `llama-bench -m FILE -p 512 -n 0 -t T -r R -o json`
(one run per `--prompts` length, so each has its own CPU time) and `-p 0 -n 64`, then
(order reversed every other round) one psr worker process with OMP_NUM_THREADS=T:
`psr.load(FILE, "exact", 1.0, device="cpu", threads=T)` (every expert resident on the CPU,
dense weights in their GGUF blocks), prefill = `generate(512 ids, max_new_tokens=1)` (as
bench/prefill.py), decode = 64 tokens after the first (a streamer's
timestamps), psr's `cpu_linear` calls (its dense kernel) timed inside the decode span.
`--serve` (issue 38) instead: `llama-server -np 4` with four concurrent `/completion`
requests against psr's `generate_batch` of the same four prompts. Each figure in wall and
CPU time (psr: process_time; llama.cpp: the child's rusage, less `--overhead`'s CPU of a
`-p 0 -n 1` run: load and repacking; the server: /proc around the requests): the machine
is shared. Figures: best of rounds; ratios only between runs of the same round; the load
average beside each run. `--report` prints the tables of `--out`'s JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the GGUF writer's conventions (tests/gguf_files.py)
PROMPT, GEN = 512, 64


def _pp(prompt: int) -> str:
    """The runs' key of a prefill of `prompt` tokens ("prefill" for 512, as earlier runs)."""
    return "prefill" if prompt == PROMPT else f"prefill{prompt}"


# published configs (hf config.json of allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-30B-A3B)
SHAPES: dict[str, dict[str, Any]] = {
    "olmoe": dict(
        family="olmoe",
        hidden_size=2048,
        intermediate_size=1024,
        num_experts=64,
        num_experts_per_tok=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        vocab_size=50304,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        full_layers=16,
    ),
    "qwen3": dict(
        family="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        full_layers=48,
    ),
}
TWIN = dict(num_experts=2, num_experts_per_tok=1, ffn=256)  # the dense twin's experts


def _config(shape: str, layers: int, twin: bool) -> Any:
    from tiny_models import tiny_config

    s = dict(SHAPES[shape])
    family, rope = s.pop("family"), s.pop("rope_theta")
    s.pop("full_layers")
    if twin:
        s["num_experts"], s["num_experts_per_tok"] = (
            TWIN["num_experts"],
            TWIN["num_experts_per_tok"],
        )
        key = "moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"
        s[key] = TWIN["ffn"]
    cfg = tiny_config(family)
    for k, v in dict(s, num_hidden_layers=layers, max_position_embeddings=4096).items():
        setattr(cfg, k, v)
    if family == "qwen3_moe":
        cfg.mlp_only_layers, cfg.decoder_sparse_step, cfg.norm_topk_prob = [], 1, True
    cfg.tie_word_embeddings = False
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope}
    return cfg


def write_f16(path: Path, shape: str, layers: int, twin: bool, seed: int = 0) -> None:
    """Stream a random F16 GGUF of `shape` to `path` (one tensor in memory at a time)."""
    import gguf
    import numpy as np
    import torch
    import transformers
    from gguf import GGMLQuantizationType as QT
    from gguf_files import _Writer, hf_tokenizer, write_tokenizer

    cfg = _config(shape, layers, twin)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    wr = _Writer(meta, "F16", seed)
    # (gguf name, numpy shape, torch-side kind) in the writer's order: experts, then the rest
    plan: list[tuple[str, tuple[int, ...], str]] = []
    sd = meta.state_dict()
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts."
        E, twoF, H = sd[p + "gate_up_proj"].shape
        F = twoF // 2
        for part, shp in (("gate", (E, F, H)), ("up", (E, F, H)), ("down", (E, H, F))):
            plan.append((f"blk.{layer}.ffn_{part}_exps.weight", shp, "w"))
    for name, t in sd.items():
        if ".mlp.experts." in name:
            continue
        gname = wr.tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise KeyError(f"no GGUF name for {name}")
        kind = "norm" if "norm" in name else ("router" if name.endswith("mlp.gate.weight") else "w")
        plan.append((gname, tuple(t.shape), kind))
    w = gguf.GGUFWriter(path, wr.arch)
    wr.metadata(w)
    w.add_name(f"psr synthetic {shape} ({layers} layers{', dense twin' if twin else ''})")
    write_tokenizer(w, hf_tokenizer(), cfg.vocab_size, None)
    for gname, shp, _kind in plan:
        dt = np.float32 if len(shp) == 1 else np.float16
        n = int(np.prod(shp))
        w.add_tensor_info(
            gname,
            shp,
            np.dtype(dt),
            n * np.dtype(dt).itemsize,
            QT.F32 if dt == np.float32 else QT.F16,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _gname, shp, kind in plan:
        if kind == "norm":
            w.write_tensor_data(rng.uniform(0.8, 1.2, shp).astype(np.float32))
            continue
        out = np.empty(shp, np.float16)
        flat = out.reshape(shp[0], -1)
        std = 0.5 if kind == "router" else 0.02
        for i in range(0, flat.shape[0], 256):  # bounded float32 temporaries
            chunk = flat[i : i + 256]
            chunk[:] = rng.standard_normal(chunk.shape, dtype=np.float32) * std
        w.write_tensor_data(out)
    w.close()


def make_files(a: argparse.Namespace) -> dict[str, Path]:
    """{label: path} of every file the run needs, written and quantized where missing."""
    a.cache.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for shape in a.models:
        for twin in (False, True) if a.twins else (False,):
            stem = f"{shape}-L{a.layers}{'-twin' if twin else ''}"
            f16 = a.cache / f"{stem}-F16.gguf"
            wanted = {q: a.cache / f"{stem}-{q}.gguf" for q in a.quants}
            if any(not p.exists() for p in wanted.values()) and not f16.exists():
                t = time.perf_counter()
                write_f16(f16.with_suffix(".part"), shape, a.layers, twin)
                f16.with_suffix(".part").rename(f16)
                print(f"wrote {f16} in {time.perf_counter() - t:.0f} s", flush=True)
            for q, p in wanted.items():
                if not p.exists():
                    cmd = [str(a.llama / "llama-quantize"), str(f16), str(p) + ".part", q, "2"]
                    subprocess.run(cmd, check=True, capture_output=True)
                    Path(str(p) + ".part").rename(p)
                    print(f"quantized {p}", flush=True)
                files[f"{stem}-{q}"] = p
            if f16.exists() and not a.keep_f16:
                f16.unlink()
    return files


def file_bytes(path: Path) -> dict[str, Any]:
    """Bytes per kind from the file's tensor table, and the types of its matrices."""
    import gguf

    r = gguf.GGUFReader(path)
    out: dict[str, Any] = {"experts": 0, "dense": 0, "embedding": 0, "types": {}}
    for t in r.tensors:
        kind = (
            "experts" if "_exps" in t.name else "embedding" if "token_embd" in t.name else "dense"
        )
        out[kind] += int(t.n_bytes)
        if len(t.shape) > 1:
            base = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
            out["types"].setdefault(base, set()).add(t.tensor_type.name)
    out["types"] = {k: sorted(v) for k, v in out["types"].items()}
    return out


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def llama_bench(a: argparse.Namespace, path: Path, threads: int) -> dict[str, Any]:
    """`llama-bench -p 512 -n 0` then `-p 0 -n 64`; beside its tok/s, tok/s of its CPU time
    (the process's, from rusage: it includes the load and the warm-up run, which count as
    tokens too, a full prompt for pp and one token for tg; so a slight underestimate)."""
    load0 = os.getloadavg()[0]
    got: dict[str, Any] = {}
    pps = [] if a.decode_only else [(_pp(p), p, 0) for p in a.prompts]
    for key, p, n in [*pps, ("decode", 0, GEN)]:
        cmd = [str(a.llama / "llama-bench"), "-m", str(path), "-p", str(p), "-n", str(n)]
        cmd += ["-t", str(threads), "-r", str(a.reps), "-o", "json"]
        c = _children_cpu()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        cpu = _children_cpu() - c
        (r,) = json.loads(out.stdout)
        toks = (p or n) * a.reps + (p or 1)  # the timed runs and the warm-up
        got[key] = {"tok_s": r["avg_ts"], "std": r["stddev_ts"], "samples": r["samples_ts"]}
        got[key] |= {"cpu_tok_s": toks / cpu, "cpu_s": cpu, "cmd": " ".join(cmd[1:])}
    got["load"] = [load0, os.getloadavg()[0]]
    return got


def llama_overhead(a: argparse.Namespace, path: Path, threads: int) -> float:
    """CPU seconds of a `llama-bench -p 0 -n 1` run (load, repacking, a warm-up token and one
    timed token): the best of `a.reps` runs, subtracted from the pp / tg runs' CPU time."""
    cmd = [str(a.llama / "llama-bench"), "-m", str(path), "-p", "0", "-n", "1"]
    cmd += ["-t", str(threads), "-r", "1", "-o", "json"]
    best = float("inf")
    for _ in range(a.reps):
        c = _children_cpu()
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        best = min(best, _children_cpu() - c)
    return best


def _corrected(run: dict[str, Any], overhead: dict[str, float]) -> dict[str, Any]:
    """A llama.cpp run with its CPU tok/s net of the load overhead: the pp run's prompts
    (the timed ones and the warm-up) over (its CPU - overhead); the tg run's tokens less the
    overhead run's two over (its CPU - overhead)."""
    ovh = overhead.get(f"{run['file']}/{run['threads']}")
    if ovh is None:
        return run
    out = dict(run)
    for stage in [k for k in run if k.startswith("prefill")] + ["decode"]:
        if stage not in run:  # a --decode-only run
            continue
        st = dict(run[stage])
        p = int(st["cmd"].split(" -p ")[1].split()[0])
        per, extra = (p, p) if p else (GEN, -1)
        reps = int(st["cmd"].split(" -r ")[1].split()[0])
        st["cpu_tok_s"] = (per * reps + extra) / (st["cpu_s"] - ovh)
        out[stage] = st
    return out


class _Clock:
    """A streamer: wall and CPU time of each put (the first is the prompt); resets the
    dense timer at the first new token so it covers the decode span only."""

    def __init__(self, dense: dict[str, float]) -> None:
        self.marks: list[tuple[float, float]] = []
        self.dense = dense

    def put(self, _value: Any) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))
        if len(self.marks) == 2:
            self.dense.update(s=0.0, cpu_s=0.0, calls=0, bytes=0)

    def end(self) -> None:
        pass


def worker(
    path: str, threads: int, reps: int, prefill: bool = True, prompts: tuple[int, ...] = (PROMPT,)
) -> dict[str, Any]:
    """psr on one file: prefill of each of `prompts` tokens (unless not `prefill`) and decode
    tok/s, and the time in its dense kernel."""
    import torch

    import psr
    from psr.store import cpu_kernels

    dense = {"s": 0.0, "cpu_s": 0.0, "calls": 0, "bytes": 0}
    inner = cpu_kernels.cpu_linear

    def timed(x: torch.Tensor, weight: torch.Tensor, **kw: Any) -> torch.Tensor:
        t, c = time.perf_counter(), time.process_time()
        y = inner(x, weight, **kw)
        dense["s"] += time.perf_counter() - t
        dense["cpu_s"] += time.process_time() - c
        dense["calls"] += 1
        dense["bytes"] += weight.numel() * weight.element_size()
        return y

    cpu_kernels.cpu_linear = timed  # type: ignore[assignment]
    plan = getattr(cpu_kernels, "LinearPlan", None)  # the dense layers' prepared calls
    if plan is not None:  # (trees before them call cpu_linear)
        plan_call = plan.__call__

        def timed_plan(self: Any, x: torch.Tensor, **kw: Any) -> torch.Tensor:
            t, c = time.perf_counter(), time.process_time()
            y = plan_call(self, x, **kw)
            dense["s"] += time.perf_counter() - t
            dense["cpu_s"] += time.process_time() - c
            dense["calls"] += 1
            dense["bytes"] += self.w.numel() * self.w.element_size()
            return y

        plan.__call__ = timed_plan
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    dot = os.environ.get("PSR_BENCH_CPU_DOT", "auto")
    model = psr.load(path, "exact", 1.0, device="cpu", threads=threads, progress=False, cpu_dot=dot)
    if os.environ.get("PSR_BENCH_KEEP_TORCH_THREADS"):  # bench/omp_wait.py: decode steps
        model.decodes_on_kernels = lambda: False  # type: ignore[method-assign]  # keep torch's
    out: dict[str, Any] = {
        "load_s": time.perf_counter() - t,
        "torch_threads": torch.get_num_threads(),
    }
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (1, max(prompts)), generator=g)  # the tokenizer's ids
    model.generate(ids[:, :16], max_new_tokens=2)  # warm-up
    for n in prompts if prefill else ():
        pre = []
        for _ in range(reps):
            w, c = time.perf_counter(), time.process_time()
            model.generate(ids[:, :n], max_new_tokens=1)
            pre.append((time.perf_counter() - w, time.process_time() - c))
        wall, cpu = min(p[0] for p in pre), min(p[1] for p in pre)
        out[_pp(n)] = {
            "tok_s": n / wall,
            "cpu_tok_s": n / cpu,
            "runs_wall_s": [p[0] for p in pre],
        }
    dec = []
    for _ in range(reps):
        clock = _Clock(dense)
        model.generate(ids[:, :8], max_new_tokens=GEN + 1, streamer=clock)
        (w0, c0), (w1, c1) = clock.marks[1], clock.marks[-1]
        dec.append(
            {
                "tok_s": GEN / (w1 - w0),
                "cpu_tok_s": GEN / (c1 - c0),
                "dense_ms_per_tok": 1e3 * dense["s"] / GEN,
                "dense_cpu_ms_per_tok": 1e3 * dense["cpu_s"] / GEN,
                "dense_bytes_per_tok": dense["bytes"] / GEN,
                "dense_calls_per_tok": dense["calls"] / GEN,
            }
        )
    out["decode"] = max(dec, key=lambda d: d["tok_s"])
    out["decode_runs"] = dec
    out["load"] = [load0, os.getloadavg()[0]]
    return out


STREAMS, STREAM_PROMPT = 4, 32  # issue 38: four concurrent streams of 32 prompt tokens


def _stream_prompts() -> list[list[int]]:
    import random

    rnd = random.Random(1)
    return [[rnd.randrange(100, 2000) for _ in range(STREAM_PROMPT)] for _ in range(STREAMS)]


def worker_batch(path: str, threads: int, reps: int) -> dict[str, Any]:
    """psr: STREAMS prompts decoded together by `generate_batch`, GEN tokens each."""
    import torch

    import psr

    model = psr.load(path, "exact", 1.0, device="cpu", threads=threads, progress=False)
    prompts = _stream_prompts()
    model.generate_batch([p[:8] for p in prompts], max_new_tokens=2)  # warm-up
    load0, best = os.getloadavg()[0], None
    for _ in range(reps):
        w, c = time.perf_counter(), time.process_time()
        out = model.generate_batch(prompts, max_new_tokens=GEN)
        w, c = time.perf_counter() - w, time.process_time() - c
        n = sum(len(o) for o in out)
        if best is None or n / w > best["tok_s"]:
            best = {"tok_s": n / w, "cpu_tok_s": n / c, "tokens": n, "wall_s": w}
    assert best is not None
    return {
        "serve": best,
        "torch_threads": torch.get_num_threads(),
        "load": [load0, os.getloadavg()[0]],
    }


def wait_healthy(url: str, srv: subprocess.Popen[bytes], tries: int = 1200) -> None:
    """Until `url`/health answers 200 (a server loading a model), or a one-line error."""
    import urllib.request

    for _ in range(tries):
        if srv.poll() is not None:
            raise RuntimeError(f"the server exited with {srv.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def llama_server(a: argparse.Namespace, path: Path, threads: int) -> dict[str, Any]:
    """llama-server with STREAMS slots: STREAMS concurrent /completion requests of GEN
    greedy tokens (ignore_eos) from token-id prompts; aggregate tok/s over the wall time."""
    import concurrent.futures
    import urllib.request

    port = 18080 + threads
    cmd = [str(a.llama / "llama-server"), "-m", str(path), "-np", str(STREAMS), "-t", str(threads)]
    cmd += ["-c", str(STREAMS * 256), "--port", str(port), "--no-warmup"]
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def post(prompt: list[int], n: int) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(
            url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            return dict(json.loads(r.read()))

    try:
        wait_healthy(url, srv)
        prompts = _stream_prompts()
        post(prompts[0][:8], 2)  # warm-up
        load0, best = os.getloadavg()[0], None
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as ex:
            for _ in range(a.reps):
                t, c = time.perf_counter(), _proc_cpu(srv.pid)
                outs = list(ex.map(lambda p: post(p, GEN), prompts))
                w, c = time.perf_counter() - t, _proc_cpu(srv.pid) - c
                n = sum(int(o["tokens_predicted"]) for o in outs)
                if best is None or n / w > best["tok_s"]:
                    best = {"tok_s": n / w, "cpu_tok_s": n / c, "tokens": n, "wall_s": w}
        assert best is not None
        return {"serve": best, "cmd": " ".join(cmd[1:]), "load": [load0, os.getloadavg()[0]]}
    finally:
        srv.terminate()
        srv.wait()


def run_psr(
    a: argparse.Namespace, path: Path, threads: int, kind: str = "single", dot: str = "auto",
    root: Path = ROOT,
) -> dict[str, Any]:  # fmt: skip
    """One psr worker process: psr imported from `root`'s source tree (`--base`: another)."""
    env = {**os.environ, "PYTHONPATH": f"{root / 'python'}:{root}", "OMP_NUM_THREADS": str(threads)}
    env["PSR_BENCH_CPU_DOT"] = dot
    env["PSR_BENCH_PROMPTS"] = ",".join(map(str, a.prompts))
    if kind == "single" and a.decode_only:
        kind = "decode"
    cmd = [sys.executable, __file__, "--worker", kind, str(path), str(threads), str(a.reps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def _psr_prog(dot: str, base: bool = False) -> str:
    """The tables' name of psr with load option cpu_dot=`dot` ('psr': the default), of this
    tree or (`base`) the `--base` tree ('psr@base')."""
    name = "psr@base" if base else "psr"
    return name if dot == "auto" else f"{name}:{dot}"


def _per_token_bytes(label: str, info: dict[str, Any]) -> float:
    """Weight bytes one decode token reads: every dense tensor but the embedding (one row of
    it, neglected), and top-k / E of the experts'."""
    shape = SHAPES[label.split("-")[0]]
    k, e = shape["num_experts_per_tok"], shape["num_experts"]
    if "-twin" in label:
        k, e = TWIN["num_experts_per_tok"], TWIN["num_experts"]
    return float(info["dense"] + info["experts"] * k / e)


def _best(runs: list[dict[str, Any]], stage: str, key: str = "tok_s") -> float:
    return max(r[stage][key] for r in runs)


def _ratios(
    by: dict[str, list[dict[str, Any]]], stage: str, key: str = "tok_s", prog: str = "psr"
) -> str:
    """psr / llama.cpp within each round (side by side), as 'lo-hi' over rounds."""
    ll = {r["round"]: r[stage][key] for r in by.get("llama.cpp", [])}
    got = sorted(p[stage][key] / ll[p["round"]] for p in by.get(prog, []) if p["round"] in ll)
    if not got:
        return "-"
    return f"{got[0]:.2f}x" if len(got) == 1 else f"{got[0]:.2f}-{got[-1]:.2f}x"


def _load(runs: list[dict[str, Any]]) -> str:
    loads = [x for r in runs for x in r["load"]]
    return f"{min(loads):.1f}-{max(loads):.1f}"


def report(docs: list[dict[str, Any]], overhead: dict[str, float]) -> str:
    """Markdown tables of the runs in `docs` (runs-*.json): files, prefill, decode, dense;
    llama.cpp's CPU tok/s net of `overhead` ({"FILE/THREADS": CPU s}) where it has one."""
    files: dict[str, Any] = {}
    groups: dict[tuple[str, int, str], dict[str, list[dict[str, Any]]]] = {}
    for i, doc in enumerate(docs):
        files |= doc["meta"]["files"]
        for r in doc["runs"]:
            r = dict(r, round=(i, r["round"]))  # rounds of different invocations differ
            if r["prog"] == "llama.cpp" and "serve" not in r:
                r = _corrected(r, overhead)
            kind = "serve" if "serve" in r else "single"
            groups.setdefault((r["file"], r["threads"], kind), {}).setdefault(r["prog"], []).append(
                r
            )
    mib = 2**20
    out = [
        "| file | MiB | dense MiB (no embedding) | experts MiB | weight MiB read per token "
        "| types (attn_q, attn_v, ffn_down_exps, output) |",
        "|---|---|---|---|---|---|",
    ]
    for label, f in files.items():
        ty = f["types"]
        show = ", ".join(
            "/".join(ty.get(n, ["-"]))
            for n in ("attn_q.weight", "attn_v.weight", "ffn_down_exps.weight", "output.weight")
        )
        total = f["dense"] + f["experts"] + f["embedding"]
        out.append(
            f"| {label} | {total / mib:.0f} | {f['dense'] / mib:.1f} | {f['experts'] / mib:.0f} "
            f"| {_per_token_bytes(label, f) / mib:.1f} | {show} |"
        )
    pps = {k for doc in docs for r in doc["runs"] for k in r if k.startswith("prefill")}
    lens = sorted(int(k[len("prefill") :] or PROMPT) for k in pps)
    stages = tuple((_pp(n), f"prompt {n} tok/s") for n in lens)
    stages += (("decode", "decode 64 tok/s"), ("serve", f"{STREAMS} streams aggregate tok/s"))
    for stage, what in stages:
        rows = [
            (label, t, by, prog)
            for (label, t, _), by in groups.items()
            for prog in sorted(by)
            if prog.startswith("psr") and "llama.cpp" in by and stage in by[prog][0]
        ]
        if not rows:
            continue
        out += [
            "",
            f"| file | threads | llama.cpp {what}: wall (CPU time) | psr: wall (CPU time) "
            "| psr / llama.cpp per round: wall (CPU time) | load avg |",
            "|---|---|---|---|---|---|",
        ]
        for label, t, by, prog in rows:
            ll, ps = by["llama.cpp"], by[prog]
            name = label if prog == "psr" else f"{label} ({prog})"
            out.append(
                f"| {name} | {t} | {_best(ll, stage):.1f} ({_best(ll, stage, 'cpu_tok_s'):.1f}) "
                f"| {_best(ps, stage):.1f} ({_best(ps, stage, 'cpu_tok_s'):.1f}) "
                f"| {_ratios(by, stage, prog=prog)} ({_ratios(by, stage, 'cpu_tok_s', prog)}) "
                f"| {_load(ll + ps)} |"
            )
    out += [
        "",
        "| file | threads | weight MiB / token | llama.cpp tok/s | psr tok/s | llama.cpp GB/s "
        "| psr GB/s | psr cpu_linear ms / token (MiB) | psr cpu_linear GB/s "
        "| psr / llama.cpp per round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (label, t, _), by in groups.items():
        if "psr" not in by or "llama.cpp" not in by or "decode" not in by["psr"][0]:
            continue
        b = _per_token_bytes(label, files[label])
        key = "cpu_tok_s"
        ll, ps = _best(by["llama.cpp"], "decode", key), _best(by["psr"], "decode", key)
        # the dense kernel's CPU time where the run has it (earlier runs: wall time only)
        decs = [r["decode"] for r in by["psr"]]
        decs = [d for d in decs if "dense_cpu_ms_per_tok" in d] or decs
        d = max(decs, key=lambda d: d[key])
        ms = d.get("dense_cpu_ms_per_tok", d["dense_ms_per_tok"])
        lin = d["dense_bytes_per_tok"] / ms / 1e6 if ms else 0.0
        out.append(
            f"| {label} | {t} | {b / mib:.1f} | {ll:.1f} | {ps:.1f} | {b * ll / 1e9:.2f} "
            f"| {b * ps / 1e9:.2f} | {ms:.1f} ({d['dense_bytes_per_tok'] / mib:.1f}) "
            f"| {lin:.2f} | {_ratios(by, 'decode', key)} |"
        )
    return "\n".join(out)


def run_rounds(a: argparse.Namespace, files: dict[str, Path], stamp: str) -> None:
    """`--rounds` rounds over the files and thread counts, llama.cpp and each psr program
    (cpu_dot values, `--base`'s tree) in an order reversed every other round."""
    info = {label: file_bytes(p) for label, p in files.items()}
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for label, path in files.items():
            for t in a.threads:
                progs = {_psr_prog(d): (d, ROOT) for d in a.cpu_dots}
                if a.base is not None:
                    progs |= {_psr_prog(d, True): (d, a.base.resolve()) for d in a.cpu_dots}
                psrs = list(progs)
                order = ["llama.cpp", *psrs] if (r % 2 == 0) else [*psrs[::-1], "llama.cpp"]
                for prog in order:
                    if prog == "llama.cpp":
                        got = (llama_server if a.serve else llama_bench)(a, path, t)
                    else:
                        dot, root = progs[prog]
                        kind = "batch" if a.serve else "single"
                        got = run_psr(a, path, t, kind, dot, root)
                    runs.append(dict(round=r, file=label, threads=t, prog=prog, **got))
                    print(f"r{r} {label} t{t} {prog}: {json.dumps(got)[:300]}", flush=True)
                    if a.out:
                        a.out.mkdir(parents=True, exist_ok=True)
                        meta = {"args": {k: str(v) for k, v in vars(a).items()}, "files": info}
                        doc = {"meta": meta, "runs": runs}
                        (a.out / f"runs-{stamp}.json").write_text(json.dumps(doc, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", type=Path, default=Path("/work/cache/llama/build/bin"))
    ap.add_argument("--cache", type=Path, default=Path("/work/cache/gguf"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--models", type=lambda s: s.split(","), default=["olmoe", "qwen3"])
    ap.add_argument("--quants", type=lambda s: s.split(","), default=["Q4_K_M", "Q8_0"])
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--twins", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="timed runs per program and round")
    ap.add_argument("--match", default="", help="run only the files whose label has this")
    ap.add_argument("--keep-f16", action="store_true")
    ap.add_argument("--make-only", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="folder: appends runs-*.json")
    ap.add_argument("--overhead", action="store_true", help="llama-bench's load CPU time")
    ap.add_argument("--report", action="store_true", help="tables of --out's runs-*.json")
    ap.add_argument("--serve", action="store_true", help="issue 38: 4 streams, not pp/tg")
    ap.add_argument("--decode-only", action="store_true", help="tg runs only (no pp / prefill)")
    ap.add_argument(
        "--prompts",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[PROMPT],
        help="prefill lengths (tokens), each timed on both sides: 512,2048",
    )
    ap.add_argument(
        "--cpu-dots",
        type=lambda s: s.split(","),
        default=["auto"],
        help="psr's cpu_dot values, each run per round (psr / psr:f32 / ... in the tables)",
    )
    ap.add_argument(
        "--base",
        type=Path,
        default=None,
        help="another psr source tree (with its built extension) run beside this one in every "
        "round, each cpu_dot (psr@base / psr@base:f32 in the tables): before / after",
    )
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.report:
        docs = [json.loads(p.read_text()) for p in sorted(a.out.glob("runs-*.json"))]
        ovh: dict[str, float] = {}
        for p in sorted(a.out.glob("overhead-*.json")):
            ovh |= json.loads(p.read_text())
        print(report(docs, ovh))
        return
    if a.worker:
        kind, path, threads, reps = a.worker[0], a.worker[1], int(a.worker[2]), int(a.worker[3])
        if kind == "batch":
            print(json.dumps(worker_batch(path, threads, reps)))
        else:
            lens = tuple(
                int(x) for x in os.environ.get("PSR_BENCH_PROMPTS", str(PROMPT)).split(",")
            )
            print(json.dumps(worker(path, threads, reps, kind != "decode", lens)))
        return
    files = {k: v for k, v in make_files(a).items() if a.match in k}
    if a.make_only:
        return
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    if a.overhead:
        ovh = {f"{k}/{t}": llama_overhead(a, p, t) for k, p in files.items() for t in a.threads}
        print(ovh)
        if a.out:
            (a.out / f"overhead-{stamp}.json").write_text(json.dumps(ovh, indent=1) + "\n")
        return
    run_rounds(a, files, stamp)


if __name__ == "__main__":
    main()
