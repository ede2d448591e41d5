"""Drivers for batched-decode tests (tests/runtime/test_batch.py, test_prompt_cache.py): a
prompt's solo run and greedy decoding of several prompts in one BatchDecoder; the prefix
two prompts share."""

from __future__ import annotations

from typing import Any

import torch

from psr.runtime.batch import BatchDecoder


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` share (where a prompt parts from a cached one)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def solo(model: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The solo run's tokens and the logits each was chosen from `[n, V]` (float32), as
    `generate` saw them (its prefill computes the LM head over the last row only)."""
    seen: list[torch.Tensor] = []

    def record(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen.append(scores[0].clone())
        return scores

    out = model.generate(prompt, max_new_tokens=n, logits_processor=record)
    return out[0, len(prompt) :].tolist(), torch.stack(seen)


def batched(
    model: Any, prompts: list[list[int]], n: int | list[int], joins: list[int] | None = None,
    max_batch: int | None = None, dec: BatchDecoder | None = None,
    cached: list[int] | None = None, **kw: Any,
) -> tuple[list[list[int]], list[torch.Tensor], BatchDecoder]:  # fmt: skip
    """Greedy decoding of `prompts` in one BatchDecoder (`dec`, or a new one made with
    `max_batch` and `kw`), prompt j added at step `joins[j]` and leaving after `n[j]`
    tokens; returns each one's tokens and logits, and the decoder. `cached`: filled with
    each prompt's tokens resumed from the decoder's prompt cache."""
    joins = joins or [0] * len(prompts)
    ns = n if isinstance(n, list) else [n] * len(prompts)
    dec = dec or BatchDecoder(model, max_batch or len(prompts), **kw)
    if cached is not None:
        cached[:] = [0] * len(prompts)
    seq_of: dict[int, int] = {}
    toks: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = 0
    while step == 0 or dec.live or len(seq_of) < len(prompts):
        for j, at in enumerate(joins):
            if at == step:
                seq_of[dec.add(prompts[j])] = j
        feed = {}
        for s, lg in dec.ready().items():
            j = seq_of[s]
            logits[j].append(lg)
            toks[j].append(int(lg.float().argmax()))
            if len(toks[j]) == ns[j]:
                if cached is not None:
                    cached[j] = dec.cached_tokens(s)
                dec.remove(s)
            else:
                feed[s] = toks[j][-1]
        dec.feed(feed)
        step += 1
    return toks, [torch.stack(x) for x in logits], dec
