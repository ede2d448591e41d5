"""Evaluation runs: one policy at one residency on held-out text -> counts, modeled
latency and likelihood items; then quality and speed compared with exact (paired
bootstrap intervals). Reports (tables, JSON, plots) are in `report.py`.

Used by `psr demo`, `psr eval` and `psr bench sweep` (`runs.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from psr.eval.latency import simulate
from psr.eval.quality import (
    chunks,
    cloze_items,
    cloze_scores,
    greedy_agreement,
    paired_bootstrap,
    perplexity_items,
)
from psr.models.loader import load
from psr.policy import Policy

DEFAULT_PROFILES = ("rtx4090", "h200")


@dataclass(frozen=True)
class RunConfig:
    """One evaluated configuration: a policy at a residency."""

    policy: Policy
    residency: float

    @property
    def label(self) -> str:
        return self.policy.describe()

    def as_dict(self) -> dict[str, Any]:
        """`{policy, residency, lam, n}` (lam / n None where the policy has none)."""
        p = self.policy.params()
        return {"policy": p["policy"], "residency": self.residency, "lam": p["lam"], "n": p["n"]}


@dataclass
class EvalData:
    """Token-level benchmark material cut from held-out text."""

    prompts: list[list[int]]
    gen_tokens: int
    windows: list[list[int]] = field(default_factory=list)
    prompt_len: int = 32
    cloze: list = field(default_factory=list)

    @classmethod
    def from_text(
        cls,
        tokenizer: Any,
        text: str,
        *,
        prompts: int = 4,
        prompt_tokens: int = 32,
        gen_tokens: int = 48,
        windows: int = 16,
        window_tokens: int = 96,
        cloze: int = 0,
        seed: int = 0,
    ) -> EvalData:
        ids = tokenizer(text)["input_ids"]
        half = len(ids) // 2  # prompts/windows from the first half, cloze from the second
        return cls(
            prompts=chunks(ids[:half], prompt_tokens, prompts, seed + 1),
            gen_tokens=gen_tokens,
            windows=chunks(ids[:half], window_tokens, windows, seed) if windows else [],
            prompt_len=prompt_tokens,
            cloze=cloze_items(ids[half:], cloze, seed=seed) if cloze else [],
        )


def run_config(
    path: str,
    rc: RunConfig,
    data: EvalData,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """Decode the prompts (traced), then score the likelihood items, under one config."""
    model = load(path, rc.policy, rc.residency, dtype="float32", progress=False)
    rec = model.record_trace()
    gens = []
    for p in data.prompts:
        out = model.generate(p, data.gen_tokens)
        gens.append(out[0, len(p) :].tolist())
    stats = model.stats.report()
    model.runtime.recorder = None
    total = len(data.windows) + len(data.cloze)
    bar = tqdm(total=total, desc=rc.label, leave=False, disable=not progress or total == 0)
    nll = perplexity_items(model, data.windows, data.prompt_len, bar) if data.windows else []
    cz = cloze_scores(model, data.cloze, bar) if data.cloze else []
    bar.close()
    return {
        "config": rc.as_dict(),
        "label": rc.label,
        "stats": stats,
        "latency": {p: simulate(rec.trace, p).as_dict() for p in profiles},
        "generated": gens,
        "nll_items": nll,
        "cloze_items": cz,
        "trace": rec.trace.to_json(),
    }


def compare(results: list[dict[str, Any]], profiles: Sequence[str] = DEFAULT_PROFILES) -> None:
    """Add speedup, greedy agreement and quality deltas vs `exact` at the same residency."""
    exact = {r["config"]["residency"]: r for r in results if r["config"]["policy"] == "exact"}
    any_exact = next(iter(exact.values()), None)
    for r in results:
        ref = exact.get(r["config"]["residency"], any_exact)
        if ref is None:
            continue
        r["speedup"] = {
            p: ref["latency"][p]["ms_per_token"] / r["latency"][p]["ms_per_token"] for p in profiles
        }
        agree = [
            greedy_agreement(a, b) for a, b in zip(r["generated"], ref["generated"], strict=True)
        ]
        r["greedy_agreement"] = sum(a for a, _ in agree) / len(agree)
        r["first_divergence"] = [f for _, f in agree]
        if r["nll_items"]:
            r["nll"] = sum(r["nll_items"]) / len(r["nll_items"])
            r["delta_nll"] = paired_bootstrap(r["nll_items"], ref["nll_items"]).as_dict()
        if r["cloze_items"]:
            r["cloze_acc"] = sum(r["cloze_items"]) / len(r["cloze_items"])
            pts = [100 * x for x in r["cloze_items"]]
            r["delta_cloze_pts"] = paired_bootstrap(
                pts, [100 * x for x in ref["cloze_items"]]
            ).as_dict()
