"""What a request adds to `model.generate`: penalties and a grammar mask as one logits
processor, and a sink for the logprobs the decode loop reads with each token.

Everything here runs in the worker thread. The penalties work on the device from the
sequence's ids (no host read); the grammar mask (llguidance) is computed on the host from
the tokens the streamer has already seen, and copied to the device once per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from psr.serve.protocol import Sampling, Structured


class Penalties:
    """vLLM's repetition penalty (prompt and output tokens: a positive logit divided by
    it, a negative one multiplied) and OpenAI's presence / frequency penalties (output
    tokens: minus presence once a token occurs, minus frequency per occurrence)."""

    def __init__(self, s: Sampling, prompt_len: int) -> None:
        self.rep, self.presence, self.frequency = (
            s.repetition_penalty,
            s.presence_penalty,
            s.frequency_penalty,
        )
        self.prompt_len = prompt_len

    @property
    def active(self) -> bool:
        return self.rep != 1.0 or self.presence != 0.0 or self.frequency != 0.0

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.rep != 1.0:
            seen = torch.gather(scores, 1, ids)
            seen = torch.where(seen < 0, seen * self.rep, seen / self.rep)
            scores = scores.scatter(1, ids, seen)
        out = ids[0, self.prompt_len :]
        if out.numel() and (self.presence or self.frequency):
            # scatter_add, not bincount: bincount reads its input's max on the host.
            counts = torch.zeros(scores.shape[-1], device=scores.device, dtype=scores.dtype)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=scores.dtype))
            scores = scores - self.frequency * counts - self.presence * (counts > 0)
        return scores


class GrammarError(ValueError):
    """A grammar that does not compile (the request's 400)."""


class Grammars:
    """llguidance over one tokenizer: grammars checked and matchers made."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        eos: Any = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def grammar(self, s: Structured) -> str:
        """The llguidance grammar of `s`, checked (GrammarError names the problem)."""
        M = self.ll.LLMatcher
        if s.kind == "json":
            # Compact JSON (vLLM's disable-any-whitespace): free whitespace lets a model
            # spend its tokens on newlines, never closing the object.
            g = M.grammar_from_json_schema(
                s.spec or '{"type": "object"}', defaults={"whitespace_flexible": False}
            )
        elif s.kind == "regex":
            g = M.grammar_from_regex(s.spec or "")
        else:
            g = M.grammar_from_lark(s.spec or "")
        error = M.validate_grammar(g, self.tokenizer)
        if error:
            raise GrammarError(error.strip().splitlines()[0])
        return str(g)

    def mask(self, grammar: str) -> GrammarMask:
        return GrammarMask(self.ll.LLMatcher(self.tokenizer, grammar), self.vocab_size)


class GrammarMask:
    """The tokens a grammar allows next, as a mask on the logits (-inf elsewhere); fed
    each chosen token (`consume`) by the streamer. `seconds` / `masks`: the mask's cost."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.torch as lt

        self.lt = lt
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = lt.allocate_token_bitmask(1, vocab_size)  # int32 words, bit j: id
        self._shifts: torch.Tensor | None = None
        self.seconds = 0.0
        self.masks = 0

    def consume(self, token: int) -> None:
        t0 = time.perf_counter()
        self.matcher.consume_token(token)
        self.seconds += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        self.lt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        # Unpacked on the logits' device (llguidance's own apply compiles with
        # torch.compile on first use: seconds on a CPU).
        if self._shifts is None or self._shifts.device != scores.device:
            self._shifts = torch.arange(32, device=scores.device, dtype=torch.int32)
        words = self.bitmask.to(scores.device, non_blocking=True)
        allowed = ((words[..., None] >> self._shifts) & 1).view(1, -1)[:, : scores.shape[-1]]
        scores = scores.masked_fill(allowed == 0, float("-inf"))
        self.seconds += time.perf_counter() - t0
        self.masks += 1
        return scores


@dataclass
class Processors:
    """The request's logits processors, applied in order (penalties, then the grammar)."""

    items: list[Any] = field(default_factory=list)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for p in self.items:
            scores = p(ids, scores)
        return scores


@dataclass
class LogprobSink:
    """What `generate(logprobs=...)` reports per token: (token, logprob, [(id, logprob)])."""

    top: int
    rows: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)

    def add(self, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        self.rows.append((token, logprob, top))
