"""The dense side of a batched decode forward (runtime/batch.py): the model's own
transformers forward over `[b, 1]` tokens, each row computed as its sequence alone would be.

* **Dense linears: one seam.** `batch_linear` is the one function that computes a dense
  linear of a batch (every `nn.Linear` of the model while a batch forward runs, and the
  routers' logits). Batch-invariant mode computes each row as at b = 1 (torch's CPU matmul
  is not batch-invariant: `F.linear` on `[4, K]` differs from four `[1, K]` calls); the plain
  mode is one `F.linear` over all rows (`batch_invariant=False`, never the default). A
  batch-invariant kernel that reads the weight once for all rows replaces the loop here.
* **Attention: per sequence, on its own KV.** `BatchKV` stands in for the KV cache: each
  attention layer's `update` appends row i to sequence i's own transformers cache (the one
  its solo prefill built) and keeps the full keys; the attention function registered as
  `psr_batch` then runs the model's own attention implementation (sdpa / eager) once per
  sequence over its own keys, with the mask a solo decode step passes (none: one query
  attends to every cached position). Sequences of any lengths, no padding.
* **Row-invariant modules: one call.** A module whose own forward computes each row as
  that row alone (`_row_invariant`: psr's dense layers on the CPU, `dense.row_invariant`,
  whose forward is `cpu_kernels.cpu_linear`, each output element one row dot product in
  a fixed order whatever T, reading its weight once for the batch; transformers' RMS
  norms) runs once over all rows. Other leaves (activations, rotary embeddings) run once per row.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from psr.runtime.attention import ATTENTION as ROWS_ATTENTION
from psr.runtime.dense import row_invariant
from psr.runtime.norms import is_rms_norm

ATTENTION = "psr_batch"  # the attention implementation's name while a batch forward runs
_active = threading.local()  # the running batch forward's BatchKV (per thread)


def batch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over a batch `x [b, ..., K]` (the sequences along the
    first dimension): (invariant) each sequence's slice `[1, ..., K]` as its solo call
    computes it (the same shape: torch takes different kernels for `[1, 1, K]` and
    `[1, K]`), whatever the batch; else one call over every row."""
    if not invariant or x.shape[0] == 1:
        return F.linear(x, weight, bias)
    # Each slice in a fresh tensor: BLAS kernels may take another path for an input that
    # starts inside another tensor (alignment), and the solo call's input is its own.
    return torch.cat([F.linear(x[i : i + 1].clone(), weight, bias) for i in range(x.shape[0])])


def _row_invariant(module: nn.Module) -> bool:
    """Whether `module`'s own forward over `[b, ..., K]` gives each row bit-identically as
    over that row alone, so a batch forward calls it once (the seam's one predicate):

    * psr's dense layers on the CPU (`dense.row_invariant`): their forward is `cpu_linear`
      (each output element one row dot product in a fixed order, whatever T);
    * an RMS norm on the CPU whose forward is the bytecode of one of transformers' RMS
      norms audited (runtime/norms.py; float32: psr's row kernel, `cpu_rms_norm`; other
      dtypes the class's forward): casts, `x * x`, a sum over the last dim then a
      division (torch's CPU mean; a contiguous row is summed by one loop that depends on
      its length only, the rows split whole between threads), `+ eps`, rsqrt (`1 /
      sqrt`, correctly rounded in the vector and the scalar loop alike), products: no
      transcendental, nothing that mixes rows."""
    return _linear_row_invariant(module) or _norm_row_invariant(module)


def _linear_row_invariant(module: nn.Module) -> bool:
    """A dense layer whose CPU forward is `cpu_kernels.cpu_linear` (runtime/dense.py's
    predicate: RowLinear, QuantLinear, MlaKvB on the CPU)."""
    try:
        return row_invariant(module)
    except RuntimeError:  # compute='triton' without the interpreter: its forward refuses
        return False


def _norm_row_invariant(module: nn.Module) -> bool:
    """One of transformers' RMS norms, by its audited bytecode, on the CPU."""
    return is_rms_norm(module)


class BatchKV:
    """The KV cache a batch forward passes the model: row i is sequence i's own cache."""

    def __init__(self, caches: Sequence[Any]) -> None:
        self.caches = list(caches)
        # attention layer -> per sequence, its full (keys, values) after this step's update
        self.current: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Each row appended to its sequence's cache, as its solo decode step appends it."""
        self.current[layer_idx] = [
            kv.update(key_states[i : i + 1], value_states[i : i + 1], layer_idx, *args, **kwargs)
            for i, kv in enumerate(self.caches)
        ]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(int(kv.get_seq_length(layer_idx)) for kv in self.caches)


def _attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """The registered `psr_batch` attention: the model's own implementation once per
    sequence, over that sequence's keys and values (BatchKV), with no mask (a solo decode
    step's: its one query sees every cached position)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kv: BatchKV = _active.kv
    inner = _active.inner
    fn = sdpa_attention_forward if inner == "sdpa" else ALL_ATTENTION_FUNCTIONS.get(inner)
    if fn is None:  # eager: the module's own file defines it
        import sys

        fn = sys.modules[type(module).__module__].eager_attention_forward
    rows = kv.current[module.layer_idx]  # type: ignore[index]
    outs = [
        fn(module, query[i : i + 1].clone(), k, v, None, **kwargs)[0]
        for i, (k, v) in enumerate(rows)
    ]
    return torch.cat(outs), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


SUPPORTED_ATTENTION = ("sdpa", "eager", ROWS_ATTENTION)
_PSR = ("PSRRouter", "OffloadedExperts")  # psr's modules: the batch step runs them per row


def check_attention(config: Any) -> None:
    """Refuse (one line) a model whose attention a batch forward cannot run per sequence as
    its solo steps run it: other implementations, windows, linear attention."""
    impl = config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"batched decode runs attention with sdpa or eager, not {impl!r} (load the model "
            "with one of them)"
        )
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"batched decode supports full attention only, not {sorted(types - {'full_attention'})}"
            " or sliding windows"
        )


def latent(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek's MLA): the cache holds a latent that a linear
    over the whole cache expands after the update, so its attention modules run whole
    per sequence (`DenseSeam`), their projections at b = 1."""
    return bool(getattr(config, "kv_lora_rank", None))


class DenseSeam:
    """Every `nn.Linear` of a model through `batch_linear` while a batch forward runs, and
    its attention per sequence: the attention function (`psr_batch`), or for latent
    attention each attention module's whole forward once per sequence."""

    def __init__(self, model: nn.Module, invariant: bool) -> None:
        self.invariant = invariant
        # Row-invariant modules keep their own forward: one call for every row.
        whole = {id(m) for m in model.modules() if invariant and _row_invariant(m)}
        self.linears = [
            m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in whole
        ]
        self.latent = latent(model.config)
        self.attention = [
            m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")
        ]
        # Other row-local leaf modules (activations, rotary embeddings): once per sequence.
        # Elementwise transcendentals are not batch-invariant in torch (a tensor's first
        # elements take the vectorized loop, its tail the scalar one: SiLU over 16 elements
        # differs from the same 16 inside 32).
        skip = (nn.Linear, nn.Embedding, nn.Dropout)
        self.leaves = [
            m
            for m in model.modules()
            if not any(m.children())
            and not isinstance(m, skip)
            and type(m).__name__ not in _PSR
            and id(m) not in whole
        ]

    @staticmethod
    def _rows(m: nn.Module) -> Any:
        inner = m.forward

        def forward(*args: Any, **kw: Any) -> Any:
            kv: BatchKV = _active.kv
            b = len(kv.caches)
            first = args[0] if args else next(iter(kw.values()))
            rows = isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == b
            if _active.whole or b == 1 or not rows:
                return inner(*args, **kw)

            def cut(v: Any, i: int) -> Any:
                ok = isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b
                return v[i : i + 1].clone() if ok else v

            outs = [
                inner(*[cut(a, i) for a in args], **{k: cut(v, i) for k, v in kw.items()})
                for i in range(b)
            ]
            if isinstance(outs[0], tuple):
                return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
            return torch.cat(outs)

        return forward

    @staticmethod
    def _per_sequence(m: nn.Module) -> Any:
        inner = m.forward

        def forward(*args: Any, **kw: Any) -> tuple[torch.Tensor, None]:
            kv: BatchKV = _active.kv
            hidden = kw.pop("hidden_states") if "hidden_states" in kw else args[0]
            cos, sin = kw.pop("position_embeddings")
            pos = kw.pop("position_ids", None)
            kw.pop("attention_mask", None)
            name = next(k for k, v in kw.items() if v is kv)
            config: Any = m.config  # the model's own attention inside (psr_batch outside)
            config._attn_implementation = _active.inner
            _active.whole = True  # linears inside run as the solo call runs them
            try:
                outs = [
                    inner(hidden_states=hidden[i : i + 1].clone(), attention_mask=None,
                          position_embeddings=(cos[i : i + 1], sin[i : i + 1]),
                          position_ids=None if pos is None else pos[i : i + 1],
                          **{**kw, name: c})[0]
                    for i, c in enumerate(kv.caches)
                ]  # fmt: skip
            finally:
                config._attn_implementation = ATTENTION
                _active.whole = False
            return torch.cat(outs), None

        return forward

    def _forward(self, m: nn.Linear) -> Any:
        inv = self.invariant
        return lambda x: batch_linear(x, m.weight, m.bias, inv and not _active.whole)

    @contextmanager
    def active(self, config: Any, kv: BatchKV) -> Iterator[None]:
        """The seam and the per-sequence attention in place for one forward."""
        _register()
        inner = config._attn_implementation
        for lin in self.linears:
            lin.forward = self._forward(lin)  # type: ignore[method-assign]
        whole = self.attention if self.latent else []
        for m in whole:
            m.forward = self._per_sequence(m)
        leaves = self.leaves if self.invariant else []
        for m in leaves:
            m.forward = self._rows(m)
        _active.kv, _active.inner, _active.whole = kv, inner, False
        config._attn_implementation = ATTENTION
        try:
            yield
        finally:
            config._attn_implementation = inner
            _active.kv = _active.inner = None
            for mod in [*self.linears, *whole, *leaves]:
                del mod.forward
