"""`dense_format="native"` at load: a GGUF file's dense matrices kept in their blocks.

Before the loader reads any dense tensor, `keep_blocks` swaps each `nn.Linear` /
`nn.Embedding` of the meta model whose weight the file holds in a block type (the rule:
`psr.models.dense_bytes.keeps_blocks`) for a `QuantLinear` / `QuantEmbedding` over the
file's bytes on the device (`psr.runtime.dense`); a tied output head shares the
embedding's blocks. Every such tensor's type is checked first: one the dense kernels lack
is refused in one line before anything is copied. What is not kept (norms, routers, F32
tensors, biases) the loader reads as before.

`dense_format="int8"` / `"fp8"` on a float checkpoint: `quantize_dense` replaces the built
model's exact `nn.Linear` / `nn.Embedding` modules (not the MoE blocks' routers and experts)
by the same modules over per-output-channel codes (`psr_kernels.linear.quantize_weight`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psr.models.dense_bytes import computable
from psr.models.hf import block_of, model_family
from psr.runtime.dense import MlaKvB, QuantEmbedding, QuantLinear
from psr_kernels.linear import LinearFormat, quantize_weight

_KINDS = (nn.Linear, nn.Embedding)  # exactly these: subclasses may scale or reshape


def _candidates(model: nn.Module, ckpt: Any, names: list[str]) -> list[tuple[str, Any]]:
    """(module name, what the file keeps) of each weight in `names` kept in blocks: a
    (GGML type, blocks) pair, or DeepSeek's split kv_b (`GGUFCheckpoint.get_split_kv_b`)."""
    out = []
    for name in names:
        mod_name, _, attr = name.rpartition(".")
        if attr != "weight" or type(model.get_submodule(mod_name)) not in _KINDS:
            continue
        if name not in ckpt:
            continue
        got = ckpt.get_split_kv_b(name) or ckpt.get_blocks(name)
        if got is not None:
            out.append((mod_name, got))
    return out


def _types(kept: Any) -> list[str]:
    return [kept[0][0], kept[1][0]] if len(kept) == 3 else [kept[0]]


def _module(
    old: nn.Module, kept: Any, dtype: torch.dtype, dev: torch.device, compute: str
) -> nn.Module:
    """The module over the kept blocks (copied to `dev`) that replaces `old`."""

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=dev, memory_format=torch.contiguous_format, copy=True)

    if len(kept) == 3:  # split kv_b: (k type, k rows), (v type, v rows), heads
        (kt, k), (vt, v), heads = kept
        fk, fv = LinearFormat.parse(kt), LinearFormat.parse(vt)
        return MlaKvB(own(k), fk, own(v), fv, heads, compute=compute)
    fmt, blocks = LinearFormat.parse(kept[0]), own(kept[1])
    if isinstance(old, nn.Embedding):
        return QuantEmbedding(blocks, fmt, old.embedding_dim, dtype)
    assert isinstance(old, nn.Linear)  # _candidates: one of _KINDS
    return QuantLinear(blocks, fmt, old.in_features, bias=old.bias, compute=compute)


def keep_blocks(
    model: nn.Module, ckpt: Any, names: list[str], dtype: torch.dtype, device: torch.device,
    compute: str, tied: bool,
) -> set[str]:  # fmt: skip
    """Swap the meta model's modules whose weights (among `names`, HF names) the GGUF file
    `ckpt` keeps in blocks; returns the weights it loaded ("lm_head.weight" too when it
    ties the head to kept embeddings)."""
    found = _candidates(model, ckpt, names)
    for mod_name, kept in found:
        for qt in _types(kept):
            if not computable(qt):
                raise ValueError(
                    f"{ckpt.path}: dense tensor {ckpt.gguf_name(mod_name + '.weight')!r} is "
                    f"{qt}, a block type psr's dense kernels lack: load it with "
                    "dense_format='float'"
                )
    loaded: set[str] = set()
    for mod_name, kept in found:
        new = _module(model.get_submodule(mod_name), kept, dtype, device, compute)
        model.set_submodule(mod_name, new)
        loaded.add(mod_name + ".weight")
    emb = model.get_input_embeddings()  # type: ignore[operator]
    if tied and isinstance(emb, QuantEmbedding):
        head = QuantLinear(emb.qweight, emb.fmt, emb.embedding_dim, compute=compute)
        model.set_submodule("lm_head", head)
        loaded.add("lm_head.weight")
    return loaded


def quantize_dense(model: nn.Module, word: str, moe_idx: list[int], compute: str) -> None:
    """Quantize the built model's dense `nn.Linear` / `nn.Embedding` weights to `word`
    ("int8" | "fp8", a scale per output channel / embedding row), in place; a tied head
    shares the embedding's codes."""
    fam = model_family(model)
    skip: set[int] = set()  # the routers (psr's routing reads floats) and the experts
    for d in moe_idx:
        block = block_of(model, d)
        for sub in (block.get_submodule(fam.router), block.get_submodule("experts")):
            skip |= {id(m) for m in sub.modules()}
    fmt = LinearFormat.parse(word)
    emb = model.get_input_embeddings()  # type: ignore[operator]
    tied = getattr(getattr(model, "lm_head", None), "weight", None) is emb.weight
    for name, mod in list(model.named_modules()):
        if id(mod) in skip or type(mod) not in _KINDS or (tied and name == "lm_head"):
            continue
        q, s = quantize_weight(mod.weight, fmt)
        new: nn.Module
        if isinstance(mod, nn.Embedding):
            new = QuantEmbedding(q, fmt, mod.embedding_dim, mod.weight.dtype, scales=s)
        else:
            assert isinstance(mod, nn.Linear)
            new = QuantLinear(q, fmt, mod.in_features, scales=s, bias=mod.bias, compute=compute)
        model.set_submodule(name, new)
    emb = model.get_input_embeddings()  # type: ignore[operator]
    if tied and isinstance(emb, QuantEmbedding):
        head = QuantLinear(emb.qweight, fmt, emb.embedding_dim, scales=emb.scales, compute=compute)
        model.set_submodule("lm_head", head)
