"""Speculative decoding against autoregressive decoding, at equal device memory.

For each residency, on the same held-out material:
* autoregressive baselines (exact, Cache-Prior and PSR at their operating points) with
  all their expert slots;
* speculative configurations (drafter kind, B drafted tokens, `block_k` experts per
  layer and verify block) whose drafter's memory is taken out of the expert slots.

Speed comes from greedy generation on the held-out prompts (real acceptance), traced and
replayed by the latency model: each verify block's dense work priced as one token's, its
experts as its set, the drafter's passes priced per parameter like the target's dense
work (docs/design.md); ms per emitted token. Quality: teacher-forced NLL of held-out
windows scored in verify blocks of B + 1 tokens (`OffloadedModel.score(block=...)`),
paired against exact with BCa intervals, and greedy agreement with exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from psr.eval.defaults import DEFAULT_PROFILES
from psr.eval.harness import EvalData
from psr.eval.latency import drafter_seconds, simulate
from psr.eval.quality import greedy_agreement, paired_bootstrap
from psr.models.loader import load
from psr.points import operating_points
from psr.policy import Policy, make_policy, standard_policies
from psr.runtime.model import OffloadedModel


@dataclass(frozen=True)
class SpecConfig:
    kind: str  # "block" | "ar"
    block: int  # drafted tokens per verify block
    block_k: int  # experts per layer and verify block
    policy: Policy  # lam (bias of the set toward the cache) and n (prefetch)

    @property
    def label(self) -> str:
        return (
            f"spec-{self.kind}(B={self.block}, K_b={self.block_k}, lam={self.policy.lam:g}, "
            f"n={self.policy.n})"
        )


def _nll_items(model: OffloadedModel, data: EvalData, block: int) -> list[float]:
    out = []
    for w in data.windows:
        t = torch.tensor([w])
        logits = model.score(t, data.prompt_len, block=block)[0, data.prompt_len - 1 : -1]
        target = t[0, data.prompt_len :].to(logits.device)
        nll = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
        out.append(float(nll.mean()))
    return out


def _dense_params(model: OffloadedModel) -> int:
    """Parameters the target reads per token besides its experts (they live in the store)."""
    return sum(p.numel() for p in model.hf.parameters() if not p.is_meta)


def _drafter_params(model: OffloadedModel) -> tuple[int, int]:
    """(parameters per pass, passes per block) of the model's drafter."""
    cost: tuple[int, int] = model.drafter.pass_cost
    return cost


def run(
    path: str,
    model: OffloadedModel,
    data: EvalData,
    label: str,
    block: int,
    profiles: Sequence[str],
    progress: bool,
) -> dict[str, Any]:
    """Score the windows and generate from the prompts with one loaded configuration."""
    bar = tqdm(
        total=len(data.windows) + len(data.prompts), desc=label, leave=False, disable=not progress
    )
    nll = []
    for w in data.windows:  # one at a time for the progress bar
        nll += _nll_items(model, EvalData([w], data.prompt_len), block)
        bar.update()
    model.reset_stats()
    rec = model.record_trace()
    gens, accepted, blocks, emitted = [], 0, 0, 0
    for p in data.prompts:
        out = model.generate(p, data.gen_tokens)
        gens.append(out[0, len(p) :].tolist())
        if model.spec_stats is not None:
            st = model.spec_stats
            accepted, blocks, emitted = (
                accepted + st.accepted,
                blocks + st.blocks,
                emitted + sum(st.per_block),
            )
        bar.update()
    bar.close()
    model.runtime.recorder = None
    s = model.stats.report()
    draft = {}
    if model.drafter is not None:
        params, passes = _drafter_params(model)
        draft = {
            p: drafter_seconds(
                p, model.runtime.num_decoder_layers, _dense_params(model), params, passes
            )
            for p in profiles
        }
    steps_emitted = emitted if model.drafter is not None else s["tokens"]
    return {
        "label": label,
        "slots": model.runtime.capacity,
        "nll_items": nll,
        "generated": gens,
        "stats": s,
        "tokens_emitted": steps_emitted,
        "accepted_per_block": accepted / blocks if blocks else None,
        "tokens_per_block": emitted / blocks if blocks else None,
        "copies_per_token": s["copies"] / max(steps_emitted, 1),
        "drafter_ms": {p: v * 1e3 for p, v in draft.items()},
        "latency": {
            p: simulate(rec.trace, p, draft_s=draft.get(p, 0.0)).as_dict() for p in profiles
        },
    }


def compare_speculative(
    path: str,
    residencies: Sequence[float],
    specs: Sequence[SpecConfig],
    data: EvalData,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Autoregressive baselines and speculative configurations per residency (module
    docstring); adds speedups, Δ NLL [BCa CI] and greedy agreement vs exact."""
    rows: list[dict[str, Any]] = []
    for rho in residencies:
        base: list[dict[str, Any]] = []
        for pol in standard_policies(operating_points(path, rho)):
            if pol.name == "exact-prefetch":
                continue
            m = load(path, pol, rho, dtype="float32", progress=False)
            base.append(run(path, m, data, pol.describe(), 1, profiles, progress))
            m.close()
        for sc in specs:
            try:
                m = load(
                    path,
                    sc.policy,
                    rho,
                    dtype="float32",
                    progress=False,
                    speculative=sc.kind,
                    block=sc.block,
                    block_k=sc.block_k,
                )
            except ValueError as e:  # e.g. K_b above the slots the drafter leaves
                print(f"{rho:.1%} {sc.label}: skipped ({e})")
                continue
            base.append(run(path, m, data, sc.label, sc.block + 1, profiles, progress))
            m.close()
        exact = base[0]
        best_ar = min(
            (r for r in base[1:] if not r["label"].startswith("spec-")),
            key=lambda r: r["latency"][profiles[0]]["ms_per_token"],
            default=exact,
        )
        for r in base:
            r["residency"] = rho
            ms = r["latency"][profiles[0]]["ms_per_token"]
            r["speedup_vs_exact"] = exact["latency"][profiles[0]]["ms_per_token"] / ms
            r["speedup_vs_best_ar"] = best_ar["latency"][profiles[0]]["ms_per_token"] / ms
            r["best_ar"] = best_ar["label"]
            r["delta_nll"] = paired_bootstrap(r["nll_items"], exact["nll_items"]).as_dict()
            agree = [
                greedy_agreement(a, b)[0]
                for a, b in zip(r["generated"], exact["generated"], strict=True)
            ]
            r["greedy_agreement"] = sum(agree) / max(len(agree), 1)
        rows += base
    return rows


def markdown(rows: list[dict[str, Any]], profiles: Sequence[str] = DEFAULT_PROFILES) -> str:
    p0 = profiles[0]
    cols = [
        "residency",
        "config",
        "slots",
        "accepted / block",
        "copies / token",
        f"{p0} ms/tok (host-free)",
        "vs exact",
        "vs best AR",
        "Δ nats/tok [95% CI]",
        "greedy agree",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        d = r["delta_nll"]
        acc = r["accepted_per_block"]
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['residency']:.1%}",
                    r["label"],
                    str(r["slots"]),
                    "-" if acc is None else f"{acc:.2f}",
                    f"{r['copies_per_token']:.2f}",
                    f"{r['latency'][p0]['ms_per_token']:.2f}",
                    f"{r['speedup_vs_exact']:.2f}x",
                    f"{r['speedup_vs_best_ar']:.2f}x",
                    f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]",
                    f"{r['greedy_agreement']:.2f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def default_specs(
    top_k: int,
    block: int = 4,
    drafters: Sequence[str] = ("block", "ar"),
    block_ks: Sequence[int] | None = None,
    lams: Sequence[float] = (0.0, 0.2),
) -> list[SpecConfig]:
    """A grid: drafters x K_b (default {k, 1.5k, 2k}) x lam (the set biased as PSR, or
    not at lam 0), prefetching n = 1."""
    kbs = list(block_ks) if block_ks else [top_k, math.ceil(1.5 * top_k), 2 * top_k]
    bad = [kb for kb in kbs if kb < top_k]
    if bad:
        raise ValueError(f"K_b {bad} below the model's top-k {top_k}")
    out = []
    for kind in drafters:
        for kb in kbs:
            for lam in lams:
                out.append(SpecConfig(kind, block, kb, make_policy("psr", lam, 1)))
    return out
