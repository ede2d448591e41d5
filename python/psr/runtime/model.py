"""OffloadedModel: a transformers causal LM whose MoE experts live in a psr store.

model = psr.load("path/to/checkpoint", policy="psr", residency=0.5)
ids = model.generate(input_ids, max_new_tokens=64)
print(model.stats.table())
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from psr.policy import Policy, make_policy
from psr.runtime import generate as gen
from psr.runtime.engine import OffloadRuntime
from psr.runtime.stats import Stats
from psr.runtime.trace import TraceRecorder


class OffloadedModel(nn.Module):
    """A transformers causal LM whose MoE experts are offloaded under a routing policy."""

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
        self.runtime.stats.reset()

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
        self.runtime.configure(make_policy(policy, lam, n), residency, slots)

    def record_trace(self) -> TraceRecorder:
        """Start recording decode steps; the recorder's `.trace` feeds psr.eval.latency."""
        return self.runtime.new_recorder()

    def _ids(self, input_ids: torch.Tensor | Iterable[int], extra: int = 0) -> torch.Tensor:
        ids = torch.as_tensor(
            input_ids if isinstance(input_ids, torch.Tensor) else list(input_ids), dtype=torch.long
        )
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
        return self.hf(input_ids=self._ids(input_ids), use_cache=False).logits

    @torch.no_grad()
    def decode_logits(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Logits `[1, T, V]`: prefill the first `prompt_len` tokens, then feed the rest one
        decode step at a time (teacher forcing) under the policy."""
        ids = self._ids(input_ids)
        if not 1 <= prompt_len <= ids.shape[1]:
            raise ValueError(f"prompt_len must be in [1, {ids.shape[1]}], got {prompt_len}")
        return gen.decode_logits(self.hf, ids, prompt_len)

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
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if do_sample and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0):
            raise ValueError("sampling needs temperature > 0, 0 < top_p <= 1, top_k >= 0")
        ids = self._ids(input_ids, max_new_tokens)
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
