"""The dense (non-expert) part of a GGUF model per `dense_format`: which tensors stay in the
file's blocks, and the device bytes they take, from the header's tensor table alone (no
torch). The one rule the loader (`psr.models.loader`: what it builds), `psr inspect`, the
memory plan and bench/fit_table.py (what they count) share.

`dense_format="native"` keeps a tensor as the file stores it when it is a 2-D matrix in a
block type psr's dense kernels compute (`psr_kernels.linear`), other than F32; everything
else becomes the model dtype, as `"float"` makes every tensor:

* F32 tensors, 1-D ones (norms, biases, gates of one row), in the dtype;
* the routers (`ffn_gate_inp`): psr's routing kernels read float weights.

llama.cpp's split MLA `attn_k_b [heads, rank, nope]` / `attn_v_b [heads, v, rank]` (3-D)
stay in their blocks whatever their type: DeepSeek's `kv_b_proj` computes from both
(`psr.runtime.dense.MlaKvB`; the k half is the transposed weight, `linear_heads_t`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from psr.models.formats import rowformat
from psr.vocab import DENSE_FORMATS

# GGUF tensors transformers' model holds as no parameter: the router's correction bias (a
# buffer), llama.cpp's rope frequencies (computed), the MTP layers' tensors (no layer)
_NOT_PARAMETERS = re.compile(r"\.exp_probs_b\.|^rope_freqs\.|\.nextn\.")
_LAYER = re.compile(r"^blk\.(\d+)\.")
# GGUF tensors kept float whatever their type (module doc), and llama.cpp's split MLA
# kv_b, kept in blocks whatever their type (psr.runtime.dense.MlaKvB computes them).
_FLOAT_ALWAYS = re.compile(r"\.ffn_gate_inp\.")
_MLA_SPLIT = re.compile(r"\.attn_[kv]_b\.weight$")


class TensorEntry(NamedTuple):
    """A GGUF tensor as its header describes it."""

    type_name: str  # GGML type ("Q4_K", "F32", ...)
    shape: tuple[int, ...]  # numpy order (rows first)
    nbytes: int  # in the file


def dense_part(names: Iterable[str], num_layers: int) -> list[str]:
    """The GGUF tensors (of `names`) the device holds beside the routed experts: every one
    but the experts (`*_exps`), llama.cpp's MTP layers (after the last of `num_layers`) and
    what transformers' model holds as no parameter."""

    def counted(name: str) -> bool:
        m = _LAYER.match(name)
        in_model = m is None or int(m[1]) < num_layers
        return in_model and "_exps." not in name and not _NOT_PARAMETERS.search(name)

    return [n for n in names if counted(n)]


def keeps_blocks(gguf_name: str, type_name: str, ndim: int) -> bool:
    """Whether `dense_format="native"` keeps this dense GGUF tensor in its blocks."""
    if _MLA_SPLIT.search(gguf_name):
        return ndim == 3
    return ndim == 2 and type_name != "F32" and not _FLOAT_ALWAYS.search(gguf_name)


def computable(type_name: str) -> bool:
    """A block type psr's dense kernels compute (the expert kernels' table)."""
    return type_name in rowformat().BLOCK_TYPE_TRAITS


def dense_bytes(
    table: Mapping[str, TensorEntry], names: Iterable[str], dense_format: str, itemsize: int
) -> int:
    """Device bytes of the dense tensors `names` of a GGUF `table` under `dense_format`
    ("native" | "float"), the float ones in a dtype of `itemsize` bytes; tied embeddings
    (no `output.weight`) count once, as the model shares them."""
    if dense_format not in DENSE_FORMATS:
        raise ValueError(f"dense_format must be one of {', '.join(DENSE_FORMATS)}")
    total = 0
    for name in names:
        t = table[name]
        if dense_format == "native" and keeps_blocks(name, t.type_name, len(t.shape)):
            total += t.nbytes
        else:
            total += math.prod(t.shape) * itemsize
    return total


def gguf_dense_bytes(ck: Any, dense_format: str, itemsize: int) -> int:
    """Device bytes of an opened GGUF checkpoint's dense part (`psr.models.gguf.
    GGUFCheckpoint`: its header's table) under `dense_format`, float tensors in a dtype of
    `itemsize` bytes: what `psr.load` puts on the device beside the slab (the memory plan's
    and `psr inspect`'s figure)."""
    table: Mapping[str, TensorEntry] = ck.tensor_table()
    names = dense_part(table, int(ck.config_dict["num_hidden_layers"]))
    return dense_bytes(table, names, dense_format, itemsize)
