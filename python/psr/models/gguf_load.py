"""Experts into the store in their blocks as the file holds them: a GGUF file's, or a
pre-quantized checkpoint's (psr.models.prequant).

Each MoE layer's rows are its experts' gate, up and down bytes back to back
(`psr_kernels.ggml`), so a copy moves the file's bytes and the kernels dequantize inside
the GEMV. Types may differ per part and per layer (Q4_K_M: down in Q6_K in some layers):
each layer has its own row format and row size. Every expert tensor is checked (shape,
type) before the store is made, so a bad file fails before any copy.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

import psr_kernels as pk
from psr.models.files import is_gguf as is_gguf  # its home; imported from here too
from psr.models.rows import PartsReader, RowSource, block_source
from psr.models.tiers import gguf_locators
from psr.runtime.spec import MoESpec

PARTS = ("gate", "up", "down")


class ExpertTensorLike(Protocol):
    """One stacked expert matrix of a GGUF file (psr.models.gguf.ExpertTensor)."""

    @property
    def name(self) -> str: ...
    @property
    def ggml_type(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def data(self) -> np.ndarray: ...  # [E, row_bytes] uint8, a view of the file's map
    def expert(self, e: int) -> torch.Tensor: ...


class GGUFExperts(Protocol):
    """What this module reads of a GGUF checkpoint (psr.models.gguf.GGUFCheckpoint)."""

    @property
    def path(self) -> Path: ...
    def expert_tensors(self, decoder_layer: int) -> dict[str, ExpertTensorLike]: ...


def open_gguf(path: str | Path) -> Any:
    """The GGUF checkpoint at `path` (psr.models.gguf.GGUFCheckpoint; imported here, on
    use, as it pulls in gguf-py)."""
    from psr.models.gguf import GGUFCheckpoint

    return GGUFCheckpoint(path)


def layer_formats(ckpt: GGUFExperts, spec: MoESpec, moe_idx: list[int]) -> list[pk.RowFormat]:
    """Each MoE layer's row format (GGML blocks, a type per part), after checking its
    expert tensors' shapes and types against the config (psr.models.gguf.layer_formats,
    torch-free)."""
    from psr.models.gguf import layer_formats as formats

    return formats(ckpt, spec.num_experts, spec.hidden_size, spec.ffn_size, moe_idx)


def gguf_readers(ckpt: GGUFExperts, moe_idx: list[int]) -> list[PartsReader]:
    """Per MoE layer, expert id -> its gate, up, down bytes straight from the file's map."""

    def reader(d: int) -> PartsReader:
        parts = ckpt.expert_tensors(d)
        return lambda e: [parts[p].expert(e).reshape(-1) for p in PARTS]

    return [reader(d) for d in moe_idx]


def drop_pages(addr: int, nbytes: int) -> None:
    """Drop the whole pages of a read-only file mapping in [addr, addr + nbytes) from this
    process's resident memory (Linux madvise DONTNEED; elsewhere nothing): reading them
    again faults them back in from the file, so nothing is lost."""
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return
    page = mmap.PAGESIZE
    start = -(-addr // page) * page
    end = (addr + nbytes) // page * page
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, end - start, 4)  # MADV_DONTNEED; a failure only costs memory


def gguf_release(ckpt: GGUFExperts, moe_idx: list[int]) -> Callable[[int], None]:
    """MoE layer i -> its expert tensors' mapped pages dropped once the store holds them, so
    a load never holds the experts twice (resident: the store plus one layer's pages)."""

    def release(i: int) -> None:
        for t in ckpt.expert_tensors(moe_idx[i]).values():
            drop_pages(t.data.ctypes.data, t.data.nbytes)

    return release


def gguf_source(ckpt: Any, spec: MoESpec, moe_idx: list[int]) -> RowSource:
    """A GGUF file's experts as the store's rows: every expert tensor checked first (so a bad
    file fails before any copy), each row the file's bytes (pageable where the tier plan
    leaves it in the file), each layer's pages dropped once the store holds them."""
    fmts = layer_formats(ckpt, spec, moe_idx)
    locs = gguf_locators(ckpt, moe_idx, fmts, spec.hidden_size, spec.ffn_size)
    release = gguf_release(ckpt, moe_idx)
    return block_source(gguf_readers(ckpt, moe_idx), fmts, spec, "gguf", locs, None, release)
