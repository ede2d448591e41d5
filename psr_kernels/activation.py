"""Expert activations: the gated MLP's nonlinearity as the kernels and references take it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton
import triton.language as tl

# Expert activations (`ACT` of the expert kernels; psr_kernels.expert_ffn.Activation):
ACT_SILU = 0  # silu(gate) * up
ACT_CLAMPED = 1  # gpt-oss: g = min(gate, limit), u = clamp(up, +-limit), g sigmoid(alpha g) (u+1)


@triton.jit
def glu(g, u, b_ptr, fs, fm, F, alpha, limit, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """The gated activation of one tile of gate/up sums (fp32), biases first (`b_ptr`: the
    routed expert's gate biases at 0, up biases at F)."""
    if HAS_BIAS:
        g += tl.load(b_ptr + fs, mask=fm, other=0.0)
        u += tl.load(b_ptr + F + fs, mask=fm, other=0.0)
    if ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    return g / (1.0 + tl.exp(-g)) * u


ACTIVATIONS = ("silu", "clamped")


@dataclass(frozen=True)
class Activation:
    """An expert's gated activation. `silu`: silu(gate x) * (up x) (SwiGLU). `clamped`
    (gpt-oss): g = min(gate x, limit), u = clamp(up x, -limit, limit), g * sigmoid(alpha g)
    * (u + 1). Biases, where an expert kind has them, are added to gate x and up x first."""

    kind: str = "silu"
    alpha: float = 1.0
    limit: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.kind!r}; expected one of {ACTIVATIONS}")
        if self.kind == "clamped" and not (self.limit > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"clamped activation needs limit > 0 and a finite alpha: {self}")

    @property
    def code(self) -> int:
        return ACT_CLAMPED if self.kind == "clamped" else ACT_SILU


SILU = Activation()
