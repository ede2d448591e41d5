"""What the decode step asks of the host, per decode token and MoE layer, before and after
the sync-free decode step (issue 19).

    python bench/host_path.py --out bench/results/host_path

For exact, cache-prior and psr (the embedded model at its tuned points, residency 0.5,
float32), on the Triton path (under the interpreter: TRITON_INTERPRET=1, set below
before any import) and on the torch path, with decode="host" and decode="device":
  kernels   per MoE layer in psr's MoE path (aten ops + Triton launches + store gathers)
            and per decoder layer outside it (attention, norms, embeddings, lm_head...);
  reads     host reads of device data per decode token, in the MoE path and in the
            generation loop, with their source lines; h2d: tensors built from host data;
  graphs    `torch._dynamo.explain` of one decode forward with the KV cache: graphs and
            graph breaks (the most frequent reasons in the JSON);
  host ms   wall time of psr's router and experts hooks per MoE layer and token (torch
            path only: the interpreter's timing means nothing; a CPU, not a GPU host).
Counts are psr.eval.host_probe.HostProbe's, averaged over the decode tokens after the
first (it also hands the caches over to the device step). "before" is commit 9442c44,
the last one before the rebuild, extracted with `git archive` (no git state changes)
into --before-dir, with this checkout's built extension copied in and the same probe
loaded from this checkout; its runtime has one decode step, the host-driven one, and its
store copies give no reason (CopyReason: the probe logs them as "direct"). The
"transformers" row is the embedded model without psr (its MoE blocks' ops as the MoE
path). Writes host_path.md and host_path.json (with each run's HostSchedule).

    python bench/host_path.py --costs --out bench/results/host_path

instead times the host's own costs of the device step (psr.eval.host_probe.
measure_host_costs: Triton launches and the store's C++ calls stubbed, aten ops timed and
subtracted; exact and psr at their tuned points, Triton path under the interpreter, one
thread) and writes host_costs.md and host_costs.json: the figures the built-in latency
profiles take (psr.eval.latency.MEASURED_HOST).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before torch / triton are imported

import argparse
import enum
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "9442c44"
PROMPT = "ROMEO: But soft, what light through yonder window breaks?"
POLICIES = ("exact", "cache-prior", "psr")
PATHS = ("triton", "torch")
EXPLAIN_TOP = 5


# --- the worker: one code version, in its own process ----------------------------------
def _load_module(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while they are built
    spec.loader.exec_module(mod)
    return mod


def _probe_module() -> Any:
    """psr.eval.host_probe of this checkout, also under the pre-rebuild psr (whose trace
    module lacks HostOp / HostSchedule: they are lent from this checkout's)."""
    import psr.runtime.trace as trace
    import psr.store as store

    if not hasattr(store, "CopyReason"):  # the pre-rebuild store: its copies give no reason
        store.CopyReason = enum.StrEnum("CopyReason", {"DIRECT": "direct"})  # type: ignore[attr-defined]
    if not hasattr(trace, "HostSchedule"):
        now = _load_module("_psr_trace_now", ROOT / "python/psr/runtime/trace.py")
        for name in ("HOST_OP_KINDS", "HostOp", "HostSchedule"):
            setattr(trace, name, getattr(now, name))
    return _load_module("_psr_host_path_now", ROOT / "python/psr/eval/host_probe.py")


def _kv(hf: Any) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def _out_cache(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


def _graph_breaks(hf: Any, ids: Any) -> dict[str, Any]:
    """`torch._dynamo.explain` of one decode forward (after a prefill and a first decode
    forward), with the KV cache."""
    import torch

    kv = _kv(hf)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out = hf(input_ids=ids, use_cache=True)
            for _ in range(2):
                nxt = out.logits[0, -1].argmax().view(1, 1)
                prev = out
                out = hf(input_ids=nxt, use_cache=True, **{kv: _out_cache(prev)})
            nxt = out.logits[0, -1].argmax().view(1, 1)
            torch._dynamo.reset()
            ex = torch._dynamo.explain(hf)(input_ids=nxt, use_cache=True, **{kv: _out_cache(out)})
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    finally:
        torch._dynamo.reset()
    reasons = Counter(str(r.reason).splitlines()[0][:160] for r in ex.break_reasons)
    return {
        "graphs": ex.graph_count,
        "breaks": ex.graph_break_count,
        "ops": sum(len(o) for o in ex.ops_per_graph),
        "reasons": reasons.most_common(EXPLAIN_TOP),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _policy_args(policy: str, points: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return dict(points.get(policy, {}))


def _run_psr(hp: Any, cfg: dict[str, Any], version: str) -> dict[str, Any]:
    import torch

    import psr

    kw: dict[str, Any] = dict(
        dtype="float32",
        compute=cfg["path"],
        progress=False,
        **_policy_args(cfg["policy"], cfg["points"]),
    )
    if version == "after":
        kw["decode"] = cfg["decode"]

    def load() -> Any:
        return psr.load(psr.DEFAULT_MODEL, cfg["policy"], cfg["residency"], **kw)

    model = load()
    rt = model.runtime
    if not hasattr(rt, "step_name"):  # the pre-rebuild runtime: one step, the host-driven one
        type(rt).step_name = "host"
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    t0 = time.perf_counter()
    with hp.HostProbe(model) as probe:
        tokens = model.generate(ids, max_new_tokens=cfg["new_tokens"])
    probe_s = time.perf_counter() - t0
    n_moe, n_dec = len(rt.layers), rt.num_decoder_layers
    pt = probe.per_token(first=1)
    row: dict[str, Any] = {
        "version": version,
        "policy": cfg["policy"],
        "lam": rt.policy.lam,
        "n": rt.policy.n,
        "path": cfg["path"],
        "decode": cfg["decode"] if version == "after" else "host",
        "steps": sorted(set(probe.modes)),
        "moe_layers": n_moe,
        "decoder_layers": n_dec,
        "new_tokens": cfg["new_tokens"],
        "tokens": tokens[0].tolist(),
        "per_token": pt,
        "moe_kernels_per_layer": pt["kernels"] / n_moe,
        "moe_aten_per_layer": pt["aten"] / n_moe,
        "moe_triton_per_layer": pt["triton"] / n_moe,
        "moe_gathers_per_layer": pt["gathers"] / n_moe,
        "store_calls_per_layer": pt["store_calls"] / n_moe,
        "dense_kernels_per_layer": pt["dense_kernels"] / n_dec,
        "reads_moe": pt["reads"],
        "reads_dense": pt["dense_reads"],
        "reads_loop": pt["token_reads"],
        "h2d": pt["h2d"] + pt["dense_h2d"],
        "read_sites": {
            part: {s: c / pt["tokens"] for s, c in probe.read_sites(part, first=1).most_common()}
            for part in ("moe", "dense", "token")
        },
        "uniform": probe.uniform(),
        "op_rates": {
            role: hp.op_rates(hp.merge_ops(cells), cells)
            for role, cells in probe.role_cells().items()
        },
        "schedule": _asdict(probe.schedule()),
        "probe_s": round(probe_s, 1),
    }
    if cfg["path"] == "torch" and cfg["host_ms"]:
        runs = [hp.host_ms_samples(model, ids, cfg["new_tokens"]) for _ in range(cfg["repeats"])]
        samples = sorted(x for run in runs for x in run)
        # The median over every (token, layer) of every run: the machine is shared, and a
        # preempted call should not move the figure.
        row["host_ms_per_layer"] = statistics.median(samples)
        row["host_ms_mean_per_run"] = [sum(r) / len(r) for r in runs]
    if cfg["explain"]:
        model = load()  # a fresh sequence
        row["explain"] = _graph_breaks(model.hf, ids)
    del model
    torch._dynamo.reset()
    return row


def _asdict(x: Any) -> Any:
    from dataclasses import asdict

    return asdict(x)


def _run_transformers(hp: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The embedded model without psr: its MoE blocks' ops as the MoE path."""
    import torch
    import transformers

    import psr
    from psr.runtime import generate as gen

    hf = transformers.AutoModelForCausalLM.from_pretrained(psr.DEFAULT_MODEL, dtype=torch.float32)
    hf.eval()
    tok = transformers.AutoTokenizer.from_pretrained(psr.DEFAULT_MODEL)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    layers = hf.model.layers

    class Plain:  # what _Reads / _Kernels ask of a probe
        inside_launch = False
        current: Any = None

    probe = Plain()
    probe.current = hp.LayerCounts()  # the loop's ops until the next forward
    forwards: list[dict[str, Any]] = []
    this: dict[str, Any] = {}
    inner = hf.forward

    def forward(*a: Any, **k: Any) -> Any:
        this.update(token=probe.current, moe=hp.LayerCounts(), dense=hp.LayerCounts())
        probe.current = this["dense"]
        try:
            return inner(*a, **k)
        finally:
            forwards.append(dict(this))
            probe.current = hp.LayerCounts()

    def enter(*_: Any) -> None:
        probe.current = this["moe"]

    def leave(*_: Any) -> None:
        probe.current = this["dense"]

    hooks = [m.mlp.register_forward_pre_hook(enter) for m in layers]
    hooks += [m.mlp.register_forward_hook(leave) for m in layers]
    hf.forward = forward
    try:
        with hp._Reads(probe), hp._Kernels(probe):
            gen.generate(hf, ids, gen.Settings(max_new_tokens=cfg["new_tokens"]))
    finally:
        for h in hooks:
            h.remove()
        del hf.forward
    decode = forwards[2:]  # the prefill and the first decode forward left out, as for psr
    n = len(decode)
    moe_layers = sum(1 for m in layers if hasattr(m.mlp, "experts"))
    moe_k = sum(f["moe"].kernels for f in decode) / n
    row = {
        "version": "transformers",
        "policy": "-",
        "path": "torch",
        "decode": "-",
        "moe_layers": moe_layers,
        "decoder_layers": len(layers),
        "moe_kernels_per_layer": moe_k / moe_layers,
        "dense_kernels_per_layer": sum(f["dense"].kernels for f in decode) / n / len(layers),
        "reads_moe": sum(len(f["moe"].reads) for f in decode) / n,
        "reads_dense": sum(len(f["dense"].reads) for f in decode) / n,
        "reads_loop": sum(len(f["token"].reads) for f in decode) / n,
        "h2d": sum(f["moe"].h2d + f["dense"].h2d for f in decode) / n,
        "read_sites": {
            "moe": dict(Counter(r for f in decode for r in f["moe"].reads)),
            "dense": dict(Counter(r for f in decode for r in f["dense"].reads)),
            "token": dict(Counter(r for f in decode for r in f["token"].reads)),
        },
    }
    if cfg["explain"]:
        row["explain"] = _graph_breaks(hf, ids)
    return row


def _run_costs(hp: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """measure_host_costs of one policy's device step (launches stubbed); a policy written
    `policy@mode` (psr@hybrid:1, exact@cpu) runs with experts_on=mode (the hand-off's
    store calls stubbed like the others)."""
    from dataclasses import asdict

    import psr

    policy, _, experts_on = cfg["policy"].partition("@")
    model = psr.load(
        psr.DEFAULT_MODEL,
        policy,
        cfg["residency"],
        dtype="float32",
        compute="triton",
        decode="device",
        progress=False,
        experts_on=experts_on or "gpu",
        **_policy_args(policy, cfg["points"]),
    )
    rt = model.runtime
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    costs = hp.measure_host_costs(model, ids, cfg["new_tokens"], cfg["repeats"])
    row = {
        "version": "costs",
        "policy": cfg["policy"],
        "lam": rt.policy.lam,
        "n": rt.policy.n,
        "moe_layers": len(rt.layers),
        "decoder_layers": rt.num_decoder_layers,
        **asdict(costs),
    }
    model.close()
    return row


def worker(args: argparse.Namespace) -> int:
    import torch

    # One intra-op thread: on a shared machine, threads that wait for each other turn
    # host times into noise (10x between runs).
    torch.set_num_threads(1)
    version = args.worker
    hp = _probe_module()
    cfg_all = json.loads(args.config)
    out = Path(args.rows)
    for cfg in cfg_all:
        label = (
            f"{version} {cfg.get('policy', '-')} {cfg.get('path', '-')} {cfg.get('decode', '-')}"
        )
        t0 = time.perf_counter()
        try:
            if cfg["kind"] == "transformers":
                row = _run_transformers(hp, cfg)
            elif cfg["kind"] == "costs":
                row = _run_costs(hp, cfg)
            else:
                row = _run_psr(hp, cfg, version)
        except Exception as e:
            row = {
                "version": version,
                "policy": cfg.get("policy"),
                "path": cfg.get("path"),
                "decode": cfg.get("decode"),
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        row["seconds"] = round(time.perf_counter() - t0, 1)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"[{row['seconds']:7.1f} s] {label}"
            + (f"  ERROR {row['error']}" if "error" in row else ""),
            flush=True,
        )
    return 0


# --- the driver ----------------------------------------------------------------------
def _extract_before(dest: Path) -> None:
    """Commit BEFORE_COMMIT's files in `dest` (git archive: no git state change), with
    this checkout's built extension."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BEFORE_COMMIT], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    built = sorted((ROOT / "python/psr").glob("_C*.so"))
    if not built:
        raise SystemExit("no built extension python/psr/_C*.so in this checkout (pip install -e .)")
    for so in built:
        shutil.copy2(so, dest / "python/psr" / so.name)


def _configs(args: argparse.Namespace, version: str) -> list[dict[str, Any]]:
    import psr
    from psr.points import operating_points  # this checkout's: the same points for both

    points = {
        name: {"lam": p.lam, "n": p.n}
        for name, p in operating_points(psr.DEFAULT_MODEL, args.residency).items()
    }
    decodes = ("host", "device") if version == "after" else ("host",)
    out: list[dict[str, Any]] = []
    for path in args.paths.split(","):
        for policy in args.policies.split(","):
            for decode in decodes:
                out.append(
                    dict(
                        kind="psr",
                        policy=policy,
                        path=path,
                        decode=decode,
                        points=points,
                        residency=args.residency,
                        new_tokens=args.new_tokens,
                        host_ms=not args.no_host_ms,
                        repeats=args.repeats,
                        explain=_explain(args, version, path, policy, decode),
                    )
                )
    if version == "after" and not args.no_transformers:
        out.append(
            dict(kind="transformers", new_tokens=args.new_tokens, explain=not args.no_explain)
        )
    return out


def _explain(args: argparse.Namespace, version: str, path: str, policy: str, decode: str) -> bool:
    """explain runs on the torch path; on the Triton path once (after, psr, device): under
    the interpreter dynamo traces into its numpy code, and it cannot run there."""
    if args.no_explain:
        return False
    if path == "torch":
        return True
    return (version, policy, decode) == ("after", "psr", "device")


def _spawn(version: str, cfgs: list[dict[str, Any]], rows: Path, before_dir: Path) -> list[str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    if version == "before":
        env["PYTHONPATH"] = f"{before_dir / 'python'}:{before_dir}"
        cwd = str(before_dir.parent)  # not this checkout: its psr_kernels/ must not shadow
    else:
        env.pop("PYTHONPATH", None)
        cwd = str(ROOT)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        version,
        "--rows",
        str(rows),
        "--config",
        json.dumps(cfgs),
    ]
    subprocess.run(cmd, env=env, cwd=cwd, check=True)
    shown = [
        _python(),
        "bench/host_path.py",
        "--worker",
        version,
        "--rows",
        str(rows),
        "--config",
        "'[...]'",
    ]
    if version == "before":  # run from elsewhere: absolute paths
        shown[:2] = [sys.executable, str(Path(__file__).resolve())]
        shown = [f"(cd {cwd} && PYTHONPATH={env['PYTHONPATH']}", *shown, ")"]
    return shown


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _explain_cell(row: dict[str, Any]) -> str:
    ex = row.get("explain")
    if ex is None:
        return (
            "not run (Triton path: see after, psr, device)"
            if row["path"] == "triton"
            else "not run"
        )
    if "error" in ex:
        return f"explain failed: {ex['error'][:80]}... (below)"
    return f"{ex['breaks']} ({ex['graphs']} graphs)"


def _label(row: dict[str, Any]) -> str:
    if row["version"] == "transformers":
        return "transformers (no psr)"
    if row["version"] == "before":
        return f"before {BEFORE_COMMIT}"
    return f"after, decode={row['decode']}"


def _ops(ops: list[dict[str, Any]]) -> str:
    """An op list in short: runs of more than 4 launches as their count."""
    out: list[str] = []
    run: list[str] = []

    def flush() -> None:
        out.extend(run if len(run) <= 4 else [f"{len(run)} launches"])
        run.clear()

    for o in ops:
        what = o["what"].split(" @ ")[0]
        if o["kind"] == "launch":
            run.append(f"launch {what}")
            continue
        flush()
        if o["kind"] == "gather":
            out.append(f"gather({o['stream']})")
        elif o["kind"] in ("sync", "h2d"):
            out.append(f"{o['kind']} {what}")
        else:
            out.append(o["kind"] + (f"({what})" if what else ""))
    flush()
    return ", ".join(out)


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = (
        "| path | policy | code | MoE-path kernels / MoE layer (aten + Triton + gathers) "
        "| dense kernels / decoder layer | host reads / token: MoE path + loop | h2d / token "
        "| store calls / MoE layer | graph breaks (`explain`) | host ms / MoE layer |"
    )
    lines = [head, "|" + "---|" * 10]
    order = {"before": 0, "after": 1, "transformers": 2}
    dec = {"host": 0, "device": 1, "-": 2}
    for r in sorted(
        rows,
        key=lambda r: (
            PATHS.index(r["path"]) if r.get("path") in PATHS else 9,
            POLICIES.index(r["policy"]) if r.get("policy") in POLICIES else 9,
            order.get(r["version"], 9),
            dec.get(r.get("decode") or "-", 9),
        ),
    ):
        if "error" in r:
            lines.append(
                f"| {r.get('path')} | {r.get('policy')} | {_label(r)} "
                f"| run failed: {r['error'][:120]} |||||||"
            )
            continue
        if r["version"] == "transformers":
            k = f"{_f(r['moe_kernels_per_layer'])}"
        else:
            k = (
                f"{_f(r['moe_kernels_per_layer'])} ({_f(r['moe_aten_per_layer'])} + "
                f"{_f(r['moe_triton_per_layer'])} + {_f(r['moe_gathers_per_layer'])})"
            )
        policy = (
            r["policy"]
            if r["version"] == "transformers"
            else f"{r['policy']} (lam={r['lam']:g}, n={r['n']})"
        )
        reads = f"{_f(r['reads_moe'])} + {_f(r['reads_loop'], 0)}"
        if r.get("reads_dense"):
            reads += f" (+ {_f(r['reads_dense'])} dense)"
        lines.append(
            f"| {r['path']} | {policy} | {_label(r)} | {k} | {_f(r['dense_kernels_per_layer'])} "
            f"| {reads} | {_f(r['h2d'])} | {_f(r.get('store_calls_per_layer'))} "
            f"| {_explain_cell(r)} | {_f(r.get('host_ms_per_layer'), 3)} |"
        )
    return lines


def report(
    rows: list[dict[str, Any]], args: argparse.Namespace, commands: list[str], meta: dict[str, Any]
) -> str:
    out = [
        "# The host's work per decode token: before and after the sync-free decode step",
        "",
        f"Embedded model ({meta['moe_layers']} MoE layers of {meta['decoder_layers']} decoder "
        f"layers), residency {args.residency}, float32, {args.new_tokens} new tokens, the prompt "
        f"{PROMPT!r}; counts averaged over the decode tokens after the first. Code: "
        f"{meta['head']}{' + uncommitted changes' if meta['dirty'] else ''} (after), "
        f"{BEFORE_COMMIT} (before). Triton path under the interpreter (TRITON_INTERPRET=1); "
        "the store on its CPU backend. The same calls read, copy and launch on a GPU; only "
        "what each costs differs. Not counted here: `models/hf.py`'s device-wide "
        "`torch.cuda.synchronize()` per host-path forward on CUDA (the CPU backend skips it).",
        "",
        *table(rows),
        "",
        "Columns: kernels in psr's router and experts hooks per MoE layer (aten ops that are "
        "not views or allocations, Triton launches, store gathers); dense: every other eager "
        "op of the decode forward (attention, norms, residual adds, embeddings, lm_head, the "
        "MoE block's glue) over all decoder layers; host reads: reads of device data in the MoE "
        "path + the generation loop's read of the new token; h2d: tensors built from host data; "
        "store calls: enqueue_copies, acquire, release, gather, join; graph breaks: "
        "`torch._dynamo.explain` of one decode forward with the KV cache (graphs = breaks + 1 "
        "when nothing is skipped); host ms: wall time in psr's hooks per MoE layer and token, "
        f"the median over every decode token and MoE layer of {args.repeats} runs (each run's "
        "mean in the JSON), on this machine's CPU (one intra-op thread), shared with other "
        "work (torch path only; there the hooks also compute the experts).",
        "",
        "## Host reads in the MoE path, per decode token",
        "",
    ]
    for r in rows:
        if "error" in r or r["version"] == "transformers":
            continue
        sites = r["read_sites"]["moe"]
        if not sites:
            continue
        out.append(f"- {r['path']} {r['policy']}, {_label(r)}:")
        out += [f"  - {c:g} x `{s}`" for s, c in sites.items()]
    out += ["", "The generation loop's read per token:", ""]
    loop = Counter()
    for r in rows:
        if "error" not in r and r["version"] != "transformers":
            loop.update(r["read_sites"].get("token", {}).keys())
    out += [f"- `{s}` ({c} runs)" for s, c in loop.most_common()]
    out += ["", "## Host schedules (psr.eval.host_probe.HostProbe.schedule), psr", ""]
    for r in rows:
        if "error" in r or r["version"] == "transformers" or r["policy"] != "psr":
            continue
        s = r["schedule"]
        out.append(f"- {r['path']}, {_label(r)} (every cell alike: {r['uniform']})")
        out.append(f"  - moe_layer ({len(s['moe_layer'])} ops): {_ops(s['moe_layer'])}")
        out.append(
            f"  - last_moe_layer ({len(s['last_moe_layer'])} ops): {_ops(s['last_moe_layer'])}"
        )
        out.append(f"  - token: {_ops(s['token'])}; dense_launches {s['dense_launches']:.2f}")
    out += [
        "",
        "## Graph breaks: reasons (the most frequent; explain names one for some breaks only)",
        "",
    ]
    for r in rows:
        ex = r.get("explain") or {}
        if "error" in ex:
            out.append(f"- {r['path']} {r['policy']}, {_label(r)}: explain failed: `{ex['error']}`")
        if ex.get("reasons"):
            out.append(
                f"- {r['path']} {r['policy']}, {_label(r)}: "
                + "; ".join(f"{c} x {why}" for why, c in ex["reasons"])
            )
    out += ["", "## Commands", "", "```", *commands, "```", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/host_path")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument(
        "--policies", default=",".join(POLICIES), help="--costs also takes policy@experts_on"
    )
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--repeats", type=int, default=5, help="host-time runs")
    ap.add_argument("--before-dir", default="/tmp/before")
    ap.add_argument("--no-before", action="store_true")
    ap.add_argument("--no-explain", action="store_true")
    ap.add_argument("--no-host-ms", action="store_true")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--render", metavar="JSON", help="rewrite the .md of a run's host_path.json")
    ap.add_argument("--costs", action="store_true", help="time the host's own costs instead")
    ap.add_argument("--rounds", type=int, default=3, help="--costs: rounds over the policies")
    ap.add_argument("--worker", choices=("before", "after"), help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.render:
        return render(Path(args.render))
    if args.costs:
        return costs_main(args, argv)
    if args.new_tokens < 3:
        raise SystemExit("--new-tokens must be >= 3 (two decode forwards after the first)")

    out = Path(args.out).resolve()  # the before worker runs elsewhere
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    rows_file.unlink(missing_ok=True)
    before_dir = Path(args.before_dir).resolve()
    meta = _code_state()  # the code measured: others may change the tree meanwhile
    commands = [
        " ".join([_python(), "bench/host_path.py", *(argv if argv is not None else sys.argv[1:])])
    ]
    versions = ["after"] if args.no_before else ["before", "after"]
    if "before" in versions:
        _extract_before(before_dir)
        commands.append(
            f"git archive {BEFORE_COMMIT} | tar -x -C {before_dir}; "
            f"cp python/psr/_C*.so {before_dir}/python/psr/"
        )
    for version in versions:
        shown = _spawn(version, _configs(args, version), rows_file, before_dir)
        commands.append(" ".join(shown))
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    rows_file.unlink()
    good = next(r for r in rows if "error" not in r)
    meta.update(
        moe_layers=good["moe_layers"], decoder_layers=good["decoder_layers"], commands=commands
    )
    result = out / "host_path.json"
    result.write_text(json.dumps({"meta": meta, "args": vars(args), "rows": rows}, indent=1) + "\n")
    return render(result)


def costs_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """--costs: measure_host_costs per policy in one worker; host_costs.{json,md}."""
    import psr
    from psr.points import operating_points

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    rows_file.unlink(missing_ok=True)
    meta = _code_state()
    points = {
        name: {"lam": p.lam, "n": p.n}
        for name, p in operating_points(psr.DEFAULT_MODEL, args.residency).items()
    }
    cfgs = [
        dict(
            kind="costs",
            policy=policy,
            residency=args.residency,
            points=points,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
        )
        for _ in range(args.rounds)
        for policy in args.policies.split(",")
    ]
    commands = [
        " ".join([_python(), "bench/host_path.py", *(argv if argv is not None else sys.argv[1:])])
    ]
    commands.append(" ".join(_spawn("after", cfgs, rows_file, Path(args.before_dir))))
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    rows_file.unlink()
    meta.update(commands=commands, machine=_machine(), uptime=_uptime())
    summary = costs_summary(rows)
    result = out / "host_costs.json"
    d = {"meta": meta, "args": vars(args), "rows": rows, "summary": summary}
    result.write_text(json.dumps(d, indent=1) + "\n")
    md = costs_report(rows + list(summary.values()), args, meta)
    (out / "host_costs.md").write_text(md)
    print(md)
    return 0


def costs_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy, its least-contended round: the one with the smallest MoE-layer figure,
    whole (what the profiles take). On the shared VM a round's figures move together
    between two states (~95 vs ~150 µs per MoE layer), so the faster round is the host's
    own cost and the slower one the neighbours' load."""
    out: dict[str, dict[str, Any]] = {}
    for policy in dict.fromkeys(r["policy"] for r in rows if "error" not in r):
        rs = [r for r in rows if r.get("policy") == policy and "error" not in r]
        best = min(rs, key=lambda r: r["moe_layer_us"])
        out[policy] = dict(best, policy=f"{policy}: fastest of {len(rs)} rounds")
    return out


def _machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, Python {platform.python_version()}"


def _uptime() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def costs_report(rows: list[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    head = (
        "| policy | psr hooks / MoE layer (µs) | dense / decoder layer (µs) | loop / token (µs) "
        "| hand-over `begin` (µs) | first decode forward: hooks / MoE layer (µs) "
        "| aten launches subtracted: MoE layer, decoder layer, token (at µs each) |"
    )
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('policy')} | run failed: {r['error'][:160]} ||||||")
            continue
        w = r["raw"]
        lines.append(
            f"| {r['policy']} (lam={r['lam']:g}, n={r['n']}) | {r['moe_layer_us']:.1f} "
            f"| {r['dense_layer_us']:.1f} | {r['token_us']:.1f} | {r['begin_us']:.0f} "
            f"| {r['first_token_moe_layer_us']:.1f} "
            f"| {w['moe_aten_launches']:g}, {w['dense_aten_launches']:.1f}, "
            f"{w['token_aten_launches']:g} (at {w['aten_op_us']:.2f}) |"
        )
    return "\n".join(
        [
            "# The host's own costs of the device decode step, launches stubbed",
            "",
            f"Embedded model, residency {args.residency}, float32, decode='device', the Triton "
            f"path under the interpreter with every Triton launch returning at once and the "
            f"store's C++ copy / acquire / release / gather / join (and cpu_experts / "
            f"cpu_join) calls doing nothing "
            f"(psr.eval.host_probe.measure_host_costs); {args.new_tokens} new tokens x "
            f"{args.repeats} runs, the thread's CPU time (not wall time: the machine is "
            f"shared), the 10th percentile over the decode forwards after the first (and MoE "
            f"layers; medians in the JSON); aten ops (the launches the latency model prices "
            f"at launch_us) counted in one run under a dispatch mode and subtracted "
            f"at the cost of a small aten op on this machine (psr.eval.host_probe.aten_op_us: "
            f"add, mul, linear, softmax, sum on tiny tensors, the fastest of 7 loops). "
            f"Machine: {meta['machine']}, one intra-op "
            f"thread, load {meta['uptime']} (shared). Code: {meta['head']}"
            f"{' + uncommitted changes' if meta['dirty'] else ''}.",
            "",
            *lines,
            "",
            "psr hooks: psr's router and experts hooks (the decode_step, expert_ffn and store "
            "wrappers, the step's glue); dense: the forward outside them per decoder layer "
            "(transformers' decoder layers, embeddings, lm_head and psr's forward wrapper, "
            "over the decoder layers); loop: the generation loop between forwards; begin: the "
            "device step taking the host caches over (a sequence's first decode token; here "
            "its row copies are CPU copies).",
            "",
            "## Commands",
            "",
            "```",
            *meta["commands"],
            "```",
            "",
        ]
    )


def render(result: Path) -> int:
    """host_path.md beside a run's host_path.json (host_costs.md beside host_costs.json);
    the table printed."""
    d = json.loads(result.read_text())
    if result.name == "host_costs.json":
        d["summary"] = costs_summary(d["rows"])
        result.write_text(json.dumps(d, indent=1) + "\n")
        args = argparse.Namespace(**d["args"])
        md = costs_report(d["rows"] + list(d["summary"].values()), args, d["meta"])
        (result.parent / "host_costs.md").write_text(md)
        print(md)
        return 0
    md = report(d["rows"], argparse.Namespace(**d["args"]), d["meta"]["commands"], d["meta"])
    (result.parent / "host_path.md").write_text(md)
    print("\n".join(table(d["rows"])))
    print(f"\nwrote {result.parent / 'host_path.md'} and {result}")
    return 0


def _python() -> str:
    exe = Path(sys.executable)
    return str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else str(exe)


def _code_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *a], capture_output=True, text=True
        ).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"head": git("rev-parse", "--short", "HEAD"), "dirty": bool(dirty)}


if __name__ == "__main__":
    sys.exit(main())
