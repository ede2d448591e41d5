"""Evaluation runs: one policy at one residency on held-out text -> counts, modeled
latency and likelihood items; then quality and speed compared with exact (paired
bootstrap intervals). Reports: tables and JSON in `report.py`, figures in `plots.py`.

Used by `psr demo`, `psr eval` and `psr bench sweep` (`runs.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from psr.eval.defaults import DEFAULT_PROFILES
from psr.eval.latency import simulate
from psr.eval.quality import (
    ClozeItem,
    chunks,
    cloze_items,
    cloze_scores,
    greedy_agreement,
    paired_bootstrap,
    perplexity_items,
)
from psr.models.embedded import heldout_sets, tokenizer_of
from psr.models.loader import load
from psr.policy import Policy


@dataclass(frozen=True)
class RunConfig:
    """One evaluated configuration: a policy at a residency."""

    policy: Policy
    residency: float
    expert_format: str | None = None  # None: the model's dtype; else psr.load's formats

    @property
    def label(self) -> str:
        fmt = f" + {self.expert_format}" if self.expert_format else ""
        return self.policy.describe() + fmt

    def as_dict(self) -> dict[str, Any]:
        """`{policy, residency, lam, n, expert_format}` (None where it has none)."""
        p = self.policy.params()
        return {
            "policy": p["policy"],
            "residency": self.residency,
            "lam": p["lam"],
            "n": p["n"],
            "expert_format": self.expert_format,
        }


@dataclass
class EvalData:
    """Token-level benchmark material cut from one held-out set.

    `windows`: teacher-forced windows; the first `prompt_len` tokens of each are
    prefilled, every later one is scored as a decode step under the policy. Counts,
    misses and modeled latency come from this same stream. `prompts` feed greedy
    generation (agreement with exact, reported separately); `cloze` items are scored as
    decode steps too.
    """

    windows: list[list[int]]
    prompt_len: int
    prompts: list[list[int]] = field(default_factory=list)
    gen_tokens: int = 0
    cloze: list[ClozeItem] = field(default_factory=list)
    source: str = ""

    @property
    def scored_tokens(self) -> int:
        return sum(len(w) - self.prompt_len for w in self.windows)

    @classmethod
    def from_text(
        cls,
        tokenizer: Any,
        text: str,
        *,
        windows: int = 160,
        window_tokens: int = 160,
        prompt_tokens: int = 32,
        prompts: int = 4,
        gen_tokens: int = 48,
        cloze: int = 0,
        seed: int = 0,
        source: str = "",
    ) -> EvalData:
        if not 1 <= prompt_tokens < window_tokens:
            raise ValueError(
                f"prompt_tokens must be in [1, window_tokens={window_tokens}), got {prompt_tokens}"
            )
        ids = tokenizer(text)["input_ids"]
        return cls(
            windows=chunks(ids, window_tokens, windows, seed) if windows else [],
            prompt_len=prompt_tokens,
            prompts=chunks(ids, prompt_tokens, prompts, seed + 1) if prompts else [],
            gen_tokens=gen_tokens,
            cloze=cloze_items(ids, cloze, seed=seed + 2) if cloze else [],
            source=source,
        )

    @classmethod
    def from_heldout(cls, path: str, split: str = "A", **kw: Any) -> EvalData:
        """From held-out set `split` ('A': selection, 'B': replication) of a model."""
        sets = heldout_sets(path)
        if split not in sets:
            raise ValueError(f"held-out split must be one of {sorted(sets)}, got {split!r}")
        desc, text = sets[split]
        return cls.from_text(tokenizer_of(path), text, source=desc, **kw)


def run_config(
    path: str,
    rc: RunConfig,
    data: EvalData,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """One config: score the windows (teacher forced, decode path: NLL, counts and the
    trace the latency model replays), generate greedily from the prompts, score cloze."""
    model = load(
        path,
        rc.policy,
        rc.residency,
        dtype="float32",
        expert_format=rc.expert_format,
        progress=False,
    )
    total = len(data.windows) + len(data.prompts) + len(data.cloze)
    bar = tqdm(total=total, desc=rc.label, leave=False, disable=not progress or total == 0)
    rec = model.record_trace()
    nll = perplexity_items(model, data.windows, data.prompt_len, bar) if data.windows else []
    stats = model.stats.report()
    model.runtime.recorder = None
    gens = []
    for p in data.prompts:
        gens.append(model.generate(p, data.gen_tokens)[0, len(p) :].tolist())
        bar.update()
    cz = cloze_scores(model, data.cloze, bar) if data.cloze else []
    bar.close()
    model.close()
    return {
        "config": rc.as_dict(),
        "label": rc.label,
        "stats": stats,
        "latency": {p: simulate(rec.trace, p).as_dict() for p in profiles},
        "generated": gens,
        "nll_items": nll,
        "cloze_items": cz,
        "trace": rec.trace,  # serialised only when a report keeps traces (seconds per run)
    }


def compare(results: list[dict[str, Any]], profiles: Sequence[str] = DEFAULT_PROFILES) -> None:
    """Add speedup, greedy agreement and quality deltas vs `exact` at the same residency,
    in the model's own expert format (the reference every other row is measured against)."""
    exact = {
        r["config"]["residency"]: r
        for r in results
        if r["config"]["policy"] == "exact" and not r["config"].get("expert_format")
    }
    any_exact = next(iter(exact.values()), None)
    for r in results:
        ref = exact.get(r["config"]["residency"], any_exact)
        if ref is None:
            continue
        r["speedup"] = {
            p: ref["latency"][p]["ms_per_token"] / r["latency"][p]["ms_per_token"] for p in profiles
        }
        if r["generated"]:
            agree = [
                greedy_agreement(a, b)
                for a, b in zip(r["generated"], ref["generated"], strict=True)
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
