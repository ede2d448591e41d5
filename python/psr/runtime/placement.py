"""Where a decode step computes its misses (`experts_on`, issue 27): each MoE layer's cap
on the misses one step copies, from the mode, an explicit `hybrid_m`, or this machine's
profile (psr.machine)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

import psr.machine as machine
from psr.runtime.engine import OffloadRuntime
from psr.runtime.expert_placement import placement_class


def layer_keys(rt: OffloadRuntime) -> list[str]:
    """Each MoE layer's expert shape and format as the machine profile keys it."""
    c = rt.spec
    dtype = str(rt.store.dtype).removeprefix("torch.")
    return [
        machine.shape_key(c.hidden_size, c.ffn_size, dtype if f.is_float else f.name)
        for f in rt.row_formats
    ]


def here(rt: OffloadRuntime) -> dict[str, object]:
    """This machine's fingerprint, as a profile measured here records it."""
    gpu = torch.cuda.get_device_name(rt.store.device) if rt.store.backend == "cuda" else "none"
    return machine.fingerprint(torch.get_num_threads(), gpu, machine.psr_version())


def resolve_caps(
    rt: OffloadRuntime,
    experts_on: str,
    hybrid_m: int | Sequence[int] | None = None,
    profile: machine.MachineProfile | None = None,
) -> list[int | None]:
    """The per-layer miss-copy caps of `experts_on`: 'gpu' None (all copied), 'cpu' 0,
    'hybrid' `hybrid_m` (one int or one per MoE layer) or, without it, chosen from the
    machine profile (`profile`, else the saved one; psr.machine.hybrid_caps)."""
    cls = placement_class(experts_on)
    L, k = len(rt.layers), rt.spec.top_k
    if hybrid_m is not None and not cls.takes_caps:
        raise ValueError(f"hybrid_m is for experts_on='hybrid', not {experts_on!r}")
    if not cls.takes_caps:
        return cls.fixed_caps(L)
    if hybrid_m is not None:
        caps = [hybrid_m] * L if isinstance(hybrid_m, int) else list(hybrid_m)
        if len(caps) != L:
            raise ValueError(f"hybrid_m has {len(caps)} entries for {L} MoE layers")
        for m in caps:
            if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= k:
                raise ValueError(f"hybrid_m={m!r} must be an int in [0, top_k={k}]")
        return list(caps)
    prof = machine.read_profile() if profile is None else profile
    if prof is not None:
        warning = machine.mismatch(prof, here(rt))
        if warning is not None:
            machine.log.warning(warning)
    return list(
        machine.hybrid_caps(
            prof,
            layer_keys(rt),
            top_k=k,
            capacity=rt.capacity,
            num_experts=rt.spec.num_experts,
            backend=rt.store.backend,
        )
    )


def set_experts_on(
    rt: OffloadRuntime,
    experts_on: str,
    hybrid_m: int | Sequence[int] | None = None,
    profile: machine.MachineProfile | None = None,
) -> list[int | None]:
    """Resolve the caps and set them on the runtime; returns them."""
    caps = resolve_caps(rt, experts_on, hybrid_m, profile)
    rt.set_experts_on(experts_on, caps)
    return caps


def set_prefill_split(
    rt: OffloadRuntime,
    split: machine.PrefillSplit | None = None,
    profile: machine.MachineProfile | None = None,
) -> machine.PrefillSplit:
    """Set which experts a slab-path prefill chunk computes on the CPU: `split`, else
    chosen from the machine profile (`profile`, else the saved one; psr.machine.
    prefill_split: every expert copied where the profile has no costs, or where a layer
    has pageable rows, which the CPU kernels cannot read in place). Returns it."""
    if split is None:
        prof = machine.read_profile() if profile is None else profile
        if prof is not None:
            warning = machine.mismatch(prof, here(rt))
            if warning is not None:
                machine.log.warning(warning)
        split = machine.prefill_split(prof, layer_keys(rt))
        if any(s.num_held not in (None, s.num_experts) for s in rt.store.layers):
            split = machine.PrefillSplit.off(len(rt.layers))  # pageable rows: copied only
    rt.set_prefill_split(split)
    return split
