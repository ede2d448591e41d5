"""Per-token routing traces of decoding, for the latency model.

A trace lists, for every decode token and MoE layer, the slots the layer's experts
read and the copies issued when it routed (its misses, then prefetches into the next
MoE layer). It is what the runtime did logically, so it is deterministic for PSR.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Copy:
    layer: int  # MoE layer index the copy writes
    slot: int
    expert: int
    kind: str  # "miss" | "prefetch"
    # Where the expert's row was read from: "pinned" (store host memory) or "pageable"
    # (its checkpoint file, host_memory=; priced by the latency model's pageable tier).
    tier: str = "pinned"


@dataclass
class LayerStep:
    layer: int  # MoE layer index
    experts: list[int]
    slots: list[int]
    hits: int
    copies: list[Copy] = field(default_factory=list)
    # Routed experts not in the layer's own exact top-k (0 in traces written before it
    # was recorded); the latency model does not read it.
    substituted: int = 0
    # Routed experts of this step computed on the CPU (experts_on cpu / hybrid: misses not
    # copied, so not in `copies`); 0 in traces written before it was recorded.
    cpu_experts: int = 0
    # Token rows those CPU experts compute (a verify block: each expert once over the
    # block's tokens routed to it); 0: one row each (a decode token; older traces).
    cpu_rows: int = 0


# What the host does for one decode step (psr.eval.host_probe measures it on a real decode;
# psr.eval.latency replays it on a host thread). Kinds of HostOp, in the order issued:
HOST_OP_KINDS = (
    "launch",  # a kernel launched on the compute stream (aten op, Triton kernel)
    "sync",  # the host reads device data: waits for everything issued to the compute stream
    "h2d",  # a tensor built from host data: a synchronous copy behind the compute stream
    "copy",  # a store call issuing this step's host-chosen copies on the copy stream
    "wait",  # the store's acquire: the compute stream waits for this layer's copies
    "release",  # the store's release: read events recorded (host cost only)
    "gather",  # a store call launching a device-indexed copy ("compute" or "side" stream)
    "join",  # the compute stream waits for the side stream's gathers into this layer
    "cpu",  # a store call handing the CPU list to the CPU (experts_on cpu / hybrid)
    "cpu_join",  # the compute stream waits for the CPU's experts
)


@dataclass
class HostOp:
    kind: str  # one of HOST_OP_KINDS
    what: str = ""  # what it serves: an aten op or kernel name, "miss", "prefetch", ...
    stream: str = "compute"  # gathers: "compute" or "side"


@dataclass
class HostSchedule:
    """The host's work per decode token, as the decode path issues it (measured, not
    guessed: psr.eval.host_probe.HostProbe.schedule)."""

    mode: str  # the decode step that ran: "host" | "device" (issue 20: "graph")
    moe_layer: list[HostOp] = field(default_factory=list)  # a MoE layer that predicts
    last_moe_layer: list[HostOp] = field(default_factory=list)  # one that does not
    dense_launches: float = 0.0  # eager launches per decoder layer outside the MoE path
    token: list[HostOp] = field(default_factory=list)  # per token outside the layers

    def as_graph(self) -> HostSchedule:
        """The same GPU work replayed as one captured graph per token (runtime/graphs.py):
        a device-step schedule whose ops the GPU replays in order, with the host's work
        per token one graph launch and the read of the new token."""
        if self.mode != "device":
            raise ValueError(f"only the device step is captured in graphs, not {self.mode!r}")
        token = [HostOp("launch", "graph"), HostOp("sync", "token")]
        return HostSchedule(
            "graph", self.moe_layer, self.last_moe_layer, self.dense_launches, token
        )

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HostSchedule:
        ops = {
            k: [HostOp(**o) for o in d.get(k, [])] for k in ("moe_layer", "last_moe_layer", "token")
        }
        return cls(d["mode"], dense_launches=float(d.get("dense_launches", 0.0)), **ops)


@dataclass
class Trace:
    num_decoder_layers: int
    moe_layers: list[int]  # decoder index of each MoE layer
    top_k: int
    expert_bytes: int
    policy: str = ""
    tokens: list[list[LayerStep]] = field(default_factory=list)
    # Speculative decoding: tokens each step (verify block) emitted; empty: one each.
    emitted: list[int] = field(default_factory=list)
    # Bytes of a copied expert over the same expert in bf16 (quantized formats < 1).
    bytes_ratio: float = 1.0
    # The host's work per decode token (None: not measured; the latency model is then
    # host-free).
    host: HostSchedule | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Trace:
        toks = [
            [LayerStep(**{**s, "copies": [Copy(**c) for c in s["copies"]]}) for s in tok]
            for tok in d["tokens"]
        ]
        return cls(
            d["num_decoder_layers"],
            d["moe_layers"],
            d["top_k"],
            d["expert_bytes"],
            d.get("policy", ""),
            toks,
            list(d.get("emitted", [])),
            float(d.get("bytes_ratio", 1.0)),
            HostSchedule.from_json(d["host"]) if d.get("host") else None,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_json(json.loads(Path(path).read_text()))

    def counts(self) -> dict[str, int]:
        c = {"tokens": len(self.tokens), "routed": 0, "hits": 0, "misses": 0, "prefetches": 0}
        c["substituted"] = c["cpu_experts"] = 0
        for tok in self.tokens:
            for s in tok:
                c["routed"] += len(s.experts)
                c["hits"] += s.hits
                c["substituted"] += s.substituted
                c["cpu_experts"] += s.cpu_experts
                # A miss is copied, or (cpu / hybrid) computed on the CPU.
                c["misses"] += sum(x.kind == "miss" for x in s.copies) + s.cpu_experts
                c["prefetches"] += sum(x.kind == "prefetch" for x in s.copies)
        return c


class TraceRecorder:
    """Attached to an OffloadRuntime (`runtime.recorder`), collects decode steps.

    Steps are addressed by (token, MoE layer): token-by-token decoding fills them in
    order; teacher-forced scoring (layer by layer over a window) fills them by index.
    """

    def __init__(
        self,
        num_decoder_layers: int,
        moe_layers: list[int],
        top_k: int,
        expert_bytes: int,
        policy: str = "",
        bytes_ratio: float = 1.0,
    ) -> None:
        self.trace = Trace(
            num_decoder_layers, moe_layers, top_k, expert_bytes, policy, bytes_ratio=bytes_ratio
        )
        self._step: LayerStep | None = None

    def new_token(self) -> int:
        """Open the next token's record; returns its index in `trace.tokens`."""
        self.trace.tokens.append([])
        return len(self.trace.tokens) - 1

    def routed(
        self,
        layer: int,
        experts: list[int],
        hits: int,
        token: int = -1,
        substituted: int = 0,
        cpu_experts: int = 0,
    ) -> None:
        """Layer `layer` routed `experts` for `token` (default: the newest), `substituted`
        of them not in its exact top-k, `cpu_experts` of them computed on the CPU."""
        self._step = LayerStep(
            layer, list(experts), [], hits, substituted=substituted, cpu_experts=cpu_experts
        )
        self.trace.tokens[token].append(self._step)

    def copy(
        self,
        layer: int,
        slot: int,
        expert: int,
        kind: str,
        at: tuple[int, int] | None = None,
        tier: str = "pinned",
    ) -> None:
        """A copy issued by the current step, or by the step `at` = (token, MoE layer),
        from `tier`."""
        step = self._step if at is None else self.trace.tokens[at[0]][at[1]]
        if step is not None:
            step.copies.append(Copy(layer, slot, expert, kind, tier))

    def read(self, layer: int, slots: list[int]) -> None:
        if self._step is not None and self._step.layer == layer:
            self._step.slots = list(slots)

    def cpu_rows(self, layer: int, rows: int) -> None:
        """The current step (MoE layer `layer`) computes `rows` token rows on the CPU (a
        verify block's CPU experts over the tokens routed to each)."""
        if self._step is not None and self._step.layer == layer:
            self._step.cpu_rows = int(rows)
