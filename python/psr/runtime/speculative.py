"""Speculative decoding with bounded verify blocks (batch 1, greedy).

Each step the drafter proposes B tokens after the last accepted one; the target runs
`[last accepted, d_1, ..., d_B]` in ONE forward in block mode, each MoE layer routed by
the verify rule (runtime/verify.py): 'budget', one set of `block_k` experts for the whole
block (psr_kernels.block_routing, biased toward its logical cache as PSR biases), every
token's top-k inside it; or 'cpu', every token's own top-k, the union's experts outside the
slab computed on the CPU beyond a per-layer copy budget. The longest prefix of drafts that
equals the target's own greedy choices is accepted, plus one token from the target; the
KV cache is cut back to the accepted tokens.

Logical caches (docs/design.md, "Speculative decoding"): per verify block and layer,
the experts the block's tokens route to are `use`d as one routing and the `n` ids of
largest summed next-layer score are `prefetch`ed into the next layer. Both depend only on
the block's tokens, which the deterministic drafter derives from the accepted tokens, so
the caches and the output are a deterministic function of the prompt: copy timing
changes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from psr.runtime import chunked
from psr.runtime.engine import OffloadRuntime
from psr.runtime.kv import cache_kwarg, output_cache
from psr.runtime.verify import VerifyRule
from psr.store import cpu_kernels


class Drafter(Protocol):
    """Proposes `block` tokens following `tokens[-1]`; `hidden [n, d]` holds the target's
    final hidden states at the n positions since the previous call (the prompt's after
    the prefill, the accepted ones after a verify block), the last one the position that
    produced `tokens[-1]`."""

    kind: str
    block: int

    @property
    def memory_bytes(self) -> int: ...

    @property
    def pass_cost(self) -> tuple[int, int]:
        """(weights read per pass, passes per block): what the latency model prices."""
        ...

    def propose(self, tokens: list[int], hidden: torch.Tensor | None) -> list[int]: ...

    def reset(self) -> None: ...


@dataclass
class SpecStats:
    """Verify blocks run, tokens drafted and accepted, tokens emitted."""

    blocks: int = 0
    drafted: int = 0
    accepted: int = 0  # drafted tokens equal to the target's choice
    emitted: int = 0  # accepted + one target token per block (+ the prefill's first)
    per_block: list[int] = field(default_factory=list)  # tokens emitted by each block

    @property
    def accepted_per_block(self) -> float:
        return self.accepted / self.blocks if self.blocks else 0.0

    @property
    def tokens_per_block(self) -> float:
        return sum(self.per_block) / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "accepted_per_block": self.accepted_per_block,
            "tokens_per_block": self.tokens_per_block,
        }


def crop_to(kv: Any, length: int) -> None:
    """Cut a transformers KV cache back to `length` tokens. A negative argument means
    "remove that many" in every transformers 5.x (a positive one changed meaning)."""
    drop = kv.get_seq_length() - length
    if drop < 0:
        raise ValueError(f"cannot crop a cache of {kv.get_seq_length()} tokens to {length}")
    if drop:
        kv.crop(-drop)


def _last_hidden(out: Any) -> torch.Tensor:
    hs = out["hidden_states"]
    last: torch.Tensor = hs[-1][0]  # [T, d], after the final norm (what the LM head reads)
    return last


@torch.no_grad()
def generate_speculative(
    hf: nn.Module,
    runtime: OffloadRuntime,
    drafter: Drafter,
    ids: torch.Tensor,
    max_new_tokens: int,
    rule: VerifyRule,
    *,
    eos_token_id: int | None = None,
    on_block: Any = None,
    prefill_chunk: int | None = None,
    torch_threads: int | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Greedy speculative decoding of `ids [1, T]`; returns `[1, T + new]` and stats.
    `prefill_chunk`: the model's prefill chunk (None: the prompt in one chunk).
    `torch_threads`: torch's own ops' threads during the verify blocks, psr's CPU kernels
    keeping theirs (cpu_kernels.torch_ops_threads; None: as they are). The drafter keeps
    torch's threads: it may be a float model of its own.

    `on_block(block_tokens, accepted)` is called after every verify block (the latency
    model's trace recorder uses it to weigh each step by the tokens it emitted)."""
    stats = SpecStats()
    if max_new_tokens == 0:
        return ids, stats
    kv_name = cache_kwarg(hf)
    drafter.reset()
    # The prefill: exact, in the plain prefill's chunks, the LM head over the last row only,
    # so the KV cache and first logits are generate's (one forward over a long prompt had
    # other bits, and held every layer's activations for the whole prompt). The drafter
    # takes every prompt row's last hidden state.
    rows: list[torch.Tensor] = []

    def forward(part: torch.Tensor, pos: int, past: Any) -> tuple[torch.Tensor, Any]:
        kw = {} if past is None else {kv_name: past}
        out = hf(input_ids=part, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                 **kw)  # fmt: skip
        rows.append(_last_hidden(out))
        return out.logits, output_cache(out)

    logits, kv = chunked.prefill(runtime, forward, ids, prefill_chunk or ids.shape[1])
    tokens = ids[0].tolist()
    last = int(logits[0, -1].float().argmax())
    hidden = torch.cat(rows)
    tokens.append(last)
    stats.emitted = 1
    runtime.set_block_mode(rule)
    try:
        while stats.emitted < max_new_tokens and last != eos_token_id:
            drafts = drafter.propose(tokens, hidden)[: drafter.block]
            block = torch.tensor([[last, *drafts]], device=ids.device)
            seen = kv.get_seq_length()
            with cpu_kernels.torch_ops_threads(torch_threads):
                out = hf(input_ids=block, use_cache=True, output_hidden_states=True,
                         **{kv_name: kv})  # fmt: skip
            choice = out.logits[0].float().argmax(-1).tolist()  # the target's token per slot
            a = 0
            while a < len(drafts) and drafts[a] == choice[a]:
                a += 1
            new = [*drafts[:a], choice[a]]
            room = max_new_tokens - stats.emitted
            if eos_token_id is not None and eos_token_id in new:
                new = new[: new.index(eos_token_id) + 1]
            new = new[:room]
            crop_to(kv, seen + a + 1)  # keep [last, d_1..d_a]; the target token comes next
            hidden = _last_hidden(out)[: a + 1]
            tokens += new
            last = new[-1]
            stats.blocks += 1
            stats.drafted += len(drafts)
            stats.accepted += a
            stats.emitted += len(new)
            stats.per_block.append(len(new))
            if on_block is not None:
                on_block(len(drafts) + 1, len(new))
    finally:
        runtime.set_block_mode(None)
    return torch.tensor([tokens], device=ids.device), stats
