"""Prefill on the GPU (issue 36, gpu_bench.sh's prefill stage): time to first token and
prefill tok/s at 512 / 4k-token prompts, the per-expert CPU split off and on, and
layer-major (split on, `set_layer_major`: psr.runtime.streamed), on the
embedded model (bf16 rows; its context is 512, so 504 tokens only) and a synthetic GGUF
(OLMoE-shaped, H 1024 x F 512, 64 experts top-8, 4 layers, Q4_K gate / up, Q6_K down,
Q8_0 dense: bench/prefill.py's file; context 4096).

    python bench/gpu_prefill.py --out DIR            (CUDA)
    python bench/gpu_prefill.py --dry-run [--out DIR] (the CPU, tiny prompts and models:
        the same code path, prefill forced onto the slab path the split applies to,
        threshold 3 unless --threshold: on the CPU a "copy" is a memcpy)

Each model loads at residency 0.25 (the offloaded case: a chunk's used experts do not fit
the slab), prefill chunk 512 (dry run 16). "on" is the split `prefill_threshold` picks
from this machine's costs of this model's own rows, measured here (one expert's copy to
the device: a pinned row's `.to(device)`; one token of it on the CPU kernels:
`ExpertCompute.host_experts`); "off" copies every expert. TTFT is the best of `--reps`
timed `generate(prompt, max_new_tokens=1)` (prefill and the first token, synchronized)
after a warm-up; beside it the prefill copies, the experts the split computed on the CPU
(from the routed ids, psr.runtime.prefill.split_experts) and whether the first token
agrees with the split off; layer-major beside them with what its schedules issued
(copies, prefetches, reads that waited) and whether its first token equals the split
on's (it must: layer-major changes only the order of the work). Before the prompts, the
prefill expert kernels alone (`kernels`): a 512-token chunk of MoE layer 0 by the grouped
Triton GEMM (per expert, as prefill calls it, and once for the chunk) against the
per-expert torch reference, side by side. Fail-soft: an error is
recorded per model and prompt, and the JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from common import write_json  # noqa: E402

RESIDENCY = 0.25


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_s(fn: Callable[[], object], dev: torch.device, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_costs(model: Any) -> dict[str, float]:
    """This machine's copy of one of the model's expert rows and one token of it on the
    CPU kernels (MoE layer 0), seconds."""
    rt = model.runtime
    host, dev = rt.store.host(0), rt.store.device
    x = torch.randn(1, rt.spec.hidden_size)
    ids, w = torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1)
    cpu_s = _median_s(lambda: rt.computes[0].host_experts(x, host, ids, w), dev)
    move = (lambda: host[1].to(dev, non_blocking=True)) if dev.type == "cuda" else host[1].clone
    return {"copy_s": _median_s(move, dev), "cpu_expert_s": cpu_s}


def cpu_experts(model: Any, split: Any, chunk: int, start: int = 0) -> int:
    """(layer, chunk, expert) triples the split computed on the CPU, from the routed ids."""
    from psr.runtime.prefill import split_experts

    n, E = 0, model.runtime.spec.num_experts
    for layer, hist in enumerate(model.runtime.histories()):
        for s in range(start, len(hist), chunk):
            cpu, _ = split_experts(split, layer, torch.tensor(hist[s : s + chunk]), E)
            n += len(cpu)
    return n


def kernels(model: Any, tokens: int, repeats: int, experts: int = 64) -> dict[str, Any]:
    """The prefill expert kernels side by side on the model's own rows (MoE layer 0, up to
    `experts`, at least top-k, staged as a device slab): one chunk of `tokens` bf16 tokens
    routed top-k at random, computed by the per-expert torch reference (`ExpertCompute.row`,
    the path before the grouped GEMM), the grouped GEMM once per expert (as prefill calls it, from
    each expert's slot) and the grouped GEMM once for the whole chunk; median seconds, the
    reference's time over each, and the largest difference from the reference."""
    import psr_kernels as pk

    rt = model.runtime
    spec, compute, dev = rt.spec, rt.computes[0], rt.store.device
    H, F, E, k = (
        spec.hidden_size,
        spec.ffn_size,
        min(spec.num_experts, max(experts, spec.top_k)),
        spec.top_k,
    )
    slab = rt.store.host(0)[:E].to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=g).to(dev, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(dev)
    w = torch.rand(tokens, k, generator=g).to(dev)
    table = rt.layers[0].expert_bias
    bias = None if table is None else table[:E].float().contiguous()
    groups = [(e, *torch.where(ids == e)) for e in range(E)]
    groups = [(e, tok, pos) for e, tok, pos in groups if tok.numel()]
    kw: dict[str, Any] = dict(fmt=compute.expert_format, group_size=compute.group_size)
    kw |= dict(act=spec.act, scale_input=spec.input_scaled, out_dtype=torch.float32)

    def per_expert(kernel: bool) -> torch.Tensor:
        out = torch.zeros(tokens, H, dtype=torch.float32, device=dev)
        for e, tok, pos in groups:
            b, we = None if bias is None else bias[e : e + 1], w[tok, pos][:, None]
            if kernel:
                z = torch.zeros(tok.numel(), 1, dtype=torch.long, device=dev)
                y = pk.grouped_expert_ffn(x[tok], slab[e : e + 1], z, we, H, F, bias=b,
                                          check_slots=False, **kw)  # fmt: skip
            elif spec.input_scaled:  # the reference, as ExpertCompute.weighted_row ran it
                y = compute.row(slab[e], x[tok] * we.to(x.dtype), None if b is None else b[0])
            else:
                y = compute.row(slab[e], x[tok], None if b is None else b[0]) * we
            out.index_add_(0, tok, y.float())
        return out

    def chunk() -> torch.Tensor:
        return pk.grouped_expert_ffn(x, slab, ids, w, H, F, bias=bias, check_slots=False, **kw)

    ref, each, whole = per_expert(False), per_expert(True), chunk()
    t_ref = _median_s(lambda: per_expert(False), dev, repeats)
    t_each = _median_s(lambda: per_expert(True), dev, repeats)
    t_chunk = _median_s(chunk, dev, repeats)
    return {
        "tokens": tokens,
        "experts": E,
        "top_k": k,
        "format": compute.expert_format.kernel_fmt or str(slab.dtype),
        "reference_per_expert_s": t_ref,
        "grouped_per_expert_s": t_each,
        "grouped_chunk_s": t_chunk,
        "ref_over_grouped_per_expert": t_ref / t_each,
        "ref_over_grouped_chunk": t_ref / t_chunk,
        "max_abs_diff_per_expert": float((each - ref).abs().max()),
        "max_abs_diff_chunk": float((whole - ref).abs().max()),
        "ref_max_abs": float(ref.abs().max()),
    }


def ttft(model: Any, ids: torch.Tensor, reps: int) -> tuple[float, list[int]]:
    dev = model.runtime.store.device
    best, out = float("inf"), None
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        out = model.generate(ids.to(model.device), max_new_tokens=1)
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    assert out is not None
    return best, out[0, ids.shape[1] :].tolist()


# The variants timed per prompt: (name, the CPU split on?, layer-major?).
VARIANTS = (("off", False, False), ("on", True, False), ("layer_major", True, True))


def variant(model: Any, ids: torch.Tensor, a: argparse.Namespace, split: Any, lm: bool) -> dict:
    """One variant's TTFT, tok/s, prefill copies, CPU experts and first token; layer-major
    with what its schedules issued (copies, prefetches, reads that waited, summed)."""
    model.set_prefill_split(split)
    model.set_layer_major(lm)
    model.reset_stats()
    s, tok = ttft(model, ids, a.reps)
    row = {
        "ttft_s": s,
        "tok_s": ids.shape[1] / s,
        "prefill_copies": model.stats["prefill_copies"] // a.reps,
        "cpu_experts": cpu_experts(model, split, a.chunk),
        "first_token": tok,
    }
    if lm:
        scheds = model.prefill_schedules
        row["schedule"] = {
            k: sum(x.count(k) for x in scheds) for k in ("copy", "prefetch", "seed", "read")
        } | {"waits": sum(x.waits for x in scheds), "layers": len(scheds)}
    return row


def one_model(path: str, prompts: list[int], a: argparse.Namespace) -> dict[str, Any]:
    import psr
    from psr.machine import PrefillSplit, prefill_threshold

    # graphs off: layer-major prefill runs on the eager KV cache (decode graphs' static one
    # stays chunk-major), so every variant prefills through the same cache
    model = psr.load(path, "exact", RESIDENCY, device=a.device, progress=False, graphs=False)
    model.set_prefill_chunk(a.chunk)
    if a.dry_run:
        model.runtime.prefill_reads = "slab"  # CUDA's path, where the split applies
    costs = measure_costs(model)
    t = prefill_threshold(costs["copy_s"], costs["cpu_expert_s"])
    if a.threshold is not None:  # forced (the dry run: the CPU's copies are memcpys)
        t = a.threshold
    L = len(model.runtime.layers)
    splits = {False: PrefillSplit.off(L), True: PrefillSplit((t,) * L)}
    res: dict[str, Any] = {"costs": costs, "threshold": t, "prompts": {}}
    try:  # the prefill expert kernels alone (fail-soft: the TTFT stages still run)
        # the dry run: 8 tokens over 8 experts, once (the interpreter's GEMMs are slow)
        dry = dict(tokens=8, repeats=1, experts=8) if a.dry_run else {}
        res["kernels"] = kernels(model, **{"tokens": 512, "repeats": 5, **dry})
    except Exception as e:
        res["kernels"] = {"error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for T in prompts:
        if T + 1 > model.context:  # the prompt and its one new token
            res["prompts"][T] = {"skipped": f"beyond the model's context of {model.context}"}
            continue
        ids = torch.randint(0, vocab, (1, T), generator=g)
        model.generate(ids[:, : min(T, 32)].to(model.device), max_new_tokens=1)  # warm-up
        row: dict[str, Any] = {}
        try:
            for name, on, lm in VARIANTS:
                row[name] = variant(model, ids, a, splits[on], lm)
        except Exception as e:  # fail-soft per prompt: the other prompts' rows still count
            res["prompts"][T] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
            continue
        row["same_first_token"] = row["on"]["first_token"] == row["off"]["first_token"]
        # layer-major computes exactly what chunk-major does (the split on both)
        row["layer_major_same_first_token"] = (
            row["layer_major"]["first_token"] == row["on"]["first_token"]
        )
        row["on_over_off_tok_s"] = row["on"]["tok_s"] / row["off"]["tok_s"]
        row["layer_major_over_on_tok_s"] = row["layer_major"]["tok_s"] / row["on"]["tok_s"]
        res["prompts"][T] = row
    model.close()
    return res


def write_gguf(path: Path, tiny: bool) -> None:
    from gguf_files import gguf_tiny_model
    from gguf_files import write_gguf as write

    if tiny:
        model = gguf_tiny_model("olmoe", layers=2, experts=8)
    else:
        model = gguf_tiny_model("olmoe", hidden=1024, ffn=512, layers=4, experts=64)
        model.config.num_experts_per_tok = 8
    model.config.max_position_embeddings = 4096 + 64  # a 4k prompt and its new token
    write(model, path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K", "dense": "Q8_0"})


def _gguf(path: Path, tiny: bool) -> str:
    write_gguf(path, tiny)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prompts", default=None, help="comma-separated (default 512,4096)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dry-run", "--tiny", action="store_true", help="the CPU, tiny")
    ap.add_argument("--threshold", type=int, default=None, help="force it (dry run: 3)")
    ap.add_argument("--models", default="embedded,gguf", help="comma-separated subset")
    a = ap.parse_args()
    if a.dry_run and a.threshold is None:
        a.threshold = 3
    a.device = "cpu" if a.dry_run else "cuda"
    if a.dry_run:  # the kernels stage's Triton kernels on the CPU (before psr imports them)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    a.chunk = 16 if a.dry_run else 512
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_prefill.py: no CUDA device (use --dry-run on the CPU)")
    prompts = [int(p) for p in (a.prompts or ("40" if a.dry_run else "512,4096")).split(",")]
    from psr.models.embedded import DEFAULT_MODEL

    results: dict[str, Any] = {"device": a.device, "chunk": a.chunk, "models": {}}
    tmp = Path(tempfile.mkdtemp(prefix="psr-prefill-"))
    models: dict[str, tuple[str, Callable[[], str]]] = {
        "embedded": ("embedded (bf16 rows)", lambda: DEFAULT_MODEL),
        "gguf": ("GGUF Q4_K_M-like", lambda: _gguf(tmp / "m.gguf", a.dry_run)),
    }
    for key in a.models.split(","):
        if key not in models:
            sys.exit(f"gpu_prefill.py: unknown model {key!r} (embedded, gguf)")
        name, make = models[key]
        try:
            embedded = key == "embedded"
            ps = [min(p, 504) for p in prompts] if embedded else prompts
            results["models"][name] = one_model(make(), sorted(set(ps)), a)
        except Exception as e:  # fail soft: the next model still runs
            results["models"][name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
            write_json(a.out / "prefill.json", results)
        print(name, results["models"][name], flush=True)


if __name__ == "__main__":
    main()
