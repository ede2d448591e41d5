"""CPU-only greedy decode with an MTP drafter against without one, on a synthetic
Qwen3-30B-A3B-shaped checkpoint (issue 41): the same prompts, the same tokens (asserted),
tok/s side by side in one run.

    OMP_NUM_THREADS=1 python scripts/bench_mtp_synthetic.py --threads 1 \
        --out bench/results/speculative

The checkpoint is Qwen3-30B-A3B's layer shape (hidden 2048, 32 query / 4 KV heads of
128, experts of 768 with top-8 of `--experts`, norm_topk_prob) with `--layers` layers,
`--experts` experts per layer and a `--vocab` vocabulary (scaled down with the depth, so
the LM head keeps roughly its share of a token's reads), random weights as transformers
initialises them. Qwen3-30B has no MTP layer: the drafter is psr's own head format
(models/mtp.py: a dense decoder block over the target's hidden size, the target's
embedding and LM head shared), trained here for `--train-steps` steps at depth 1 on
the synthetic model's own greedy continuations of random prompts (the target's final
hidden states and the next token, as scripts/train_drafters.py trains the embedded
model's head). One model decodes every configuration (the drafter switched on and off
with `set_speculative`), residency 1.0, policy exact, each verify block over all experts
(K_b = E: no token changes); runs are interleaved prompt by prompt, timed by this
process's CPU time and wall time, the fastest of `--reps` each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_mtp_cpu import table_lines  # scripts/ beside this file


def synthetic_model(layers: int, experts: int, vocab: int, seed: int) -> Any:
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=experts, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=1024, tie_word_embeddings=False, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def train_head(target: Any, steps: int, ffn: int, seed: int) -> tuple[Any, dict]:
    """psr's MTP head trained at depth 1 on the target's own greedy continuations."""
    import torch
    import torch.nn.functional as F

    from psr.models.drafters import final_hidden
    from psr.models.mtp import new_psr_head

    c = target.config
    head = new_psr_head(
        c.hidden_size, c.num_attention_heads, ffn, c.rms_norm_eps,
        float(c.rope_parameters["rope_theta"]),
        target.get_output_embeddings().weight, target.get_input_embeddings().weight,
    )  # fmt: skip
    t0 = time.process_time()
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(0, c.vocab_size, (16, 8), generator=gen)
    with torch.no_grad():
        X = target.generate(prompts, max_new_tokens=56, do_sample=False, min_new_tokens=56)
        H = final_hidden(target, X[:, :-1])
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0)
    head.train()
    losses = []
    for _ in range(steps):
        i = torch.randint(0, len(X), (4,), generator=gen)
        _, logits = head(H[i, :-1], X[i, 1:-1], 0, None)  # (h_j, t_{j+1}) -> t_{j+2}
        loss = F.cross_entropy(logits.flatten(0, 1), X[i, 2:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    head.eval().requires_grad_(False)
    info = {"train_steps": steps, "train_cpu_s": round(time.process_time() - t0, 1)}
    info["train_loss_last"] = sum(losses[-5:]) / max(len(losses[-5:]), 1) if losses else None
    return head, info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--blocks", default="1,2,3", help="comma list of drafted tokens per block")
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--head-ffn", type=int, default=1024)
    p.add_argument("--out", default=None, help="folder for mtp_synthetic.{md,json}")
    args = p.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    import psr
    from psr.models.drafters import load_drafter
    from psr.models.mtp import PSR_FILE, psr_head_meta

    torch.set_num_threads(args.threads)
    target = synthetic_model(args.layers, args.experts, args.vocab, seed=0)
    head, info = train_head(target, args.train_steps, args.head_ffn, seed=0)
    tmp = tempfile.TemporaryDirectory(prefix="psr-qwen3-30b-shaped-")
    path = Path(tmp.name)
    target.save_pretrained(path)
    (path / PSR_FILE).parent.mkdir(exist_ok=True)
    meta = psr_head_meta(head, max(int(b) for b in args.blocks.split(",")))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(path / PSR_FILE),
              metadata=meta)  # fmt: skip
    del target, head
    m = psr.load(str(path), "exact", residency=1.0, progress=False, threads=args.threads,
                 device="cpu", dtype="float32")  # fmt: skip
    E = m.runtime.spec.num_experts
    drafters: dict[str, Any] = {"no drafter": None}
    for b in args.blocks.split(","):
        d = load_drafter(str(path), "mtp", int(b), m.hf, torch.device("cpu"), torch.float32)
        drafters[f"mtp, {b} drafted"] = d
    gen = torch.Generator().manual_seed(7)  # held-out prompts: not the training ones
    prompts = [torch.randint(0, args.vocab, (16,), generator=gen).tolist()
               for _ in range(args.prompts)]  # fmt: skip
    m.generate(prompts[0][:8], 4)  # warm-up
    cpu = {k: [float("inf")] * len(prompts) for k in drafters}
    wall = {k: [float("inf")] * len(prompts) for k in drafters}
    acc = {k: [0, 0, 0] for k in drafters}  # accepted, blocks, emitted (first rep)
    for rep in range(args.reps):
        for i, prompt in enumerate(prompts):
            want = None
            for name, d in drafters.items():
                m.set_speculative(d, None if d is None else E)  # K_b = E: exact
                c0, t0 = time.process_time(), time.perf_counter()
                out = m.generate(prompt, args.new)[0, len(prompt) :].tolist()
                wall[name][i] = min(wall[name][i], time.perf_counter() - t0)
                cpu[name][i] = min(cpu[name][i], time.process_time() - c0)
                want = out if want is None else want
                assert out == want, f"{name}: tokens differ from greedy decoding without a drafter"
                if rep == 0 and d is not None:
                    st = m.spec_stats
                    acc[name] = [acc[name][0] + st.accepted, acc[name][1] + st.blocks,
                                 acc[name][2] + sum(st.per_block)]  # fmt: skip
    n = len(prompts) * args.new
    secs = {k: sum(v) for k, v in cpu.items()}
    walls = {k: sum(v) for k, v in wall.items()}
    rows = []
    for name in drafters:
        a, b, e = acc[name]
        rows.append({
            "config": name, "tok_per_cpu_s": n / secs[name],
            "speedup": secs["no drafter"] / secs[name], "tok_per_wall_s": n / walls[name],
            "wall_speedup": walls["no drafter"] / walls[name],
            "accepted_per_block": a / b if b else None, "tokens_per_forward": e / b if b else 1.0,
        })  # fmt: skip
    dense = sum(p.numel() for p in m.hf.parameters() if not p.is_meta)
    shape = (
        f"synthetic Qwen3-30B-A3B-shaped checkpoint: {args.layers} layers (the real one: 48), "
        f"hidden 2048, 32/4 heads of 128, {E} experts of 768 per layer (real: 128), top-8, "
        f"vocab {args.vocab} (real: 151,936); {dense / 1e6:.0f} M dense parameters, "
        f"{E * args.layers * 3 * 2048 * 768 / 1e6:.0f} M in experts; float32"
    )
    cmd = "OMP_NUM_THREADS=1 python scripts/bench_mtp_synthetic.py " + " ".join(sys.argv[1:])
    lines = [
        f"`{cmd}`", "", shape + ".", "",
        f"psr MTP head (d 2048, block FFN {args.head_ffn}) trained {info['train_steps']} steps "
        f"at depth 1 on the model's own greedy text ({info['train_cpu_s']} CPU-s, last loss "
        f"{info['train_loss_last']:.2f}); CPU only, {args.threads} thread(s), exact policy, "
        f"all experts held, K_b = E; {len(prompts)} random prompts x {args.new} new tokens, "
        f"the fastest of {args.reps} runs each; identical tokens in every row (asserted)",
        "", *table_lines(rows, digits=2),
    ]  # fmt: skip
    table = "\n".join(lines)
    print(table)
    m.close()
    tmp.cleanup()
    if args.out:
        o = Path(args.out)
        o.mkdir(parents=True, exist_ok=True)
        (o / "mtp_synthetic.md").write_text(table + "\n")
        payload = {"command": cmd, "shape": shape, "head": info, "rows": rows}
        (o / "mtp_synthetic.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
