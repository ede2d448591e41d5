"""Real decoding of an OLMoE-1B-7B-shaped model (random weights) on a GPU, per policy.

    python bench/gpu_decode.py --out bench/results/gpu [--tiny]
    python bench/gpu_decode.py --out bench/results/gpu --modes host,device,graphs [--tiny]

64 experts, top-8, 16 layers, hidden 2048, expert FFN 1024, bf16. The experts go to
pinned host memory; a slab of 64 slots per layer is allocated once and the runs use 64
(calibration: everything resident), 32 (50%) and 16 (25%) of them. For each policy it
measures tokens/s and stall time, records the routing trace, and replays it through
the latency model with a profile calibrated from this machine's measurements, stating
the model's error against the measured time, and the speedup vs exact measured vs
modeled. `--tiny` runs a small shape (the CPU rehearsal of bench/gpu_bench.sh).
DIR/decode.json is rewritten after every run, so a timeout keeps what was done.

`--modes host,device,graphs` measures instead the same model decoding in psr's three
decode modes (host-driven, sync-free eager, one CUDA graph per token): ms/token, CUDA API
calls and kernels per token, host time, the host-free and host-aware latency models, the
modes' agreement; DIR/modes.json and DIR/modes.md (bench/gpu_modes.py says how).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_modes
from common import write_json

import psr_kernels as pk
from psr.eval.labels import pct
from psr.eval.latency import calibrate, simulate
from psr.eval.microbench import run_copy_overlap
from psr.models import DEFAULT_MODEL, offload
from psr.points import operating_points
from psr.policy import Policy, make_policy, standard_policies
from psr.runtime import REPORT_KEYS, TIMING_KEYS


def materialize_rotary(model: torch.nn.Module, device: str) -> None:
    """Rotary frequencies are non-persistent buffers a meta-device build never fills:
    rebuild those modules on the device."""
    for name, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, type(mod)(config=model.config).to(device))


def build(tiny: bool, device: str):
    import transformers

    if tiny:
        cfg = transformers.OlmoeConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=16,
            num_experts_per_tok=4,
            max_position_embeddings=512,
        )
    else:
        cfg = transformers.OlmoeConfig(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=8,
            max_position_embeddings=4096,
        )
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = cfg.hidden_size**-0.5 if name.endswith("mlp.gate.weight") else 0.02
                p.normal_(0, std, generator=g)
    materialize_rotary(model, device)
    return model.eval(), cfg


def triton_check(device: str) -> tuple[str, str | None]:
    """The compute path: "auto" (Triton on CUDA), or "torch" with the reason when Triton
    cannot launch here (its launcher is compiled: it needs a working toolchain)."""
    if device != "cuda":
        return "auto", None
    try:
        xs = torch.randn(1, 64, device=device)
        pk.expert_ffn(
            xs,
            torch.randn(2, 3 * 64 * 16, device=device),
            torch.zeros(1, 1, dtype=torch.long, device=device),
            torch.ones(1, 1, device=device),
            64,
            16,
        )
    except Exception as e:
        error = f"{type(e).__name__}: {e}"[-2000:]
        print(f"the Triton kernel failed ({error[:200]}); decoding with torch", flush=True)
        return "torch", error
    return "auto", None


def time_expert(om, cfg, device: str, compute: str) -> float:
    """ms of one routed expert: the expert FFN over k slots of the slab (all resident)."""
    H, F, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts_per_tok
    slab = om.runtime.store.slab(0)
    x = torch.randn(1, H, device=device, dtype=slab.dtype)
    slots = torch.arange(k, device=device)[None]
    wts = torch.full((1, k), 1.0 / k, device=device)
    ffn = pk.expert_ffn if device == "cuda" and compute == "auto" else pk.expert_ffn_ref
    for _ in range(3):
        ffn(x, slab, slots, wts, H, F, check_slots=False)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        ffn(x, slab, slots, wts, H, F, check_slots=False)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / 20 / k * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument(
        "--tokens", type=int, default=None, help="new tokens per run (48, --modes 32; tiny 8)"
    )
    ap.add_argument("--prompt", type=int, default=32)
    gpu_modes.parser(ap)
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (8 if args.tiny else 32 if args.modes else 48)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, cfg = build(args.tiny, device)
    E = cfg.num_experts
    compute, kernel_error = triton_check(device)
    om = offload(model, "exact", slots=E, compute=compute, progress=True)  # all E slots
    print(
        f"built and offloaded in {time.time() - t0:.0f} s; backend "
        f"{om.runtime.store.backend}, compute {om.runtime.ops.path}",
        flush=True,
    )
    meta = {
        "shape": "tiny" if args.tiny else "OLMoE-1B-7B",
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "backend": om.runtime.store.backend,
        "compute": om.runtime.ops.path,
        "kernel_error": kernel_error,
        "versions": {"torch": torch.__version__, "transformers": transformers_version()},
    }
    expert_ms = time_expert(om, cfg, device, compute)
    if args.modes:
        return gpu_modes.run(om, cfg, args, out, meta, expert_ms)
    return four_policies(om, cfg, args, out, meta, expert_ms, t0)


def four_policies(om, cfg, args, out: Path, meta: dict, expert_ms: float, t0: float) -> int:
    """The four standard policies at 50% and 25% on the host-driven path (the default run):
    measured vs the latency model calibrated from this machine (module docstring)."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    prompt = torch.randint(
        0, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1)
    )
    # Calibration: copy bandwidth (expert_ms: one expert's GEMV), dense time per layer.
    copy = run_copy_overlap(
        (3, cfg.hidden_size, cfg.intermediate_size), 8, 4, 5, backend=om.runtime.store.backend
    )

    def run(policy: Policy, slots_per_layer: int) -> dict:
        om.configure(policy, slots=slots_per_layer)
        om.reset_stats()
        rec = om.record_trace()
        om.generate(prompt, args.tokens)
        s = om.stats.summary()
        return {
            "policy": om.policy.describe(),
            "slots": slots_per_layer,
            "residency": slots_per_layer / E,
            "trace": rec.trace,
            **{key: s[key] for key in REPORT_KEYS + TIMING_KEYS},
        }

    full = run(make_policy("exact"), E)
    token_ms = 1e3 / full["tokens_per_s"]
    dense = max(0.0, (token_ms - len(om.runtime.layers) * k * expert_ms) / cfg.num_hidden_layers)
    profile = calibrate(
        "measured",
        {
            "h2d_gbps": copy.engine_gbps,
            "expert_ms": expert_ms,
            "dense_ms_per_layer": dense,
            "expert_bytes": om.runtime.expert_bytes,
        },
    )
    profile.save(out / "decode_profile.json")
    result = {
        "status": "running",
        **meta,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt,
        "copy": copy.as_dict(),
        "expert_ms": expert_ms,
        "dense_ms_per_layer": dense,
        "calibration_run": {key: v for key, v in full.items() if key != "trace"},
        "runs": [],
    }
    rows = result["runs"]
    for rho_slots in (E // 2, E // 4):
        # The embedded model's operating points at this residency: what the demo shows.
        for policy in standard_policies(operating_points(DEFAULT_MODEL, rho_slots / E)):
            r = run(policy, rho_slots)
            sim = simulate(r.pop("trace"), profile)
            r["measured_ms"] = 1e3 / r["tokens_per_s"] if r["tokens_per_s"] else float("nan")
            r["modeled_ms"] = sim.ms_per_token
            r["modeled_stall_ms"] = sim.stall_ms
            r["lower_bound_ms"] = sim.lower_bound_ms
            r["model_error"] = r["modeled_ms"] / r["measured_ms"] - 1
            rows.append(r)
            add_speedups(rows)
            result["seconds"] = time.time() - t0
            write_json(out / "decode.json", result)
            print(
                f"{pct(r['residency'])} {r['policy']:<26} {r['measured_ms']:7.2f} ms/tok "
                f"(modeled {r['modeled_ms']:.2f}, err {r['model_error']:+.0%}), misses/tok "
                f"{r['misses_per_token']:.1f}, stall {r['stall_s'] * 1e3:.0f} ms",
                flush=True,
            )
    lines = [
        "| residency | policy | measured ms/tok | modeled ms/tok (host-free) | model error | "
        "speedup vs exact | modeled speedup | misses/tok | stall ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {pct(r['residency'])} | {r['policy']} | {r['measured_ms']:.2f} | "
        f"{r['modeled_ms']:.2f} | {r['model_error']:+.1%} | {r['speedup_vs_exact']:.2f}x | "
        f"{r['modeled_speedup_vs_exact']:.2f}x | {r['misses_per_token']:.2f} | "
        f"{r['stall_s'] * 1e3:.0f} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    (out / "decode.md").write_text(table + "\n")
    errs = [abs(r["model_error"]) for r in rows]
    result["checks"] = {"max_abs_model_error": max(errs) if errs else None}
    result["status"] = "complete"
    result["seconds"] = time.time() - t0
    write_json(out / "decode.json", result)
    return 0


def add_speedups(rows: list[dict]) -> None:
    for r in rows:
        base = next((b for b in rows if b["slots"] == r["slots"] and b["policy"] == "exact"), None)
        if base is not None:
            r["speedup_vs_exact"] = base["measured_ms"] / r["measured_ms"]
            r["modeled_speedup_vs_exact"] = base["modeled_ms"] / r["modeled_ms"]


def transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
