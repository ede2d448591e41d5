"""Drafters for speculative decoding, both resident on the device.

* `ARDrafter`: a small dense causal LM with the target's tokenizer; it drafts a block by
  decoding B tokens greedily with its own KV cache.
* `BlockDrafter`: B light heads on the target's final hidden state (Medusa-style, also
  conditioned on the token the target just chose): with h the hidden state at position
  t and c the target's token t + 1, head i maps h + P e(c) (e: the target's own input
  embedding) through one residual SiLU layer to the target's own LM head and proposes
  token t + 2 + i; all B in one pass.

Both implement `psr.runtime.speculative.Drafter`: `propose(tokens, hidden) -> ids [B]`
and `memory_bytes`, which counts against the expert slots at equal device memory.
Trained by scripts/train_drafters.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from psr.models.checkpoint import CheckpointError
from psr.models.mtp import MTPDrafter, MTPPlan, load_mtp_drafter
from psr.runtime.speculative import crop_to
from psr.vocab import DRAFTERS


class BlockHeads(nn.Module):
    """`block` residual heads over a hidden size `d`, conditioned on the next token's
    embedding through one shared projection; logits through the target's LM head."""

    def __init__(self, d: int, block: int) -> None:
        super().__init__()
        self.token = nn.Linear(d, d, bias=False)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(block))
        for lin in (self.token, *self.layers):  # start as the target's own head
            nn.init.zeros_(lin.weight)
        for lin in self.layers:
            nn.init.zeros_(lin.bias)

    def forward(
        self, h: torch.Tensor, next_emb: torch.Tensor, lm_head: torch.Tensor
    ) -> list[torch.Tensor]:
        """`h [..., d]` (hidden at t), `next_emb [..., d]` (embedding of token t + 1) ->
        B logits `[..., V]`, head i predicting token t + 2 + i."""
        x = h + self.token(next_emb)
        return [F.linear(x + F.silu(lin(x)), lm_head) for lin in self.layers]


def final_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A transformers causal LM's hidden states after its final norm (what its LM head
    reads), `[b, T, d]`."""
    return model.model(input_ids=ids).last_hidden_state


class BlockDrafter:
    """Drafts B tokens from the target's last hidden state in one pass."""

    kind = "block"

    def __init__(self, heads: BlockHeads, lm_head: torch.Tensor, embed: torch.Tensor) -> None:
        self.heads = heads.eval()
        self.lm_head = lm_head
        self.embed = embed  # the target's input embedding (resident anyway)
        self.block = len(heads.layers)

    @property
    def memory_bytes(self) -> int:
        # The LM head is the target's own (resident anyway); only the heads are extra.
        return sum(p.numel() * p.element_size() for p in self.heads.parameters())

    @property
    def pass_cost(self) -> tuple[int, int]:
        """(weights read per pass, passes per block): one pass, the LM head read once for
        B logits (the latency model prices drafting by it)."""
        return sum(p.numel() for p in self.heads.parameters()) + self.lm_head.numel(), 1

    @torch.no_grad()
    def propose(self, tokens: list[int], hidden: torch.Tensor | None) -> list[int]:
        if hidden is None:
            raise ValueError("the block drafter needs the target's last hidden state")
        h = hidden.reshape(-1, hidden.shape[-1])[-1:].to(self.lm_head.dtype)
        e = self.embed[tokens[-1]][None]
        return [int(lg.float().argmax(-1)) for lg in self.heads(h, e, self.lm_head)]

    def reset(self) -> None:
        pass


class ARDrafter:
    """Drafts B tokens by greedy decoding with a small dense causal LM."""

    kind = "ar"

    def __init__(self, model: nn.Module, block: int) -> None:
        self.model = model.eval()
        self.block = block
        self._cache: Any = None
        self._seen: list[int] = []

    @property
    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def pass_cost(self) -> tuple[int, int]:
        """(weights read per pass, passes per block): B sequential decode steps."""
        return sum(p.numel() for p in self.model.parameters()), self.block

    def reset(self) -> None:
        self._cache, self._seen = None, []

    @torch.no_grad()
    def propose(self, tokens: list[int], hidden: torch.Tensor | None = None) -> list[int]:
        """Greedy continuation of `tokens`; its KV cache is reused for the accepted prefix
        (cropped where the drafts were rejected), so each block costs about B steps."""
        dev = next(self.model.parameters()).device
        keep = 0
        while keep < min(len(self._seen), len(tokens)) and self._seen[keep] == tokens[keep]:
            keep += 1
        if self._cache is None or keep == 0:
            self._cache, keep = None, 0
        elif keep < self._cache.get_seq_length():
            crop_to(self._cache, keep)
        new = tokens[keep:]
        if not new:  # always feed at least the last token again
            crop_to(self._cache, keep - 1)
            new = tokens[keep - 1 :]
        out = self.model(
            input_ids=torch.tensor([new], device=dev), cache=self._cache, use_cache=True
        )
        self._cache = out.cache
        drafted = []
        for i in range(self.block):
            nxt = int(out.logits[0, -1].float().argmax())
            drafted.append(nxt)
            if i + 1 < self.block:
                out = self.model(
                    input_ids=torch.tensor([[nxt]], device=dev), cache=self._cache, use_cache=True
                )
        self._seen = [*tokens, *drafted[:-1]]
        return drafted


def load_block_drafter(
    path: str | Path, lm_head: torch.Tensor, embed: torch.Tensor
) -> BlockDrafter:
    """Block heads saved by scripts/train_drafters.py, on the LM head's device/dtype;
    `lm_head` and `embed` are the target's output and input embedding weights."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"block drafter {path} does not exist")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != "psr-block-heads-v2":
        raise CheckpointError(f"{path} is not a psr block drafter (format {meta.get('format')})")
    d, block = int(meta["hidden_size"]), int(meta["block"])
    if d != lm_head.shape[1]:
        raise CheckpointError(f"{path}: heads of hidden size {d}, target has {lm_head.shape[1]}")
    heads = BlockHeads(d, block)
    heads.load_state_dict(state)
    return BlockDrafter(heads.to(device=lm_head.device, dtype=lm_head.dtype), lm_head, embed)


def load_ar_drafter(
    path: str | Path, block: int, device: torch.device, dtype: torch.dtype
) -> ARDrafter:
    """The dense drafter checkpoint saved by scripts/train_drafters.py."""
    import transformers

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"AR drafter {path} has no config.json")
    # A 0.7M-parameter model loads at once: no transformers progress bar in psr's output.
    tlog = transformers.utils.logging
    was_on = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    finally:
        if was_on:
            tlog.enable_progress_bar()
    return ARDrafter(model.to(device), block)


def load_drafter(
    model_dir: str | Path,
    kind: str,
    block: int,
    target: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    mtp: MTPPlan | None = None,
) -> BlockDrafter | ARDrafter | MTPDrafter:
    """The checkpoint's drafter of `kind` (psr.vocab.DRAFTERS) drafting `block` tokens;
    `mtp`: the checkpoint's MTP layer as `psr.models.mtp.plan_mtp` checked it."""
    if kind not in DRAFTERS:
        raise ValueError(f"speculative must be one of {', '.join(DRAFTERS)}, got {kind!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    if kind == "mtp":
        return load_mtp_drafter(model_dir, mtp, target, block, dtype)
    if kind == "ar":
        return load_ar_drafter(Path(model_dir) / "drafter_ar", block, device, dtype)
    d = load_block_drafter(
        Path(model_dir) / "drafter_block.safetensors",
        target.get_output_embeddings().weight,
        target.get_input_embeddings().weight,
    )
    if block > d.block:
        raise ValueError(f"the block drafter has {d.block} heads; block={block} asks for more")
    d.block = block  # the first `block` heads
    return d


def drafters_info(model_dir: str | Path) -> dict[str, Any]:
    f = Path(model_dir) / "drafters_info.json"
    return json.loads(f.read_text()) if f.is_file() else {}
