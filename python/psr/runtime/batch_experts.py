"""The routed experts of a batched decode step (runtime/batch.py), each row's sum as its
solo host step computes it.

A row's experts are its logical members (read from the shared slab) and, under
experts_on cpu / hybrid, the misses its capped `use` left out (computed from the host rows).
Solo, a token's output is the slab part, the CPU part, or their sum (both in routed order,
psr.runtime.expert_placement). Here, on the CPU expert kernels, each part is one call over
every row of the batch (the kernels compute each token as a one-token call: items per
token, summed over its experts in order); an expert a row does not take in a part is
absent from it (`skip_absent`: it adds exactly nothing, as the solo call without it). Other
compute paths (the torch reference, Triton) compute row by row, the host step's calls.
The slab's experts are read in runs of rows whose union fits the slab (batch_slab.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from psr.runtime.batch_slab import SharedSlab
from psr.runtime.compute import ExpertCompute
from psr.runtime.layer import MoELayer
from psr.runtime.prefill import reads_host
from psr.store import CopyReason

if TYPE_CHECKING:
    from psr.runtime.context import StepContext


class Row(Protocol):
    @property
    def routed(self) -> list[int]: ...
    @property
    def cpu(self) -> set[int]: ...
    @property
    def members(self) -> list[int]: ...


def batch_experts(
    rt: StepContext, slab: SharedSlab, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor,
    weights: torch.Tensor, rows: Sequence[Row],
) -> torch.Tensor:  # fmt: skip
    """Every row's routed experts `[b, H]` (x's dtype)."""
    i = layer.index
    comp, host = rt.computes[i], rt.store.host(i)
    any_cpu = any(r.cpu for r in rows)
    together = (
        layer.expert_bias is None
        and comp.batch_rows(x, rt.store.slab(i))
        and (not any_cpu or comp.host_layout(host) is not None)
    )
    w = weights.float()
    y_slab = torch.zeros_like(x)
    everyone = list(range(len(rows)))
    for group, where, s in _runs(rt, slab, layer, rows):
        if together and any(rows[g].members for g in group):
            if group == everyone:  # one run of every row (the usual case): no scatter
                y_slab = _slab_rows(comp, s, x, w, rows, where).to(x.dtype)
                continue
            at = torch.tensor(group, device=x.device)
            y_slab[at] = _slab_rows(comp, s, x[at], w[at], [rows[g] for g in group], where)
        for g in [] if together else group:
            y_slab[g] = _solo_row(rt, layer, s, x[g : g + 1], ids[g : g + 1],
                                  w[g : g + 1], rows[g], where)[0]  # fmt: skip
    if not any_cpu or not together:
        return y_slab
    k = ids.shape[1]
    table = [e if e in r.cpu else -1 for r in rows for e in r.routed]
    virtual = torch.arange(len(rows) * k).view(len(rows), k)
    y_cpu = comp.host_experts(x, host, virtual, w, slot_table=torch.tensor(table), skip_absent=True)
    cpu, members = [bool(r.cpu) for r in rows], [bool(r.members) for r in rows]
    if all(cpu) and all(members):  # every row both parts: the solo step's sum
        return y_slab + y_cpu
    has_cpu = torch.tensor(cpu, device=x.device)[:, None]
    has_slab = torch.tensor(members, device=x.device)[:, None]
    return torch.where(has_slab, torch.where(has_cpu, y_slab + y_cpu, y_slab), y_cpu)


def _runs(
    rt: StepContext, slab: SharedSlab, layer: MoELayer, rows: Sequence[Row]
) -> Iterator[tuple[list[int], dict[int, int], torch.Tensor]]:
    """(rows, expert -> row of `s`, `s`) to compute the members from: where prefill reads
    (the CPU backend, every expert held: the host rows themselves, the same bytes a slot
    would hold, no copy), else the shared slab in runs of rows whose union fits it, each
    run's missing experts copied once and its slots held while it computes."""
    i = layer.index
    if reads_host(rt, layer):
        yield list(range(len(rows))), _IDENTITY, rt.store.host(i)
        return
    for group in slab.groups(i, [r.members for r in rows]):
        union = sorted({e for g in group for e in rows[g].members})
        if not union:  # CPU experts only (experts_on cpu): nothing read from the slab
            yield group, {}, rt.store.slab(i)
            continue
        where = slab.ensure(i, union, CopyReason.MISS)
        slots = [where[e] for e in union]
        if slab.reads is not None:
            slab.reads.append((i, union, slots))
        with rt.store.reading(i, slots, union) as s:
            yield group, where, s


class _Identity(dict[int, int]):
    """Expert e -> host row e."""

    def __missing__(self, e: int) -> int:
        return e


_IDENTITY = _Identity()


def _slab_rows(
    comp: ExpertCompute, s: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
    rows: Sequence[Row], where: dict[int, int],
) -> torch.Tensor:  # fmt: skip
    """The slab part of these rows in one kernel call: their slots, or (some row has CPU
    experts) a per-row table in which the CPU ones are absent."""
    if not any(r.cpu for r in rows):
        st = torch.tensor([[where[e] for e in r.routed] for r in rows], device=x.device)
        return comp.slab(x, s, st, w)
    k = len(rows[0].routed)
    table = [-1 if e in r.cpu else where[e] for r in rows for e in r.routed]
    virtual = torch.arange(len(rows) * k).view(len(rows), k)
    return comp.slab(x, s, virtual, w, torch.tensor(table), skip_absent=True)


def _solo_row(
    rt: StepContext, layer: MoELayer, s: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
    w: torch.Tensor, row: Row, where: dict[int, int],
) -> torch.Tensor:  # fmt: skip
    """One row as the host decode step computes it (placement.host_experts)."""
    comp, bias = rt.computes[layer.index], layer.biases(ids)
    on_slab = [j for j, e in enumerate(row.routed) if e not in row.cpu]
    on_cpu = [j for j, e in enumerate(row.routed) if e in row.cpu]

    def part(at: torch.Tensor) -> torch.Tensor | None:
        return None if bias is None else bias[:, at]

    y = None
    if on_cpu:
        idx = torch.tensor(on_cpu, device=ids.device)
        host = rt.store.host(layer.index)
        y = comp.host_experts(x, host, ids[:, idx], w[:, idx], part(idx))
        if not on_slab:
            return y
    at = torch.tensor(on_slab, device=ids.device)
    st = torch.tensor([[where[row.routed[j]] for j in on_slab]], device=ids.device)
    out = comp.slab(x, s, st, w[:, at], bias=part(at))
    return out if y is None else out + y
