"""Expert compute: the routed experts of a forward, read from slab slots (decode), from a
slab or host row one expert at a time (prefill), or from host rows for a scored window.

Decode on the CPU (the torch compute path with slabs in host memory) runs the C++ CPU
expert kernels (`psr.store.cpu_expert_ffn`: every routed row read in place, vectorised,
threaded over `torch.get_num_threads()`), not the torch reference: the one dispatch point
is `ExpertCompute.slab`. `PSR_CPU_EXPERTS=torch` (read when a model is built) forces the
reference (for A/B runs); `auto` (the default) or `kernels` take the kernels. The two
round differently (each deterministic), so they may give different tokens. While a model's
CPU forward is row-invariant (`ExpertCompute.row_invariant`, runtime/model.py) prefill takes
the kernels at any token count (never DENSE_FROM's matmul): each token's experts then sum
as its decode step sums them, whatever the chunk. While
torch.compile traces (graphs=True on the CPU) the kernels run as a custom op
(`psr_store::cpu_expert_ffn`), so a compiled forward computes what the eager one does.
"""

from __future__ import annotations

import os

import torch

import psr_kernels as pk
from psr.runtime import store_ops
from psr.runtime.spec import MoESpec
from psr.store import CPU_FLOAT_DTYPES, cpu_expert_ffn, cpu_layout

CPU_EXPERTS_ENV = "PSR_CPU_EXPERTS"
# Prefill from host rows (grouped_host): the tokens per expert from which dequantizing the
# expert once and one matmul over its tokens beats the CPU kernels token by token, per row
# type (measured at OLMoE's shape, H 2048 x F 1024, one thread: bench/results/prefill/);
# a type absent here takes the kernels at any count (bf16 / f16 rows, the K-quants).
DENSE_FROM: dict[str, int] = {"float32": 2, "int8": 64, "fp8": 96, "int4": 128, "Q8_0": 32}
CPU_EXPERTS_CHOICES: tuple[str, ...] = ("auto", "kernels", "torch")


def cpu_experts_mode() -> str:
    """`PSR_CPU_EXPERTS` (auto | kernels | torch; unset or empty: auto)."""
    raw = os.environ.get(CPU_EXPERTS_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in CPU_EXPERTS_CHOICES:
        raise ValueError(
            f"{CPU_EXPERTS_ENV}={raw!r}: expected one of {', '.join(CPU_EXPERTS_CHOICES)}"
        )
    return value


class ExpertCompute:
    """The kernels of one compute path (`ops`) over one expert row format (float rows, or
    quantized / GGML rows dequantized on the fly)."""

    def __init__(
        self, spec: MoESpec, ops: pk.KernelOps, expert_format: pk.RowFormat, group_size: int
    ) -> None:
        self.spec = spec
        self.ops = ops
        self.expert_format = expert_format
        self.group_size = group_size
        # The CPU kernels serve the reference path's decode on the CPU (see the module doc),
        # for the expert kind they compute: SwiGLU without biases, weights on the output
        # (gpt-oss's and Llama 4's kinds take the reference).
        plain = spec.activation == "silu" and not spec.expert_bias and not spec.input_scaled
        self.cpu_kernels = plain and ops.path == "torch" and cpu_experts_mode() != "torch"
        # Misses computed on the CPU (experts_on cpu / hybrid) take the kernels on any
        # device, for the kinds they compute; the other kinds take the reference there.
        self.host_kernels = plain and cpu_experts_mode() != "torch"
        # Row-invariant forward (OffloadedModel.set_row_invariant): no dense matmul per
        # expert in prefill; each token through the kernels as alone.
        self.row_invariant = False

    def _on_cpu_kernels(self, x: torch.Tensor, slab: torch.Tensor) -> bool:
        return (
            self.cpu_kernels
            and slab.device.type == "cpu"
            and x.device.type == "cpu"
            and (not self.expert_format.is_float or slab.dtype in CPU_FLOAT_DTYPES)
        )

    def batch_rows(self, x: torch.Tensor, slab: torch.Tensor) -> bool:
        """Whether `slab` computes the rows of `x` in one call as one-row calls compute each
        (the CPU kernels: items per token; batched decode, runtime/batch_experts.py)."""
        return self._on_cpu_kernels(x, slab)

    def slab(
        self,
        x: torch.Tensor,
        slab: torch.Tensor,
        slots: torch.Tensor,
        weights: torch.Tensor,
        slot_table: torch.Tensor | None = None,
        checked: bool = False,
        bias: torch.Tensor | None = None,
        skip_absent: bool = False,
    ) -> torch.Tensor:
        """The routed experts of `x` read from slab rows (`slots`, or expert ids looked up
        in the device `slot_table`); `checked`: arguments like these passed the kernel's
        checks before (skip them); `bias`: the routed experts' biases `[T, k, 2F + H]`;
        `skip_absent`: experts the table maps to -1 (computed on the CPU) add nothing."""
        c = self.spec
        if skip_absent and slab.shape[0] == 0:  # no slots (experts_on cpu): all absent
            return torch.zeros_like(x)
        if self._on_cpu_kernels(x, slab):  # compiled too: as a custom op (store_ops)
            return store_ops.cpu_kernels_ffn(
                x,
                slab,
                slots,
                weights,
                c.hidden_size,
                c.ffn_size,
                fmt=self.expert_format,
                group_size=self.group_size,
                slot_table=slot_table,
                skip_absent=skip_absent,
            )
        return self.ops.expert_ffn(
            x,
            slab,
            slots,
            weights,
            c.hidden_size,
            c.ffn_size,
            fmt=self.expert_format,
            group_size=self.group_size,
            out_dtype=x.dtype,
            check_slots=False,
            slot_table=slot_table,
            checked=checked,
            act=c.act,
            bias=bias,
            scale_input=c.input_scaled,
            skip_absent=skip_absent,
        )

    def host_layout(self, host: torch.Tensor) -> tuple[int, ...] | None:
        """The CPU kernels' layout of the host rows `host` (the store's), or None where the
        kernels do not compute this expert kind or format (then CPU experts take the
        reference, on the host: no hand-off in stream order)."""
        floats = self.expert_format.is_float and host.dtype not in CPU_FLOAT_DTYPES
        if not self.host_kernels or floats:
            return None
        c = self.spec
        row_bytes = host.shape[1] * host.element_size()
        return cpu_layout(
            self.expert_format, host.dtype, c.hidden_size, c.ffn_size, self.group_size, row_bytes
        )

    def _on_host_kernels(self, host: torch.Tensor) -> bool:
        return (
            self.host_kernels
            and (not self.expert_format.is_float or host.dtype in CPU_FLOAT_DTYPES)
            and not torch.compiler.is_compiling()
        )

    def host_experts(
        self,
        x: torch.Tensor,
        host: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        bias: torch.Tensor | None = None,
        slot_table: torch.Tensor | None = None,
        skip_absent: bool = False,
    ) -> torch.Tensor:
        """Routed experts `ids [1, c]` (expert ids: host row indices) of one token `x [1, H]`
        with their gate weights `[1, c]`, computed on the CPU from the store's host rows
        `host` (experts_on cpu / hybrid; `bias`: their `[1, c, 2F + H]`). On CUDA, x goes
        to the host and the result back, synchronously (the host step's; the device step
        hands off in stream order: `ExpertStore.cpu_experts`). Returns `[1, H]` on x's
        device. The CPU kernels also take `T` tokens and a `slot_table` of host rows with
        `skip_absent` (batched decode: each token as a one-token call)."""
        c = self.spec
        xc = x.to("cpu")
        w = weights.to("cpu", torch.float32)
        if self._on_host_kernels(host):
            y = cpu_expert_ffn(
                xc, host, ids.to("cpu"), w, c.hidden_size, c.ffn_size, fmt=self.expert_format,
                group_size=self.group_size, out_dtype=x.dtype, slot_table=slot_table,
                skip_absent=skip_absent,
            )  # fmt: skip
            return y.to(x.device)
        if slot_table is not None:
            raise ValueError("host_experts: a slot_table needs the CPU kernels")
        # The reference, one expert at a time in the given order (kinds the kernels lack).
        out = torch.zeros(xc.shape, dtype=torch.float32)
        for j, e in enumerate(ids.reshape(-1).tolist()):
            b = None if bias is None else bias.reshape(-1, bias.shape[-1])[j].to("cpu")
            out += self.weighted_row(host[e], xc, w[:, j], b).float()
        return out.to(x.dtype).to(x.device)

    def check_host_experts(self, host: torch.Tensor) -> None:
        """Raise a one-line error if the CPU cannot compute experts of these host rows (a
        format without a CPU kernel): one expert computed with weight 0 as the probe."""
        x = torch.zeros(1, self.spec.hidden_size)
        ids = torch.zeros(1, 1, dtype=torch.long)
        try:
            self.host_experts(x, host, ids, torch.zeros(1, 1))
        except (ValueError, RuntimeError, NotImplementedError) as e:
            fmt = self.expert_format.kernel_fmt or str(host.dtype).removeprefix("torch.")
            raise ValueError(
                f"experts on the CPU: expert format {fmt} has no CPU kernel ({e})"
            ) from None

    def dense_from(self, host: torch.Tensor) -> int | None:
        """Tokens per expert from which prefill dequantizes an expert of these host rows
        once and multiplies (None: the CPU kernels at any count; DENSE_FROM, none while the
        forward is row-invariant)."""
        fmt = self.expert_format
        if self.row_invariant:
            return None
        if fmt.is_float:
            kinds = [str(host.dtype).removeprefix("torch.")]
        elif fmt.is_blocks:
            kinds = [t.name for t in fmt.block_types]
        else:
            kinds = [fmt.name]
        if any(k not in DENSE_FROM for k in kinds):
            return None
        return max(DENSE_FROM[k] for k in kinds)

    def grouped_host(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        host: torch.Tensor,
        bias_table: torch.Tensor | None = None,
        only: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Routed experts of prefill tokens `x [T, H]` (`ids`, `weights` `[T, k]`) from the
        store's host rows, each expert once over its tokens: the experts with fewer than
        `dense_from` tokens in one call of the CPU kernels (each row read in place; the
        others skipped as absent), each other one dequantized once and multiplied (the
        reference's matmul), every expert so where the kernels do not compute this kind.
        `only` (bool `[E]`): just those experts (the CPU part of a split prefill). Sums in
        fp32; returns `out_dtype` (default x's dtype)."""
        E = self.spec.num_experts
        w = weights.float()
        counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
        if only is not None:
            counts = torch.where(only, counts, 0)
        kernels = x.device.type == "cpu" and self.host_layout(host) is not None
        cut = self.dense_from(host) if kernels else 0
        dense = torch.zeros(E, dtype=torch.bool) if cut is None else counts >= cut
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if kernels and not bool(dense[counts > 0].all()):
            table = torch.where(dense | (counts == 0), -1, torch.arange(E))
            out += cpu_expert_ffn(
                x, host, ids.long(), w, self.spec.hidden_size, self.spec.ffn_size,
                fmt=self.expert_format, group_size=self.group_size, slot_table=table,
                out_dtype=torch.float32, skip_absent=True,
            )  # fmt: skip
        each = torch.nonzero(dense & (counts > 0)).flatten().tolist()
        return self._each_expert(out, x, ids, w, host, bias_table, each).to(out_dtype or x.dtype)

    def _each_expert(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        ids: torch.Tensor,
        w: torch.Tensor,
        host: torch.Tensor,
        bias_table: torch.Tensor | None,
        experts: list[int],
    ) -> torch.Tensor:
        """Adds to `out` (fp32) each of `experts` once over the tokens that chose it, from
        its host row (dequantized once, one matmul)."""
        for e in experts:
            tok, pos = torch.where(ids == e)
            b = None if bias_table is None else bias_table[e]
            y = self.weighted_row(host[e].to(x.device), x[tok], w[tok, pos], b)
            # index_put_ with accumulate (tok is unique: the same sums): index_add_ on the
            # CPU costs ~100x more with 2+ threads (most of `psr demo`'s time).
            out.index_put_((tok,), y.float(), accumulate=True)
        return out

    def weighted_row(
        self,
        row: torch.Tensor,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One expert's contribution to tokens `x [N, H]` with their gate weights `w [N]`:
        w * expert(x), or expert(w x) where the kind scales the input (Llama 4). On the
        Triton path, with x and the row where the kernels run, the grouped prefill GEMM
        (`grouped_expert_ffn`: the row's weights read once for all N tokens, fp32 out);
        elsewhere the reference."""
        if self._grouped(x, row):
            c = self.spec
            return pk.grouped_expert_ffn(
                x, row[None], torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device),
                w[:, None], c.hidden_size, c.ffn_size, fmt=self.expert_format,
                group_size=self.group_size, out_dtype=torch.float32, check_slots=False,
                act=c.act, bias=None if bias is None else bias[None].float().contiguous(),
                scale_input=c.input_scaled,
            )  # fmt: skip
        if self.spec.input_scaled:
            return self.row(row, x * w[:, None].to(x.dtype), bias)
        return self.row(row, x, bias) * w[:, None]

    def _grouped(self, x: torch.Tensor, row: torch.Tensor) -> bool:
        """Whether the grouped Triton GEMM computes `row` over `x`: the Triton path, both
        on a device it runs on (CUDA; the CPU under the interpreter)."""
        here = x.device.type == "cuda" or (x.device.type == "cpu" and pk.interpreting())
        eager = not torch.compiler.is_compiling()  # prefill runs eager; never traced in
        return self.ops.path == "triton" and row.device == x.device and here and eager

    def row(
        self, row: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One expert of `x` from its slab (or host) row: prefill and scoring on the CPU
        (`bias`: the expert's `[2F + H]`, for experts with biases)."""
        c = self.spec
        return pk.expert_row_ffn_ref(
            x,
            row,
            c.hidden_size,
            c.ffn_size,
            fmt=self.expert_format,
            group_size=self.group_size,
            act=c.act,
            bias=bias,
        )

    def host_rows(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        host: torch.Tensor,
        bias_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Routed experts of many decode tokens read from the host copies (a scored
        window: no copies): on the torch path each expert once over the tokens that chose
        it, as prefill computes (equal to per-token steps up to rounding); on the Triton
        path the experts the window uses staged as a slab, 64 tokens per launch."""
        w = weights.float()
        if self.ops.path == "torch":
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            each = torch.unique(ids).tolist()
            return self._each_expert(out, x, ids, w, host, bias_table, each).to(x.dtype)
        used = torch.unique(ids)
        rows = host[used].to(x.device)  # the experts this window decodes with, as a slab
        local = torch.full((self.spec.num_experts,), -1, dtype=torch.long, device=x.device)
        local[used.to(x.device)] = torch.arange(len(used), device=x.device)
        slots = local[ids.to(x.device)]
        bias = None if bias_table is None else bias_table[ids.long()].contiguous()
        return torch.cat(
            [
                self.slab(
                    x[i : i + 64],
                    rows,
                    slots[i : i + 64],
                    w[i : i + 64],
                    bias=None if bias is None else bias[i : i + 64],
                )
                for i in range(0, x.shape[0], 64)
            ]
        )
