"""Speculative decoding against autoregressive decoding, at equal device memory.

For each residency, on the same held-out material:
* autoregressive baselines (exact, and the tuned PSR point with its misses copied, on the
  CPU, or hybrid) with all their expert slots;
* speculative configurations (drafter kind, B drafted tokens, the verify rule: 'budget'
  with `block_k` experts per layer and verify block, or 'cpu:M' with each token's own
  top-k and at most M misses copied per layer and block; runtime/verify.py) whose
  drafter's memory is taken out of the expert slots.

Speed comes from greedy generation on the held-out prompts (real acceptance), traced and
replayed by the latency model (host-free): each verify block's dense work priced as one
token's, its slab experts each read once, its CPU experts each read once from host memory
(the grouped CPU kernel's one weight read for the tokens sharing an expert), the
drafter's passes priced per parameter like the target's dense work (docs/design.md); ms
per emitted token, compared per profile with the fastest autoregressive row. Quality:
teacher-forced NLL of held-out windows scored in verify blocks of B + 1 tokens
(`OffloadedModel.score(block=...)`), paired against exact with BCa intervals (in budget:
the upper bound within psr.eval.defaults.BUDGET), and greedy agreement with exact.

Host-aware (`host=True`): each configuration's host schedule is measured from a real
decode on psr's GPU path (the Triton kernels; needs CUDA or TRITON_INTERPRET=1) by
psr.eval.host_probe.measure_schedule: autoregressive rows on the device step (launches
counted, not run, without a GPU), priced eager and as CUDA graphs (`latency_graph`, CUDA's
default); speculative rows on their verify blocks (the host-driven step: graphs refuse
them), run for real. `latency_host` holds the eager figures (psr.eval.latency's module
docstring says how a verify block is priced).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from psr.eval.defaults import BUDGET, DEFAULT_PROFILES
from psr.eval.harness import EvalData
from psr.eval.latency import drafter_seconds, simulate
from psr.eval.quality import greedy_agreement, paired_bootstrap
from psr.models.loader import load
from psr.points import operating_points
from psr.policy import DEFAULT_VERIFY, Policy, make_policy
from psr.runtime.model import OffloadedModel
from psr.runtime.trace import HostSchedule
from psr.vocab import parse_verify

# Prompt tokens a schedule measurement prefills (the schedule does not depend on them).
SCHEDULE_PROMPT_TOKENS = 8


@dataclass(frozen=True)
class ARConfig:
    """An autoregressive baseline: a policy and where its misses are computed."""

    policy: Policy
    experts_on: str = "gpu"

    @property
    def label(self) -> str:
        where = "" if self.experts_on == "gpu" else f" experts {self.experts_on}"
        return self.policy.describe() + where

    def options(self) -> dict[str, Any]:
        return {"experts_on": self.experts_on}


@dataclass(frozen=True)
class SpecConfig:
    kind: str  # "block" | "ar" | "mtp" | "oracle" (the drafter)
    block: int  # drafted tokens per verify block
    block_k: int | None  # verify='budget': experts per layer and verify block
    policy: Policy  # lam (the bias toward the cache) and n (prefetch)
    verify: str = DEFAULT_VERIFY  # 'budget' | 'cpu' | 'cpu:M' (psr.vocab.parse_verify)
    experts_on: str = "gpu"

    @property
    def label(self) -> str:
        mode, m = parse_verify(self.verify)
        how = f"K_b={self.block_k}" if mode == "budget" else f"cpu M={'top-k' if m is None else m}"
        where = "" if self.experts_on == "gpu" else f", experts {self.experts_on}"
        return (
            f"spec-{self.kind}(B={self.block}, {how}, lam={self.policy.lam:g}, "
            f"n={self.policy.n}{where})"
        )

    def options(self) -> dict[str, Any]:
        if self.kind == "oracle":  # attached after loading (_measure)
            return {"experts_on": self.experts_on}
        return {
            "speculative": self.kind,
            "block": self.block,
            "block_k": self.block_k,
            "verify": self.verify,
            "experts_on": self.experts_on,
        }


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


class OracleDrafter:
    """An upper bound, not a drafter one can ship: drafts the exact model's greedy
    continuation of each prompt (exact routing's generated tokens), for free (no memory, no
    time). Under exact verification every draft is accepted; what remains is the verify
    blocks' own cost."""

    kind, memory_bytes = "oracle", 0
    pass_cost = (0, 0)  # drafting reads nothing

    def __init__(self, block: int, references: Sequence[list[int]]) -> None:
        self.block, self.refs = block, [list(r) for r in references]

    def reset(self) -> None:
        pass

    def propose(self, tokens: list[int], hidden: torch.Tensor | None) -> list[int]:
        ref = next((r for r in self.refs if r[: len(tokens)] == tokens), [])
        nxt = ref[len(tokens) : len(tokens) + self.block]
        return nxt + [0] * (self.block - len(nxt))


def _drafter_params(model: OffloadedModel) -> tuple[int, int]:
    """(parameters per pass, passes per block) of the model's drafter."""
    cost: tuple[int, int] = model.drafter.pass_cost
    return cost


def _generate(model: OffloadedModel, data: EvalData) -> tuple[list[list[int]], int, int]:
    """Greedy generation from every prompt: (tokens, drafts accepted, verify blocks)."""
    gens, accepted, blocks = [], 0, 0
    for p in data.prompts:
        out = model.generate(p, data.gen_tokens)
        gens.append(out[0, len(p) :].tolist())
        if model.spec_stats is not None:
            accepted += model.spec_stats.accepted
            blocks += model.spec_stats.blocks
    return gens, accepted, blocks


def run(
    path: str,
    model: OffloadedModel,
    data: EvalData,
    label: str,
    block: int,
    profiles: Sequence[str],
    progress: bool,
    schedule: HostSchedule | None = None,
) -> dict[str, Any]:
    """Score the windows and generate from the prompts with one loaded configuration;
    with the configuration's measured `schedule`, its host-aware latency too."""
    nll = []
    for w in tqdm(data.windows, desc=label, leave=False, disable=not progress):
        nll += _nll_items(model, EvalData([w], data.prompt_len), block)
    model.reset_stats()
    rec = model.record_trace()
    gens, accepted, blocks = _generate(model, data)
    model.runtime.recorder = None
    s = {**model.stats.report(), "cpu_experts": model.stats["cpu_experts"]}
    draft = {}
    if model.drafter is not None:
        params, passes = _drafter_params(model)
        dense = _dense_params(model)
        layers = model.runtime.num_decoder_layers
        draft = {p: drafter_seconds(p, layers, dense, params, passes) for p in profiles}
    # Emitted tokens: the trace's (a verify block's count each), else one per decode step.
    emitted = sum(rec.trace.emitted) if model.drafter is not None else s["tokens"]
    n = max(emitted, 1)
    host = {}
    if schedule is not None:
        rec.trace.host = schedule
        host = {"host_mode": schedule.mode, "latency_host": {}, "latency_graph": {}}
        for p in profiles:
            d = draft.get(p, 0.0)
            host["latency_host"][p] = simulate(rec.trace, p, draft_s=d, host=True).as_dict()
            if schedule.mode == "device":  # CUDA's default: one captured graph per token
                g = simulate(rec.trace, p, host=True, graph=True)
                host["latency_graph"][p] = g.as_dict()
    return {
        **host,
        "label": label,
        "slots": model.runtime.capacity,
        "nll_items": nll,
        "generated": gens,
        "stats": s,
        "tokens_emitted": emitted,
        "accepted_per_block": accepted / blocks if blocks else None,
        "tokens_per_block": emitted / blocks if blocks else None,
        "copies_per_token": s["copies"] / n,
        "cpu_experts_per_token": s["cpu_experts"] / n,
        "drafter_ms": {p: v * 1e3 for p, v in draft.items()},
        "latency": {
            p: simulate(rec.trace, p, draft_s=draft.get(p, 0.0)).as_dict() for p in profiles
        },
    }


def _load(
    path: str, rho: float, cfg: ARConfig | SpecConfig, refs: Sequence[list[int]], **kw: Any
) -> OffloadedModel:
    m = load(path, cfg.policy, rho, dtype="float32", progress=False, **cfg.options(), **kw)
    if isinstance(cfg, SpecConfig) and cfg.kind == "oracle":
        m.set_speculative(OracleDrafter(cfg.block, refs), cfg.block_k, cfg.verify)
    return m


def schedule_key(cfg: ARConfig | SpecConfig) -> tuple[Any, ...]:
    """What decides a configuration's host schedule: where its misses are computed, whether
    it predicts and biases, and for a speculative one its drafter, B and verify rule (not
    the residency, K_b or M, which change how many copies a call issues, not the calls)."""
    p = cfg.policy
    key = (type(cfg).__name__, cfg.experts_on, p.n > 0, p.lam > 0)
    if isinstance(cfg, SpecConfig):
        key += (cfg.kind, cfg.block, parse_verify(cfg.verify)[0])
    return key


def measure_host_schedule(
    path: str, rho: float, cfg: ARConfig | SpecConfig, prompt: list[int], refs: Sequence[list[int]]
) -> HostSchedule:
    """`cfg`'s host schedule on psr's GPU path (module docstring), from `prompt`."""
    from psr.eval.host_probe import measure_schedule

    spec = isinstance(cfg, SpecConfig)
    gpu = torch.cuda.is_available()
    m = _load(path, rho, cfg, refs, compute="triton", decode="host" if spec else "device")
    try:
        # Speculative: enough new tokens for 3 verify blocks whatever the acceptance.
        new = 3 * (cfg.block + 1) + 1 if spec else 4
        return measure_schedule(m, torch.tensor([prompt]), new, kernels=spec or gpu)
    finally:
        m.close()


def _measure(
    path: str,
    rho: float,
    cfg: ARConfig | SpecConfig,
    data: EvalData,
    profiles: Sequence[str],
    progress: bool,
    references: Sequence[list[int]] = (),
    schedules: dict[tuple[Any, ...], HostSchedule] | None = None,
) -> dict[str, Any] | None:
    """One configuration's row at residency `rho` (None: it does not fit, said why);
    `references`: exact greedy decoding's prompt + tokens, the oracle drafter's.
    `schedules` (host-aware): measured host schedules by schedule_key, filled as needed."""
    try:
        m = _load(path, rho, cfg, references)
    except ValueError as e:  # e.g. K_b above the slots the drafter leaves
        print(f"{rho:.1%} {cfg.label}: skipped ({e})")
        return None
    sched = None
    try:
        if schedules is not None:
            key = schedule_key(cfg)
            if key not in schedules:
                prompt = data.prompts[0][:SCHEDULE_PROMPT_TOKENS]
                schedules[key] = measure_host_schedule(path, rho, cfg, prompt, references)
            sched = schedules[key]
        block = cfg.block + 1 if isinstance(cfg, SpecConfig) else 1
        row = run(path, m, data, cfg.label, block, profiles, progress, sched)
    finally:
        m.close()
    row["residency"], row["experts_on"] = rho, cfg.experts_on
    row["verify"] = cfg.verify if isinstance(cfg, SpecConfig) else None
    return row


def host_ms(row: dict[str, Any], profile: str) -> float:
    """A row's host-aware ms per token: the faster of eager and CUDA graphs where its
    step can be captured (autoregressive), else eager (verify blocks)."""
    eager: float = row["latency_host"][profile]["ms_per_token"]
    graph = row.get("latency_graph", {}).get(profile)
    return eager if graph is None else min(eager, graph["ms_per_token"])


def _compare(rows: list[dict[str, Any]], profiles: Sequence[str]) -> None:
    """Speedups against exact (the first row) and the fastest autoregressive row, per
    profile (host-free, and host-aware where measured); Δ NLL [BCa CI] and greedy
    agreement against exact."""
    exact = rows[0]
    ms = {id(r): {p: r["latency"][p]["ms_per_token"] for p in profiles} for r in rows}
    ar = [r for r in rows if r["verify"] is None]
    host = all("latency_host" in r for r in rows)
    for r in rows:
        r["speedup_vs_exact"] = {p: ms[id(exact)][p] / ms[id(r)][p] for p in profiles}
        r["speedup_vs_best_ar"], r["best_ar"] = {}, {}
        for p in profiles:
            best = min(ar, key=lambda a: ms[id(a)][p])
            r["speedup_vs_best_ar"][p] = ms[id(best)][p] / ms[id(r)][p]
            r["best_ar"][p] = best["label"]
        if host:
            r["host_speedup_vs_best_ar"], r["host_best_ar"] = {}, {}
            for p in profiles:
                best = min(ar, key=lambda a: host_ms(a, p))
                r["host_speedup_vs_best_ar"][p] = host_ms(best, p) / host_ms(r, p)
                r["host_best_ar"][p] = best["label"]
        d = paired_bootstrap(r["nll_items"], exact["nll_items"]).as_dict()
        r["delta_nll"], r["in_budget"] = d, d["hi"] <= BUDGET
        agree = [
            greedy_agreement(a, b)[0]
            for a, b in zip(r["generated"], exact["generated"], strict=True)
        ]
        r["greedy_agreement"] = sum(agree) / max(len(agree), 1)


def compare_speculative(
    path: str,
    residencies: Sequence[float],
    specs: Sequence[SpecConfig],
    data: EvalData,
    profiles: Sequence[str] = DEFAULT_PROFILES,
    progress: bool = True,
    baselines: Sequence[ARConfig] | None = None,
    host: bool = False,
) -> list[dict[str, Any]]:
    """Autoregressive baselines (exact first; default `default_baselines`) and speculative
    configurations per residency (module docstring), compared per profile; `host`: with
    host-aware figures from measured schedules."""
    rows: list[dict[str, Any]] = []
    scheds: dict[tuple[Any, ...], HostSchedule] | None = {} if host else None
    for rho in residencies:
        ars = list(baselines) if baselines is not None else default_baselines(path, rho)
        if not ars or ars[0].policy.name != "exact" or ars[0].experts_on != "gpu":
            raise ValueError("the first baseline must be exact with experts_on='gpu'")
        got = [_measure(path, rho, c, data, profiles, progress, (), scheds) for c in ars]
        refs = [[*p, *g] for p, g in zip(data.prompts, got[0]["generated"], strict=True)]
        got += [_measure(path, rho, c, data, profiles, progress, refs, scheds) for c in specs]
        base = [r for r in got if r is not None]
        _compare(base, profiles)
        rows += base
    return rows


def default_baselines(path: str, rho: float) -> list[ARConfig]:
    """Exact, and the model's tuned PSR point with its misses copied (gpu), all computed on
    the CPU, and at most 2 copied per layer (hybrid:2)."""
    psr = operating_points(path, rho)["psr"]
    ons = ("gpu", "cpu", "hybrid:2")
    return [ARConfig(make_policy("exact")), *(ARConfig(psr, on) for on in ons)]


def markdown(rows: list[dict[str, Any]], profiles: Sequence[str] = DEFAULT_PROFILES) -> str:
    cols = ["residency", "config", "slots", "accepted / block", "copies / tok", "CPU experts / tok"]
    cols += [f"{p} ms/tok (vs best AR)" for p in profiles]
    cols += ["Δ nats/tok [95% CI]", "in budget", "greedy agree"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        d, acc = r["delta_nll"], r["accepted_per_block"]
        speed = [
            f"{r['latency'][p]['ms_per_token']:.2f} ({r['speedup_vs_best_ar'][p]:.2f}x)"
            for p in profiles
        ]
        cells = [
            f"{r['residency']:.1%}",
            r["label"],
            str(r["slots"]),
            "-" if acc is None else f"{acc:.2f}",
            f"{r['copies_per_token']:.2f}",
            f"{r['cpu_experts_per_token']:.2f}",
            *speed,
            f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]",
            "yes" if r["in_budget"] else "no",
            f"{r['greedy_agreement']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def host_markdown(rows: list[dict[str, Any]], profiles: Sequence[str] = DEFAULT_PROFILES) -> str:
    """Host-free against host-aware ms per token (each against the fastest autoregressive
    row of its kind), per profile."""
    cols = ["residency", "config", "accepted / block", "copies / tok", "CPU experts / tok"]
    for p in profiles:
        cols += [f"{p} host-free ms/tok (vs best AR)", f"{p} host-aware ms/tok (vs best AR)"]
    cols += ["Δ nats/tok [95% CI]", "in budget"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        d, acc = r["delta_nll"], r["accepted_per_block"]
        speed = []
        for p in profiles:
            speed.append(
                f"{r['latency'][p]['ms_per_token']:.2f} ({r['speedup_vs_best_ar'][p]:.2f}x)"
            )
            speed.append(f"{host_ms(r, p):.2f} ({r['host_speedup_vs_best_ar'][p]:.2f}x)")
        cells = [
            f"{r['residency']:.1%}",
            r["label"],
            "-" if acc is None else f"{acc:.2f}",
            f"{r['copies_per_token']:.2f}",
            f"{r['cpu_experts_per_token']:.2f}",
            *speed,
            f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]",
            "yes" if r["in_budget"] else "no",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def default_specs(
    top_k: int,
    block: int = 4,
    drafters: Sequence[str] = ("block", "ar"),
    block_ks: Sequence[int] | None = None,
    lams: Sequence[float] = (0.0, 0.2),
    cpu_copies: Sequence[int] = (),
    n: int = 1,
) -> list[SpecConfig]:
    """A grid per drafter: verify='budget' over K_b (default {k, 1.5k, 2k}) x lam (the set
    biased as PSR, or not at lam 0), then verify='cpu:M' over `cpu_copies` x lam; `n`
    experts prefetched per layer and block."""
    kbs = list(block_ks) if block_ks else [top_k, math.ceil(1.5 * top_k), 2 * top_k]
    bad = [kb for kb in kbs if kb < top_k]
    if bad:
        raise ValueError(f"K_b {bad} below the model's top-k {top_k}")
    out = []
    for kind in drafters:
        for kb in kbs:
            for lam in lams:
                out.append(SpecConfig(kind, block, kb, make_policy("psr", lam, n)))
        for m in cpu_copies:
            for lam in lams:
                out.append(SpecConfig(kind, block, None, make_policy("psr", lam, n), f"cpu:{m}"))
    return out
