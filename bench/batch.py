"""Batched decode (issue 38): throughput against sequential runs, and determinism.

    OMP_NUM_THREADS=1 python bench/batch.py --threads 1 --out bench/results/batch
        [--models embedded,embedded-gguf,qwen3-gguf] [--row-invariant off,on]
        [--skip throughput|modeled|routing|profile|determinism] [--modeled-residency 0.5,0.25]

throughput   per --models model, on the CPU backend, experts on the CPU (experts_on="cpu",
             psr at its tuned point, residency 0.5), `--threads` CPU threads: for b in
             --batches, b prompts (--prompt-tokens each) decoded --tokens new tokens each,
             side by side in one run, --repeats times (interleaved; ratios within a
             repeat, their median): sequentially with `generate`, with `generate_batch`
             (batch-invariant, the default) and with the plain batched path
             (batch_invariant=False). Models: `embedded` (psr's embedded model, float
             dense: one F.linear per row), `embedded-gguf` (the same written as GGUF by
             scripts/embedded_to_gguf.py, experts and dense matrices Q8_0, dense kept in
             its blocks: QuantLinear, one cpu_linear call for all rows), `qwen3-gguf` (a
             Qwen3-30B-A3B-shaped GGUF with --qwen-layers layers and a vocabulary of
             --qwen-vocab, random weights: bench/cpu_decode.py's writer, Q4_K_M-like
             experts, BF16 dense kept in its blocks; prompts are random ids).
             Aggregate tok/s = b x tokens / wall time (prefill included); per-request
             ms/token: sequential, the mean of each run's own wall time / tokens; batched,
             the batch's wall time / tokens (every request lives for all of it). CPU
             seconds (this process) beside the wall; the load average before and after.
             Differing tokens: against the sequential runs. --row-invariant off,on: each
             model also with `model.set_row_invariant()` (interleaved within each repeat;
             a model that cannot be is skipped with its reason).
determinism  --det-prompts prompts x --det-tokens tokens decoded alone, then inside batches
             of each --det-batches size with random co-runners (the prompts shuffled),
             random join times (each prompt's earliest step uniform in [0, tokens]) and
             random copy delays (PSR_COPY_DELAY-style, up to --delay-us), the members read
             through the shared slab (as on CUDA: copies, runs of rows, spills) with the
             default placement, the store's slots --batch-slots (default: the solo
             slots): the count of tokens that differ from the solo runs.
modeled      the embedded model (standing for OLMoE-1B-7B, as psr.eval's profiles price
             it), experts on the GPU side: its members read through the shared slab (as on
             CUDA); for b in --batches, b prompts decoded together for --tokens steps after
             their prefill, the steps recorded (BatchDecoder.record_trace: per layer step the
             union of the rows' experts, read once, and the slab's copies, each once) and
             priced by psr.eval.latency (host-free) on the rtx4090 and h200 profiles: copies
             per token, modeled ms per batch step (= per-request ms/token) and per token
             (aggregate). The dense work is priced once per step (weight reads dominate at
             small b), as for a speculative verify block. Per --modeled-residency and b,
             the single-sequence slab (slab_slots = the solo slots C) against the
             union-sized one (batch_slots; BatchDecoder's default min(E, b x C)).
routing      per --models model: distinct experts per MoE layer, expert and dense MB per
             token, and the time per step inside the routed experts' call and outside it.
profile      cProfile of a b = 4 batched decode of the embedded model, row-invariant
             forward off and on: dense linears, per-row routing, the expert kernel.
Writes batch.json and batch.md (rewritten after each part; notes.md beside them is by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import write_json

import psr
from psr.models.embedded import heldout_text, tokenizer_of
from psr.runtime.batch import BatchDecoder

WORK = Path("/tmp/psr-bench-batch")  # the written GGUF files (kept: rewritten only if absent)


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
    c = time.process_time()
    for p in ps:
        t = time.perf_counter()
        solo.append(model.generate(p, max_new_tokens=N)[0, len(p) :].tolist())
        times.append(time.perf_counter() - t)
    r: dict[str, Any] = {"sequential": sum(times), "per_request": times}
    r["sequential_cpu"] = time.process_time() - c
    for name, inv in (("batched", True), ("plain", False)):
        t, c = time.perf_counter(), time.process_time()
        got = model.generate_batch(ps, N, batch_invariant=inv)
        r[name] = time.perf_counter() - t
        r[f"{name}_cpu"] = time.process_time() - c
        r[f"{name}_differ"] = _differ(got, solo)
    return r


def _model(name: str, args: argparse.Namespace) -> tuple[psr.OffloadedModel, list[list[int]]]:
    """The model `name` (module docstring), loaded with experts on the CPU, and its prompts."""
    n, P = max(args.batches), args.prompt_tokens
    opts: dict[str, Any] = dict(experts_on="cpu", threads=args.threads, progress=False)
    if name == "embedded":
        return psr.load(psr.DEFAULT_MODEL, "psr", 0.5, **opts), prompts_from_text(n, P, 1)
    WORK.mkdir(parents=True, exist_ok=True)
    if name == "embedded-gguf":
        path = WORK / "embedded-q8.gguf"
        if not path.exists():
            script = Path(__file__).resolve().parent.parent / "scripts" / "embedded_to_gguf.py"
            cmd = [sys.executable, str(script), str(path), "--type", "Q8_0", "--dense", "Q8_0"]
            import subprocess

            subprocess.run(cmd, check=True)
        return psr.load(path, "psr", 0.5, **opts), prompts_from_text(n, P, 1)
    from cpu_decode import write_checkpoint, write_gguf

    path = WORK / f"qwen3-{args.qwen_layers}l-{args.qwen_vocab}v.gguf"
    if not path.exists():
        ckpt = WORK / "qwen3-ckpt"
        write_checkpoint(ckpt, args.qwen_layers, args.qwen_vocab)
        write_gguf(ckpt, path, args.qwen_layers, args.qwen_vocab, "bf16", experts="Q4_K_M")
        import shutil

        shutil.rmtree(ckpt)
    rng = random.Random(1)
    prompts = [[rng.randrange(259, args.qwen_vocab) for _ in range(P)] for _ in range(n)]
    return psr.load(path, "psr", 0.5, **opts), prompts


def throughput(args: argparse.Namespace, out: dict[str, Any], name: str) -> None:
    """Repeats interleave the batch sizes and, inside each, the row-invariant modes and
    the three ways (a loaded machine's load drifts): the ratios are taken within a repeat,
    their median reported, and the times are each way's fastest repeat."""
    model, prompts = _model(name, args)
    N = args.tokens
    modes = [m for m in args.row_invariant if m == "off" or _can_row_invariant(model, name)]
    for mode in modes:
        model.set_row_invariant(mode == "on")
        model.generate(prompts[0], max_new_tokens=4)  # warm-up
    load0 = os.getloadavg()
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {
        (m, b): [] for m in modes for b in args.batches
    }
    for _ in range(args.repeats):
        for b in args.batches:
            for mode in modes:
                model.set_row_invariant(mode == "on")
                runs[mode, b].append(_timed_runs(model, prompts[:b], N))
    model.set_row_invariant(False)
    model.close()
    for mode in modes:
        key = name if mode == "off" else f"{name}, row-invariant forward"
        rows = _rows({b: runs[mode, b] for b in args.batches}, N, key)
        out.setdefault("throughput", {})[key] = {
            "rows": rows, "command": out["command"], "load": [load0, os.getloadavg()],
            "tokens": N, "prompt_tokens": args.prompt_tokens, "threads": args.threads,
        }  # fmt: skip
    write(args, out)


def _can_row_invariant(model: psr.OffloadedModel, name: str) -> bool:
    why = model.row_invariant_blocker()
    if why is not None:
        print(f"{name}: no row-invariant forward ({why})", flush=True)
    return why is None


def _rows(runs: dict[int, list[dict[str, Any]]], N: int, name: str) -> list[dict[str, Any]]:
    rows = []
    for b, rs in runs.items():
        best = {k: min(r[k] for r in rs) for k in ("sequential", "batched", "plain")}
        cpu = {k: min(r[f"{k}_cpu"] for r in rs) for k in ("sequential", "batched", "plain")}
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
            "wall_s": best,
            "cpu_s": cpu,
            "batched_differing_tokens": max(r["batched_differ"] for r in rs),
            "plain_differing_tokens": max(r["plain_differ"] for r in rs),
        })  # fmt: skip
        print(name, rows[-1], flush=True)
    return rows


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
    model = psr.load(psr.DEFAULT_MODEL, "psr", 0.5, threads=args.threads, progress=False,
                     batch_slots=args.batch_slots)  # fmt: skip
    model.runtime.prefill_reads = "slab"  # members through the shared slab, as on CUDA
    prompts = prompts_from_text(args.det_prompts, args.prompt_tokens, 2)
    T = args.det_tokens
    t = time.perf_counter()
    solo = [model.generate(p, max_new_tokens=T)[0, len(p) :].tolist() for p in prompts]
    res: dict[str, Any] = {"prompts": len(prompts), "tokens": T, "solo_s": time.perf_counter() - t,
                           "batch_slots": args.batch_slots}  # fmt: skip
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


def _until_all_decode(dec: BatchDecoder, b: int) -> dict[int, torch.Tensor]:
    """Prefill every queued prompt (feeding the earlier ones greedily meanwhile)."""
    r = dec.ready()
    while len(r) < b:
        dec.feed({s: int(lg.float().argmax()) for s, lg in r.items()})
        r = dec.ready()
    return r


def _greedy_steps(dec: BatchDecoder, r: dict[int, torch.Tensor], steps: int) -> None:
    for _ in range(steps):
        dec.feed({s: int(lg.float().argmax()) for s, lg in r.items()})
        r = dec.ready()


def modeled(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Per residency and b: the same prompts decoded with the single-sequence slab (the
    solo slots, slab_slots=C) and with the union-sized one (the load's batch_slots =
    min(E, max b x C); BatchDecoder's default min(store, b x C)), each recorded and priced."""
    from psr.eval.latency import simulate

    rows = []
    for rho in args.modeled_residency:
        probe = psr.load(psr.DEFAULT_MODEL, "psr", rho, progress=False)
        C, E = probe.runtime.capacity, probe.runtime.spec.num_experts
        probe.close()
        model = psr.load(psr.DEFAULT_MODEL, "psr", rho, threads=args.threads, progress=False,
                         batch_slots=min(E, max(args.batches) * C))  # fmt: skip
        model.runtime.prefill_reads = "slab"  # members through the shared slab, as on CUDA
        prompts = prompts_from_text(max(args.batches), args.prompt_tokens, 1)
        for b in args.batches:
            for slab in ("single", "union"):
                dec = BatchDecoder(model, b, slab_slots=C if slab == "single" else None)
                for p in prompts[:b]:
                    dec.add(p)
                r = _until_all_decode(dec, b)  # the steps recorded all have b rows
                trace = dec.record_trace()
                _greedy_steps(dec, r, args.tokens)
                steps = len(trace.tokens)
                layer_steps = [s for tok in trace.tokens for s in tok]
                union = sum(len(s.experts) for s in layer_steps) / len(layer_steps)
                copies = sum(len(s.copies) for s in layer_steps)
                row: dict[str, Any] = {
                    "residency": rho, "C": C, "slab": slab, "slab_slots": dec.slab.size,
                    "b": b, "steps": steps, "copies_per_token": copies / (steps * b),
                    "experts_read_per_layer_step": union,
                    "spilled": dec.slab.counts["spilled"],
                }  # fmt: skip
                for prof in ("rtx4090", "h200"):
                    res = simulate(trace, prof)
                    row[f"{prof}_ms_per_step"] = res.ms_per_token
                    row[f"{prof}_ms_per_token"] = res.ms_per_token / b
                rows.append(row)
                print("modeled", row, flush=True)
                for s in list(dec.live):
                    dec.remove(s)
        model.close()
    out["modeled"] = {"rows": rows, "command": out["command"], "tokens": args.tokens}
    write(args, out)


def routing(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Per --models model (as throughput loads it) and b: what one batched decode step
    reads, from its rows' routing over --tokens steps: distinct experts per MoE layer, the
    bytes read per token (the distinct experts' rows once per step, the dense weights
    once per step: ideal when memory-bound), and the wall time per step inside the routed
    experts' call (batch_experts) and outside it."""
    res = out.setdefault("routing", {})
    for name in args.models:
        model, prompts = _model(name, args)
        rt = model.runtime
        row_bytes = rt.store.expert_bytes[: len(rt.layers)]
        dense = _dense_bytes(model)
        rows = []
        for b in args.batches:
            dec = BatchDecoder(model, b)
            for p in prompts[:b]:
                dec.add(p)
            r = _until_all_decode(dec, b)
            distinct: list[int] = []
            pairs: list[int] = []
            spent = [0.0]
            inner = dec.compute_experts

            def timed(layer, x, ids, weights, rows_, inner=inner, distinct=distinct,
                      pairs=pairs, spent=spent):  # fmt: skip
                distinct.append(len({e for row in rows_ for e in row.routed}))
                pairs.append(sum(len(row.routed) for row in rows_))
                t = time.perf_counter()
                y = inner(layer, x, ids, weights, rows_)
                spent[0] += time.perf_counter() - t
                return y

            dec.compute_experts = timed  # type: ignore[method-assign]
            t = time.perf_counter()
            _greedy_steps(dec, r, args.tokens)
            wall = time.perf_counter() - t
            L, T = len(rt.layers), args.tokens
            expert_bytes = sum(
                d * row_bytes[i % L] for i, d in enumerate(distinct)
            ) / (T * b)  # fmt: skip
            row = {
                "b": b, "distinct_experts_per_layer": sum(distinct) / len(distinct),
                "routed_per_layer": sum(pairs) / len(pairs),
                "expert_mb_per_token": expert_bytes / 1e6,
                "dense_mb_per_token": dense / b / 1e6,
                "experts_ms_per_step": 1000 * spent[0] / T,
                "other_ms_per_step": 1000 * (wall - spent[0]) / T,
            }  # fmt: skip
            rows.append(row)
            print("routing", name, row, flush=True)
            for s in list(dec.live):
                dec.remove(s)
        model.close()
        res[name] = {"rows": rows, "command": out["command"], "tokens": args.tokens,
                     "load": os.getloadavg()}  # fmt: skip
        write(args, out)


def profile(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Where a batched decode's time goes (cProfile, the embedded model as throughput loads
    it, b = 4, --tokens new tokens, after a warm-up), the row-invariant forward off and on:
    the total, the dense linears (F.linear / cpu_linear), the per-row routing
    (BatchStep.route: routing, cache updates, predictions) and the expert kernel."""
    import cProfile
    import pstats

    from psr.runtime.batch import BatchStep

    model, prompts = _model("embedded", args)
    ps, res = prompts[:4], {}
    route = BatchStep.route.__code__
    for on in (False, True):
        model.set_row_invariant(on)
        model.generate_batch(ps, 4)
        prof = cProfile.Profile()
        prof.enable()
        model.generate_batch(ps, args.tokens)
        prof.disable()
        st = pstats.Stats(prof).stats  # type: ignore[attr-defined]

        def spent(pred: Any, cumulative: bool = False, st: Any = st) -> float:
            return sum(v[3 if cumulative else 2] for k, v in st.items() if pred(k))

        res["on" if on else "off"] = {
            "total_s": max(v[3] for v in st.values()),
            "linear_s": spent(lambda k: k[2] in ("<built-in method torch._C._nn.linear>",
                                                 "<built-in method psr._C.cpu_linear>")),
            "route_s": spent(lambda k: (k[0], k[1]) == (route.co_filename,
                                                       route.co_firstlineno), True),
            "expert_kernel_s": spent(lambda k: k[2] == "<built-in method psr._C.cpu_expert_ffn>"),
        }  # fmt: skip
        print("profile", on, res, flush=True)
    model.close()
    out["profile"] = {"rows": res, "command": out["command"], "tokens": args.tokens}
    write(args, out)


def _dense_bytes(model: psr.OffloadedModel) -> int:
    """Bytes of the dense weights a decode step reads whatever b (the embeddings' b rows
    aside): every parameter and buffer but the input embedding table."""
    hf = model.hf
    emb = hf.get_input_embeddings()
    skip = {id(t) for t in emb.parameters()} | {id(t) for t in emb.buffers()}
    seen: set[int] = set()
    total = 0
    for t in [*hf.parameters(), *hf.buffers()]:
        if id(t) in skip or t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def write(args: argparse.Namespace, out: dict[str, Any]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "batch.json", out)
    lines = []
    for name, t in out.get("throughput", {}).items():
        (l0, l1) = (t["load"][0][0], t["load"][1][0]) if "load" in t else (None, None)
        load = f"; load average {l0:.2f} before, {l1:.2f} after" if l0 is not None else ""
        lines += [
            f"### {name}: {t.get('tokens', 32)} new tokens per request, "
            f"{t.get('prompt_tokens', 32)}-token prompts{load}",
            "",
            f"`{t['command']}`",
            "",
            "| b | sequential tok/s | batched tok/s | plain tok/s | batched / sequential "
            "(median ratio) | invariance cost (median invariant / plain time) | solo "
            "ms/token | batched ms/token | plain ms/token | wall s (seq / batched / plain) "
            "| CPU s (seq / batched / plain) | sequential / batched CPU s | differing tokens "
            "(batched / plain) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in t["rows"]:
            w, c = r.get("wall_s"), r.get("cpu_s")
            ws = "{sequential:.2f} / {batched:.2f} / {plain:.2f}".format(**w) if w else "-"
            cs = "{sequential:.2f} / {batched:.2f} / {plain:.2f}".format(**c) if c else "-"
            cr = f"{c['sequential'] / c['batched']:.2f}x" if c else "-"
            lines.append(
                f"| {r['b']} | {r['sequential_tok_s']:.1f} | {r['batched_tok_s']:.1f} | "
                f"{r['plain_tok_s']:.1f} | {r['speedup_median']:.2f}x | "
                f"{r['plain_over_invariant_median']:.2f}x | {r['solo_ms_per_token']:.1f} | "
                f"{r['batched_ms_per_token']:.1f} | {r['plain_ms_per_token']:.1f} | {ws} | {cs} | "
                f"{cr} | "
                f"{r['batched_differing_tokens']} / {r['plain_differing_tokens']} |"
            )
        lines.append("")
    if "modeled" in out:
        m = out["modeled"]
        lines += _section(
            f"Modeled on the GPU profiles (psr.eval.latency, host-free): the embedded "
            f"model priced as OLMoE-1B-7B, {m['tokens']} recorded batch steps per b; the "
            "single-sequence slab (C slots: the solo capacity) against the union-sized one "
            "(min(E, b x C) slots, LoadConfig.batch_slots); each sequence's cache C slots",
            m["command"],
            ["residency (C)", "slab", "b", "slab slots", "copies / token",
             "experts read / layer step", "spilled", "RTX 4090 ms / step (per request)",
             "RTX 4090 ms / token (aggregate)", "H200 ms / step", "H200 ms / token"],
        )  # fmt: skip
        for r in m["rows"]:
            lines.append(_cells(
                f"{r.get('residency', 0.5)} ({r.get('C', '-')})", r.get("slab", "single"),
                r["b"], r.get("slab_slots", "-"), f"{r['copies_per_token']:.2f}",
                f"{r['experts_read_per_layer_step']:.1f}", r.get("spilled", "-"),
                *(f"{r[k]:.2f}" for k in ("rtx4090_ms_per_step", "rtx4090_ms_per_token",
                                          "h200_ms_per_step", "h200_ms_per_token")),
            ))  # fmt: skip
        lines.append("")
    for name, t in out.get("routing", {}).items():
        lines += _section(
            f"What a batched step reads: {name}, {t['tokens']} steps per b (load "
            f"average {t['load'][0]:.2f})",
            t["command"],
            ["b", "distinct experts / MoE layer", "routed (token, expert) pairs / layer",
             "expert MB / token", "dense MB / token", "total MB / token",
             "experts ms / step", "other ms / step"],
        )  # fmt: skip
        for r in t["rows"]:
            mb = [r["expert_mb_per_token"], r["dense_mb_per_token"]]
            lines.append(_cells(
                r["b"], *(f"{r[k]:.1f}" for k in ("distinct_experts_per_layer",
                                                   "routed_per_layer")),
                *(f"{x:.2f}" for x in [*mb, sum(mb)]),
                *(f"{r[k]:.1f}" for k in ("experts_ms_per_step", "other_ms_per_step")),
            ))  # fmt: skip
        lines.append("")
    if "profile" in out:
        pr = out["profile"]
        lines += _section(
            f"Where a batched step's time goes: the embedded model, b = 4, "
            f"{pr['tokens']} new tokens (cProfile, seconds)",
            pr["command"],
            ["row-invariant forward", "total", "dense linears", "per-row routing (route)",
             "expert kernel"],
        )  # fmt: skip
        for k, r in pr["rows"].items():
            lines.append(
                f"| {k} | {r['total_s']:.2f} | {r['linear_s']:.2f} | {r['route_s']:.2f} | "
                f"{r['expert_kernel_s']:.2f} |"
            )
        lines.append("")
    if "determinism" in out:
        d = out["determinism"]
        n = d.get("batch_slots")
        slab = ("the slab of the solo slots" if n is None else f"batch_slots {n} (each "
                "BatchDecoder's slab: min(batch_slots, b x slots))")  # fmt: skip
        lines += ["", f"`{out['determinism_command']}`", "",
                  f"Determinism: {d['prompts']} prompts x {d['tokens']} tokens, {slab}", "",
                  "| b | differing tokens | of | seconds |", "|---|---|---|---|"]  # fmt: skip
        for k, v in d.items():
            if k[0] == "b" and k[1:].isdigit():
                lines.append(f"| {k[1:]} | {v['differing_tokens']} | {v['of']} | {v['s']:.0f} |")
    (args.out / "batch.md").write_text("\n".join(lines) + "\n")


def _cells(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _section(title: str, command: str, columns: list[str]) -> list[str]:
    """A results section's heading, its command and its table's header."""
    return [f"### {title}", "", f"`{command}`", "", "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns)]  # fmt: skip


MODELS = ("embedded", "embedded-gguf", "qwen3-gguf")
PARTS = ("throughput", "modeled", "routing", "profile", "determinism")


def _models(text: str) -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in MODELS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown model {bad[0]!r}: one of {', '.join(MODELS)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", type=_models, default=["embedded"])
    ap.add_argument("--qwen-layers", type=int, default=2)
    ap.add_argument("--qwen-vocab", type=int, default=8192)
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
    ap.add_argument("--batch-slots", type=int, default=None,
                    help="determinism: the load's batch_slots (default: solo slots)")  # fmt: skip
    ap.add_argument("--skip", choices=PARTS, action="append", default=[])
    ap.add_argument(
        "--row-invariant",
        type=lambda s: s.split(","),
        default=["off"],
        help="throughput with the row-invariant forward off and/or on: off,on",
    )
    ap.add_argument("--modeled-residency", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.5])  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("bench/results/batch"))
    args = ap.parse_args()
    # Each part keeps its own command; a run of one part keeps the other's results.
    old = args.out / "batch.json"
    out: dict[str, Any] = json.loads(old.read_text()) if old.exists() else {}
    if isinstance(out.get("throughput"), list):  # the single-model layout before --models
        out["throughput"] = {"embedded": {"rows": out["throughput"],
                                          "command": out.pop("throughput_command")}}  # fmt: skip
    omp = os.environ.get("OMP_NUM_THREADS")
    env = f"OMP_NUM_THREADS={omp} " if omp else ""
    out["command"] = f"{env}python bench/batch.py " + " ".join(sys.argv[1:])
    if "throughput" not in args.skip:
        for name in args.models:
            throughput(args, out, name)
    if "modeled" not in args.skip:
        modeled(args, out)
    if "routing" not in args.skip:
        routing(args, out)
    if "profile" not in args.skip:
        profile(args, out)
    if "determinism" not in args.skip:
        determinism(args, out)


if __name__ == "__main__":
    main()
