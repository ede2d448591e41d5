"""Quality harness: likelihood benchmarks and greedy agreement under a routing policy.

Every benchmark prefills a prompt (exact routing, as in deployment) and scores the
tokens that follow as decode steps under the policy, so the biased routing is what
is measured. Differences from `exact` come with a paired-bootstrap 95% interval over
items, as the paper reports them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from psr.runtime.model import OffloadedModel


@dataclass
class ClozeItem:
    """Context, then candidate continuations; `answer` indexes the true one."""

    context: list[int]
    choices: list[list[int]]
    answer: int


def chunks(ids: Sequence[int], length: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` non-overlapping windows of `length` tokens, evenly spread (seeded offset)."""
    if len(ids) < length:
        raise ValueError(f"text of {len(ids)} tokens is shorter than one chunk of {length}")
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
    """Multiple-choice cloze: the true continuation vs continuations from elsewhere."""
    rng = random.Random(seed)
    windows = chunks(ids, context + cont, count * (distractors + 1), seed)
    items = []
    for i in range(0, len(windows) - distractors, distractors + 1):
        group = windows[i : i + distractors + 1]
        ctx, true = group[0][:context], group[0][context:]
        choices = [true] + [w[context:] for w in group[1:]]
        order = list(range(len(choices)))
        rng.shuffle(order)
        items.append(ClozeItem(ctx, [choices[j] for j in order], order.index(0)))
        if len(items) == count:
            break
    return items


def token_nll(model: OffloadedModel, ids: Sequence[int], prompt_len: int) -> torch.Tensor:
    """NLL (nats) of tokens `ids[prompt_len:]`, each scored as a decode step."""
    t = torch.tensor([list(ids)])
    logits = model.decode_logits(t, prompt_len)[0, prompt_len - 1 : -1].float()
    target = t[0, prompt_len:].to(logits.device)
    return torch.nn.functional.cross_entropy(logits, target, reduction="none").cpu()


def perplexity_items(
    model: OffloadedModel, windows: list[list[int]], prompt_len: int, progress=None
) -> list[float]:
    """Mean NLL per window (one item each)."""
    out = []
    for w in windows:
        out.append(float(token_nll(model, w, prompt_len).mean()))
        if progress is not None:
            progress.update()
    return out


def cloze_scores(model: OffloadedModel, items: list[ClozeItem], progress=None) -> list[float]:
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
    lo: float  # 95% interval (paired bootstrap)
    hi: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def paired_bootstrap(
    policy: Sequence[float], reference: Sequence[float], iters: int = 2000, seed: int = 0
) -> Comparison:
    """Mean paired difference with a percentile-bootstrap 95% interval over items."""
    if len(policy) != len(reference) or not policy:
        raise ValueError(
            f"need two equal, non-empty score lists, got {len(policy)} and {len(reference)}"
        )
    d = torch.tensor(policy, dtype=torch.float64) - torch.tensor(reference, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(d), (iters, len(d)), generator=g)
    means = d[idx].mean(dim=1).sort().values
    lo = float(means[int(0.025 * (iters - 1))])
    hi = float(means[int(0.975 * (iters - 1))])
    return Comparison(float(d.mean()), lo, hi, len(d))
