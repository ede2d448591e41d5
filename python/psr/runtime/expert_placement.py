"""Where a decode step computes its misses (`experts_on`, issue 27): one class per placement,
`make_placement` the factory (as vLLM's one class per routing method, KTransformers' experts
operator with one subclass per placement).

  gpu     every miss copied into the slab (the spec's `use`)
  cpu     no miss copied: the misses computed on the CPU from the host rows
  hybrid  at most `caps[l]` misses of MoE layer l copied per step, the rest on the CPU

A placement owns what the steps ask of it: each layer's cap (`max_inserts`), whether the
device kernel lists the misses it does not copy (`capped`), the experts' forward of the
device and host steps, whether the device step runs it and whether graphs can capture it.
The caps of 'hybrid' without explicit ones come from the machine profile (placement.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from psr.runtime.layer import MoELayer
from psr.vocab import experts_on_choice

if TYPE_CHECKING:
    from psr.runtime.device_decode import DeviceDecode
    from psr.runtime.host_decode import HostDecode


class ExpertPlacement:
    """Where misses are computed, per placement (a subclass each); the defaults are gpu's:
    every miss copied into the slab, every routed expert read from it."""

    name: ClassVar[str]
    # Some misses are not copied: the decode kernel lists them, the CPU computes them from
    # the host rows in place (so every expert must be held in host memory).
    capped: ClassVar[bool] = False
    takes_caps: ClassVar[bool] = False  # the caps are chosen (hybrid_m or the machine profile)

    def __init__(self, caps: Sequence[int | None]) -> None:
        self.caps: list[int | None] = list(caps)  # per MoE layer; None: every miss copied

    @classmethod
    def fixed_caps(cls, num_layers: int) -> list[int | None]:
        """The caps of a placement that takes none: every miss copied (None)."""
        return [None] * num_layers

    def max_inserts(self, layer: int) -> int | None:
        """The most misses of MoE layer `layer` one decode step copies (None: all)."""
        return self.caps[layer]

    def runs_on_device_step(self, device: DeviceDecode) -> bool:
        """Whether the device step computes this placement (else the host step does)."""
        return True

    def graphs_blocker(self, device: DeviceDecode) -> str | None:
        """Why graphs cannot capture a decode token under this placement (None: they can)."""
        return None

    def device_experts(
        self, step: DeviceDecode, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The device step's experts forward: every routed expert from its slab slot."""
        return step.slab_experts(layer, x, ids, weights)

    def host_experts(
        self, step: HostDecode, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor, routed: list[int], cpu: set[int],
    ) -> torch.Tensor:  # fmt: skip
        """The host step's experts forward for `routed` (`cpu`: the misses `use` did not
        insert, empty here)."""
        return step.slab_experts(layer, x, ids, weights, routed)


class GpuPlacement(ExpertPlacement):
    """Every miss copied into the slab: the spec's `use`."""

    name = "gpu"


class CpuPlacement(ExpertPlacement):
    """No miss copied: every miss of a decode step computed on the CPU from the host rows."""

    name = "cpu"
    capped = True

    @classmethod
    def fixed_caps(cls, num_layers: int) -> list[int | None]:
        return [0] * num_layers  # no miss copied

    def runs_on_device_step(self, device: DeviceDecode) -> bool:
        # On CUDA the device step needs the hand-off (CPU kernels for this expert kind and
        # format); the CPU backend reads the CPU list's count where they are missing.
        return device.rt.store.backend == "cpu" or device.hands_off()

    def graphs_blocker(self, device: DeviceDecode) -> str | None:
        if device.hands_off():
            return None
        return (
            f"experts_on={self.name!r} with experts the CPU kernels do not compute "
            "(the reference runs them on the host: host-driven step)"
        )

    def device_experts(
        self, step: DeviceDecode, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The routed members from the slab through the slot map (the CPU list's experts are
        not members: slot -1, absent), the CPU list's from the host rows, each part in
        routed order, summed as the host step sums them: handed off in stream order where
        the CPU kernels compute every layer, else with the list's count read."""
        if step.hands_off():
            return step.handoff_experts(layer, x, ids, weights)
        return self._reading(step, layer, x, ids, weights)

    def _reading(
        self, step: DeviceDecode, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """For kinds or formats without CPU kernels (CPU backend only): the list's count is
        read (one read per layer: a memory read on the CPU backend, no device to wait
        for), as the reference takes a host-sized work list."""
        i, rt = layer.index, step.rt
        n_cpu = step.cpu_list_count(i)
        comp, bias, slab, table = (
            rt.computes[i],
            layer.biases(ids),
            step.slabs[i],
            step.slot_table[i],
        )
        if n_cpu == 0:
            return comp.slab(x, slab, ids, weights, table, bias=bias)
        on_cpu = (ids[0][:, None] == step.cpu_rows[i][None, :n_cpu]).any(1)
        order = torch.argsort(on_cpu.to(torch.int8), stable=True)  # slab ones, then CPU ones
        k_slab = ids.shape[1] - n_cpu
        at_slab, at_cpu = order[:k_slab], order[k_slab:]
        w = weights.float()

        def part(at: torch.Tensor) -> torch.Tensor | None:
            return None if bias is None else bias[:, at]

        y = comp.host_experts(x, rt.store.host(i), ids[:, at_cpu], w[:, at_cpu], part(at_cpu))
        if k_slab == 0:
            return y
        return comp.slab(x, slab, ids[:, at_slab], w[:, at_slab], table, bias=part(at_slab)) + y

    def host_experts(
        self, step: HostDecode, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor, routed: list[int], cpu: set[int],
    ) -> torch.Tensor:  # fmt: skip
        """The members among `routed` from their slab slots, plus the misses `use` did not
        insert (`cpu`) computed on the CPU from the host rows, in routed order within each
        part; summed. On CUDA the hand-off is synchronous (x to the host, the result
        back); the host step already reads the ids per layer."""
        if not cpu:
            return step.slab_experts(layer, x, ids, weights, routed)
        rt, i = step.rt, layer.index
        on_slab = [j for j, e in enumerate(routed) if e not in cpu]
        on_cpu = [j for j, e in enumerate(routed) if e in cpu]
        bias, w, comp = layer.biases(ids), weights.float(), rt.computes[i]
        idx = torch.tensor(on_cpu, device=ids.device)
        part = None if bias is None else bias[:, idx]
        y = comp.host_experts(x, rt.store.host(i), ids[:, idx], w[:, idx], part)
        slab_ids = [routed[j] for j in on_slab]
        slots = layer.slots.slots(slab_ids)
        if rt.acct.recorder is not None:
            rt.acct.recorder.read(i, slots)
        if not slots:
            return y
        at = torch.tensor(on_slab, device=ids.device)
        st = torch.tensor([slots], device=ids.device)
        with rt.store.reading(i, slots, slab_ids) as slab:
            out = comp.slab(x, slab, st, w[:, at], bias=None if bias is None else bias[:, at])
        return out + y


class HybridPlacement(CpuPlacement):
    """At most `caps[l]` misses of MoE layer l copied per step, the rest on the CPU."""

    name = "hybrid"
    takes_caps = True


PLACEMENTS: dict[str, type[ExpertPlacement]] = {
    cls.name: cls for cls in (GpuPlacement, CpuPlacement, HybridPlacement)
}


def placement_class(experts_on: str) -> type[ExpertPlacement]:
    """The placement class `experts_on` names (ValueError naming the choices)."""
    return PLACEMENTS[experts_on_choice(experts_on)]


def make_placement(
    experts_on: str, caps: Sequence[int | None], top_k: int, num_layers: int
) -> ExpertPlacement:
    """The placement `experts_on` names with its per-layer miss-copy caps, checked: one
    per MoE layer, each an int in [0, top_k] ('gpu': None, all copied, or such an int)."""
    cls = placement_class(experts_on)
    caps = list(caps)
    if len(caps) != num_layers:
        raise ValueError(f"{len(caps)} miss-copy caps for {num_layers} MoE layers")
    for i, m in enumerate(caps):
        if m is None and not cls.capped:
            continue
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= top_k:
            raise ValueError(
                f"experts_on={experts_on!r}: MoE layer {i}'s miss-copy cap {m!r} must be an "
                f"int in [0, top_k={top_k}]"
            )
    return cls(caps if cls.capped else cls.fixed_caps(num_layers))
