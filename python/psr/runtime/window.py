"""Teacher-forced scoring: a whole window in one forward, routed and counted exactly as
token-by-token decoding would route and count it.

The first `prompt_len` tokens are prefill (exact routing, then the cache seed, the slot
map staged as prefill stages it); each later token (or, in block mode, each run of
`block` tokens) is a decode step under the policy, with the prefetches issued by earlier
layers for that step inserted just before it routes: decoding's order. No copies are
issued (the slot map and the trace evolve as in decoding) and the experts are read from
the host copies, so logits agree with decoding to floating-point rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from psr.runtime.host_decode import VerifyBlock
from psr.runtime.layer import MoELayer
from psr.runtime.prefill import plan_prefill, reads_host
from psr.runtime.step import Routed, Step

if TYPE_CHECKING:
    from psr.runtime.context import StepContext


@dataclass
class Scoring:
    """A teacher-forced window scored in one forward (`OffloadRuntime.begin_scoring`)."""

    prompt_len: int
    length: int
    first_record: int  # index of its first decode step in stats.per_token
    first_trace: int  # ... and in the recorder's trace (-1: not recording)
    block: int = 1  # decode tokens per step: 1, or a verify block's size in block mode
    # MoE layer -> the predictions into it, in issue order: (issuing MoE layer, at most how
    # many to insert, per step the predicted ids).
    queued: dict[int, list[tuple[int, int, list[list[int]]]]] = field(default_factory=dict)

    @property
    def steps(self) -> list[tuple[int, int]]:
        """(first, end) token positions of each decode step after the prompt."""
        P, T, b = self.prompt_len, self.length, self.block
        return [(t, min(t + b, T)) for t in range(P, T, b)]


class ScoringWindow(Step):
    name = "window"

    def __init__(self, runtime: StepContext, scoring: Scoring) -> None:
        super().__init__(runtime)
        self.sc = scoring
        self.blocks = VerifyBlock(runtime)  # block mode's set routing and prediction
        self.pending: dict[int, torch.Tensor] = {}

    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        """Route a window layer by layer (module docstring). This layer's predictions for
        all decode tokens are made here, in one batch, and queued for the layers they go
        to."""
        rt, sc, L = self.rt, self.sc, layer
        logits = self.logits(L, x)
        P, T = sc.prompt_len, logits.shape[0]
        if T != sc.length:
            raise ValueError(f"scoring expected {sc.length} tokens, the forward has {T}")
        lam = rt.steering.lam(L)
        exact, biased = rt.spec.route_spec(), rt.spec.route_spec(lam)
        if not bool(torch.isfinite(logits).all()):  # once for the window, not per token
            raise ValueError(f"MoE layer {L.index}: router logits contain NaN or inf")
        w_p, ids_p = rt.ops.route(logits[:P], exact, bias=L.bias, check_finite=False)
        L.history.extend(ids_p.tolist())
        # The slot map as prefill leaves it: staged through the slab, or (host reads) not.
        staged = [] if reads_host(rt, L) else ids_p.flatten().tolist()
        plan = plan_prefill(L.slots, L.history, staged)
        L.cache.reset(plan.init)
        L.seeded = True
        ws, idss = [w_p], [ids_p]
        queued = sc.queued.pop(L.index, [])
        steps = sc.steps
        rec = rt.acct.recorder
        for j, (t0, t1) in enumerate(steps):
            if L.index == 0:
                rt.acct.open_token()
            rt.acct.token = rt.acct.stats.per_token[sc.first_record + j]
            trace_token = sc.first_trace + j if rec is not None else -1
            for issuer, n, preds in queued:  # issued by earlier layers' steps of this token
                rt.book.prefetch(L, preds[j], n, physical=False, at=(trace_token, issuer))
            if sc.block > 1:
                w, ids = self.blocks.route_block(L, logits[t0:t1], False, trace_token)
                routed, _ = self.blocks.pending.pop(L.index)  # the members: the CPU's read no slot
                self.blocks.cpu.pop(L.index, None)
            else:
                mask = rt.book.mask(L, rt.policy, logits.device) if lam > 0 else None
                w, ids, sub = rt.ops.route_counted(
                    logits[t0:t1], biased, mask=mask, bias=L.bias, check_finite=False
                )
                *routed, substituted = torch.cat([ids[0], sub.to(ids.dtype)]).tolist()
                cpu = rt.book.use(L, routed, False, trace_token, substituted, rt.max_inserts(L))
                if cpu:  # experts_on cpu / hybrid: the CPU's experts read no slot
                    routed = [e for e in routed if e not in set(cpu)]
            if rec is not None:
                rec.read(L.index, L.slots.slots(routed))
            ws.append(w)
            idss.append(ids)
        residual = L.need_residual()
        if sc.block > 1:
            block_preds = [self.blocks.predict_block(L, residual[t0:t1]) for t0, t1 in steps]
            if block_preds and block_preds[0] is not None:
                entry = (L.index, rt.policy.n, [p or [] for p in block_preds])
                sc.queued.setdefault(L.index + 1, []).append(entry)
        else:
            for target, n, pred in rt.steering.predictions(L, residual[P:]):
                sc.queued.setdefault(target, []).append((L.index, n, pred))
        ids_all = torch.cat(idss)
        self.pending[L.index] = ids_all
        return self.out(logits, torch.cat(ws), ids_all)

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Experts of a scored window, read from the host copies (no copies issued): the
        prompt as prefill computes it, then every decode token as a decode step does."""
        rt, L = self.rt, layer
        if ids is not self.pending.pop(L.index, None):
            raise RuntimeError(f"MoE layer {L.index}: experts called without a matching route")
        P = self.sc.prompt_len
        host = rt.store.host(L.index)
        compute = rt.computes[L.index]
        head = compute.grouped_host(x[:P], ids[:P], weights[:P], host, L.expert_bias)
        if x.shape[0] == P:
            return head
        tail = compute.host_rows(x[P:], ids[P:], weights[P:], host, L.expert_bias)
        return torch.cat([head, tail])
