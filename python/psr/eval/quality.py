"""Quality harness: likelihood benchmarks and greedy agreement under a routing policy.

Every likelihood item prefills a prompt (exact routing, as in deployment) and scores
the tokens that follow as decode steps under the policy (`OffloadedModel.score`: the
decode path's routing and counts in one forward), so the biased routing is what is
measured. Differences from `exact` come with a paired BCa bootstrap 95% interval over
items (scipy.stats.bootstrap).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from psr.runtime.model import OffloadedModel


@dataclass
class ClozeItem:
    """Context, then candidate continuations; `answer` indexes the true one."""

    context: list[int]
    choices: list[list[int]]
    answer: int


def chunks(ids: Sequence[int], length: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` non-overlapping windows of `length` tokens, evenly spread (seeded offset);
    fewer when the text holds fewer."""
    if len(ids) < length:
        raise ValueError(f"text of {len(ids)} tokens is shorter than one chunk of {length}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    n = min(count, len(ids) // length)
    stride = len(ids) // n
    off = random.Random(seed).randrange(0, stride - length + 1)
    return [list(ids[off + i * stride : off + i * stride + length]) for i in range(n)]


def cloze_items(
    ids: Sequence[int],
    count: int,
    context: int = 48,
    cont: int = 8,
    distractors: int = 3,
    seed: int = 0,
) -> list[ClozeItem]:
    """Multiple-choice cloze: the true continuation of a context against `distractors`
    continuations taken from elsewhere in the text. Contexts are evenly spread (they may
    overlap when `count` asks for more than the text holds apart); each distractor is a
    continuation from a random position at least `context + cont` tokens away."""
    span = context + cont
    if len(ids) < 4 * span:
        raise ValueError(f"text of {len(ids)} tokens is too short for cloze items of {span}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    rng = random.Random(seed)
    last = len(ids) - span
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)]
    items = []
    for s in starts:
        true = list(ids[s + context : s + span])
        choices = [true]
        while len(choices) < distractors + 1:
            d = rng.randrange(0, last + 1)
            c = list(ids[d + context : d + span])
            if abs(d - s) >= span and c not in choices:
                choices.append(c)
        order = list(range(len(choices)))
        rng.shuffle(order)
        items.append(
            ClozeItem(list(ids[s : s + context]), [choices[j] for j in order], order.index(0))
        )
    return items


def token_nll(model: OffloadedModel, ids: Sequence[int], prompt_len: int) -> torch.Tensor:
    """NLL (nats) of tokens `ids[prompt_len:]`, each scored as a decode step."""
    t = torch.tensor([list(ids)])
    logits = model.score(t, prompt_len)[0, prompt_len - 1 : -1].float()
    target = t[0, prompt_len:].to(logits.device)
    return torch.nn.functional.cross_entropy(logits, target, reduction="none").cpu()


def perplexity_items(
    model: OffloadedModel, windows: list[list[int]], prompt_len: int, progress: Any = None
) -> list[float]:
    """Mean NLL per window (one item each)."""
    out = []
    for w in windows:
        out.append(float(token_nll(model, w, prompt_len).mean()))
        if progress is not None:
            progress.update()
    return out


def cloze_scores(
    model: OffloadedModel, items: list[ClozeItem], progress: Any = None
) -> list[float]:
    """1.0 where the true continuation has the highest log-likelihood, else 0.0."""
    out = []
    for it in items:
        ll = [-float(token_nll(model, it.context + c, len(it.context)).sum()) for c in it.choices]
        out.append(float(max(range(len(ll)), key=ll.__getitem__) == it.answer))
        if progress is not None:
            progress.update()
    return out


def greedy_agreement(
    policy_tokens: Sequence[int], exact_tokens: Sequence[int]
) -> tuple[float, int]:
    """(fraction of positions equal, first divergence position; len if none)."""
    n = min(len(policy_tokens), len(exact_tokens))
    if n == 0:
        return 1.0, 0
    same = [a == b for a, b in zip(policy_tokens[:n], exact_tokens[:n], strict=True)]
    first = next((i for i, s in enumerate(same) if not s), n)
    return sum(same) / n, first


@dataclass
class Comparison:
    mean: float  # mean of policy - reference over items
    lo: float  # 95% interval (paired BCa bootstrap)
    hi: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def paired_bootstrap(
    policy: Sequence[float], reference: Sequence[float], iters: int = 4000, seed: int = 0
) -> Comparison:
    """Mean paired difference with a BCa bootstrap 95% interval over items."""
    import numpy as np
    from scipy.stats import bootstrap

    if len(policy) != len(reference) or not policy:
        raise ValueError(
            f"need two equal, non-empty score lists, got {len(policy)} and {len(reference)}"
        )
    d = np.asarray(policy, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    mean = float(d.mean())
    if np.ptp(d) <= 1e-12 * max(1.0, abs(mean)):  # no spread: BCa is undefined
        return Comparison(mean, mean, mean, len(d))
    res = bootstrap(
        (d,),
        np.mean,
        n_resamples=iters,
        confidence_level=0.95,
        method="BCa",
        rng=np.random.default_rng(seed),
    )
    ci = res.confidence_interval
    return Comparison(mean, float(ci.low), float(ci.high), len(d))
