"""OffloadedModel: a transformers causal LM whose MoE experts live in a psr store.

model = psr.load("path/to/checkpoint", policy="psr", residency=0.5)
ids = model.generate(input_ids, max_new_tokens=64)
print(model.stats.table())
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Integral
from typing import Any

import torch
from torch import nn

from psr.policy import Policy, make_policy
from psr.runtime import generate as gen
from psr.runtime.engine import OffloadRuntime
from psr.runtime.stats import Stats
from psr.runtime.trace import TraceRecorder


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


class OffloadedModel(nn.Module):
    """A transformers causal LM whose MoE experts are offloaded under a routing policy.

    One sequence at a time: its methods hold the runtime's lock for their whole call, so
    calls from several threads wait for each other. `close()` (or `with ... as model`)
    frees the expert store at once; dropping the last reference frees it too.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        runtime: OffloadRuntime,
        tokenizer: Any = None,
        path: str | None = None,
    ) -> None:
        super().__init__()
        self.hf = hf_model
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.path = path
        # Where the policy's lam / n came from: "arguments", "defaults" or a points file.
        self.policy_source = "arguments"

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def stats(self) -> Stats:
        return self.runtime.stats

    @property
    def policy(self) -> Policy:
        return self.runtime.policy

    def reset_stats(self) -> None:
        with self.runtime.lock:
            self.runtime.stats.reset()

    def close(self) -> None:
        """Free the expert store (host memory, device slab, copy thread); idempotent.
        The model cannot decode afterwards."""
        with self.runtime.lock:
            self.runtime.store.close()

    @property
    def closed(self) -> bool:
        return bool(self.runtime.store.closed)

    def __enter__(self) -> OffloadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def configure(
        self,
        policy: str | Policy = "psr",
        residency: float | None = 0.5,
        *,
        slots: int | None = None,
        lam: float | None = None,
        n: int | None = None,
    ) -> None:
        """Switch policy and residency without reloading: slots per layer may not exceed
        what the store was built with. Stats are kept (call reset_stats())."""
        with self.runtime.lock:
            self.runtime.configure(make_policy(policy, lam, n), residency, slots)

    def record_trace(self) -> TraceRecorder:
        """Start recording decode steps; the recorder's `.trace` feeds psr.eval.latency."""
        return self.runtime.new_recorder()

    def _ids(self, input_ids: torch.Tensor | Iterable[int], extra: int = 0) -> torch.Tensor:
        if isinstance(input_ids, torch.Tensor):
            if (
                input_ids.dtype.is_floating_point
                or input_ids.dtype.is_complex
                or (input_ids.dtype == torch.bool)
            ):
                raise TypeError(f"token ids must be an integer tensor, got {input_ids.dtype}")
            ids = input_ids.to(torch.long)
        else:
            items = list(input_ids)
            flat = items[0] if len(items) == 1 and isinstance(items[0], (list, tuple)) else items
            bad = [x for x in flat if isinstance(x, bool) or not isinstance(x, Integral)]
            if bad:
                raise TypeError(f"token ids must be ints, got {bad[0]!r}")
            ids = torch.tensor(items, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(
                f"psr decodes one sequence (batch 1); got input of shape {list(ids.shape)}"
            )
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and ids.shape[1] + extra > limit:
            raise ValueError(
                f"prompt of {ids.shape[1]} tokens + {extra} new exceeds the model's "
                f"context of {limit} tokens"
            )
        vocab = self.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids.to(self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[1, T, V]` of one prefill over `input_ids` (exact routing: all prefill)."""
        with self.runtime.lock:
            return self.hf(input_ids=self._ids(input_ids), use_cache=False).logits

    @torch.no_grad()
    def decode_logits(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Logits `[1, T, V]`: prefill the first `prompt_len` tokens, then feed the rest one
        decode step at a time (teacher forcing) under the policy."""
        ids = self._ids(input_ids)
        prompt_len = _check_count("prompt_len", prompt_len)
        if not 1 <= prompt_len <= ids.shape[1]:
            raise ValueError(f"prompt_len must be in [1, {ids.shape[1]}], got {prompt_len}")
        with self.runtime.lock:
            return gen.decode_logits(self.hf, ids, prompt_len)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor | Iterable[int], prompt_len: int) -> torch.Tensor:
        """`decode_logits` in one forward: the same routing, counts and trace (each token
        after `prompt_len` routed as a decode step under the policy, its prefetches
        applied in decoding's order), with batched attention and experts read from the
        host copies, so logits agree with `decode_logits` to floating-point rounding.
        No copies are issued: stall time is not measured. Logical-cache policies only."""
        ids = self._ids(input_ids)
        prompt_len = _check_count("prompt_len", prompt_len)
        with self.runtime.lock:
            self.runtime.begin_scoring(prompt_len, ids.shape[1])
            try:
                return self.hf(input_ids=ids, use_cache=False).logits
            finally:
                self.runtime.end_scoring()

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | Iterable[int],
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_id: int | None = None,
        progress: bool = False,
    ) -> torch.Tensor:
        """Greedy (default) or sampled decoding with a KV cache; returns `[1, T + new]` ids."""
        max_new_tokens = _check_count("max_new_tokens", max_new_tokens)
        top_k = _check_count("top_k", top_k)
        if do_sample and not (math.isfinite(temperature) and temperature > 0 and 0 < top_p <= 1):
            raise ValueError("sampling needs a finite temperature > 0 and 0 < top_p <= 1")
        ids = self._ids(input_ids, max_new_tokens)
        with self.runtime.lock:
            return gen.generate(
                self.hf,
                ids,
                max_new_tokens,
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                eos_token_id=eos_token_id,
                progress=progress,
            )
