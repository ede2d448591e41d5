"""What the embedded model's routing looks like on held-out text (its record).

    python bench/model_report.py --out bench/results/model

On held-out set A, teacher forced through the decode path (exact routing): per MoE
layer the expert-usage entropy (normalised: 1 = uniform over all experts), the exact +
LRU hit rate at 50% and 25% residency, and the recall of the next layer's router applied
one layer early (the PSR predictor: of the next layer's top-k, the fraction its top-k
prediction holds). Plus the training curve from train_info.json (plot).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from psr.eval.harness import EvalData
from psr.eval.quality import perplexity_items
from psr.models import DEFAULT_MODEL, load
from psr.runtime.steering import Steering


def usage_and_recall(path: str, data: EvalData) -> dict:
    model = load(path, "exact-prefetch", 0.5, n=8, dtype="float32", progress=False)
    k = model.runtime.spec.top_k
    E = model.runtime.spec.num_experts
    predicted: list[tuple[int, list[list[int]]]] = []

    class Spy(Steering):
        """The spec's rule, recording each next-layer prediction."""

        def predictions(self, layer, residual):
            out = super().predictions(layer, residual)
            predicted.extend((target, ids) for target, _, ids in out)
            return out

    model.runtime.set_steering(Spy(model.runtime))
    rec = model.record_trace()
    perplexity_items(model, data.windows, data.prompt_len)
    layers = len(model.runtime.layers)
    counts = [[0] * E for _ in range(layers)]
    routed: dict[int, list[list[int]]] = {m: [] for m in range(layers)}
    for tok in rec.trace.tokens:
        for step in tok:
            routed[step.layer].append(step.experts)
            for e in step.experts:
                counts[step.layer][e] += 1
    entropy = []
    for c in counts:
        total = sum(c)
        h = -sum(x / total * math.log(x / total) for x in c if x)
        entropy.append(h / math.log(E))
    # Predictions per scored window arrive per layer in window order, as routing does.
    hits = {m: 0 for m in range(1, layers)}
    seen = {m: 0 for m in range(1, layers)}
    cursor = {m: 0 for m in range(1, layers)}
    for layer, rows in predicted:
        for row in rows:
            actual = set(routed[layer][cursor[layer]])
            cursor[layer] += 1
            hits[layer] += len(actual & set(row[:k]))
            seen[layer] += k
    recall = {m: hits[m] / seen[m] for m in hits if seen[m]}
    return {"entropy": entropy, "recall": recall, "tokens": len(rec.trace.tokens)}


def hit_rate(path: str, rho: float, data: EvalData) -> float:
    model = load(path, "exact", rho, dtype="float32", progress=False)
    perplexity_items(model, data.windows, data.prompt_len)
    return float(model.stats["hit_rate"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default="bench/results/model")
    ap.add_argument("--windows", type=int, default=80)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = EvalData.from_heldout(
        args.model, "A", windows=args.windows, window_tokens=160, prompt_tokens=32, prompts=0
    )
    r = usage_and_recall(args.model, data)
    r["hit_rate"] = {f"{rho:g}": hit_rate(args.model, rho, data) for rho in (0.5, 0.25)}
    info = json.loads((Path(args.model) / "train_info.json").read_text())
    r["heldout_loss"] = info["heldout_loss"]
    r["source"] = data.source
    (out / "model.json").write_text(json.dumps(r, indent=1))
    lines = [
        f"Embedded model on {data.source}: {r['tokens']:,} decode-path tokens, exact routing.",
        "",
        f"held-out loss {info['heldout_loss']:.3f} nats/token (all four plays); exact + LRU "
        f"hit rate {r['hit_rate']['0.5']:.3f} at 50%, {r['hit_rate']['0.25']:.3f} at 25%",
        "",
        "| MoE layer | usage entropy (1 = uniform) | next-layer router recall (top-k, one "
        "layer early) |",
        "|---|---|---|",
    ]
    for m, h in enumerate(r["entropy"]):
        rc = r["recall"].get(m)
        lines.append(f"| {m} | {h:.3f} | {'-' if rc is None else f'{rc:.3f}'} |")
    (out / "model.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    train = info["loss_every_50"]
    ax.plot([50 * i for i in range(len(train))], train, lw=0.8, label="train (batch loss)")
    curve = info.get("heldout_curve") or []
    ax.plot([s for s, _ in curve], [v for _, v in curve], "o-", label="held-out (64 windows)")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title("embedded model: training curve")
    ax.set_ylim(top=min(8, max([*train[:3], 5])))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "training.png")
    print(f"wrote {out / 'model.md'}, {out / 'model.json'}, {out / 'training.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
