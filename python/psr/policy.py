"""Routing policies and every policy default: exact + LRU, exact + prefetch, Cache-Prior,
PSR, and the timing-dependent strawman; the one parser of policy specs.

Pure bookkeeping: nothing here touches the store, the kernels or the file system (a
model's tuned operating points are read and written by psr.points). The CLI, the
evaluation harness and the benchmarks all build policies through this module, so a
default changed here changes everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

POLICIES = ("exact", "exact-prefetch", "cache-prior", "psr", "cache-prior-async")
DEFAULT_POLICY = "psr"
# The untuned default bias: what cache-prior / psr use without a tuned operating point
# (docs/design.md, "The untuned default"). Small on purpose: on the embedded model lam 0.03
# costs +0.0015 nats/token, and the quality cost grows convexly from 0 with lam, so a model
# that pays +0.04 nats/token at lam 0.15 (the worst published figure) pays at most 0.008
# here, inside the 0.01 budget. `psr tune` measures a model's own, usually larger, point.
DEFAULT_LAM = 0.03
DEFAULT_N = 1
DEFAULT_RESIDENCY = 0.5
# Speculative verify blocks (issue 41 item 2): how a block bounds its experts (psr.vocab.
# VERIFY_MODES). "budget" is the seed's block-level set; "cpu" costs no quality beyond the
# policy's own but needs host rows and CPU time.
DEFAULT_VERIFY = "budget"
# What `parse_policies` adds when a spec omits a policy that a comparison needs.
BASELINE = "exact"
_HAS_LAM = ("cache-prior", "psr", "cache-prior-async")
_HAS_N = ("exact-prefetch", "psr", "cache-prior-async")


@dataclass(frozen=True)
class Policy:
    """`lam`: bias toward the cache; `n`: predicted experts inserted per layer and token;
    `mask`: what the bias reads: the logical cache, or ('physical') the slots whose copies
    have finished, which depends on timing (the design PSR replaces)."""

    name: str
    lam: float = 0.0
    n: int = 0
    mask: str = "logical"

    @property
    def routes_by_cache(self) -> bool:
        """Whether the routed ids can depend on the cache: only through the bias toward
        it (lam > 0; routing reads no mask without). With lam = 0 routing is the exact
        top-k at every residency and prefetch count: such configurations route, score and
        generate alike, only their caches' accounting differs (psr.eval.shared)."""
        return self.lam > 0

    def describe(self) -> str:
        """Human label, e.g. `psr(lam=0.2, n=1)`."""
        if self.name == "exact":
            return "exact"
        if self.name == "exact-prefetch":
            return f"exact-prefetch(n={self.n})"
        if self.name == "cache-prior":
            return f"cache-prior(lam={self.lam:g})"
        return f"{self.name}(lam={self.lam:g}, n={self.n})"

    def spec(self) -> str:
        """The parseable form, e.g. `psr:lam=0.2,n=1` (inverse of `parse_policy`)."""
        p = self.params()
        args = [f"lam={p['lam']:g}"] if p["lam"] is not None else []
        args += [f"n={p['n']}"] if p["n"] is not None else []
        return self.name + (":" + ",".join(args) if args else "")

    def params(self) -> dict[str, Any]:
        """`{"policy", "lam", "n"}` with None where the policy has no such parameter."""
        return {
            "policy": self.name,
            "lam": self.lam if self.name in _HAS_LAM else None,
            "n": self.n if self.name in _HAS_N else None,
        }


def _check_lam(lam: Any) -> None:
    if isinstance(lam, bool) or not (
        isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0
    ):
        raise ValueError(f"lam must be a finite number >= 0, got {lam!r}")


def _check_n(n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")


def make_policy(name: str | Policy, lam: float | None = None, n: int | None = None) -> Policy:
    """Policy by name; unset parameters take this module's defaults. A parameter the
    policy does not have must be left unset (or at the policy's fixed value)."""
    if isinstance(name, Policy):
        if lam is not None or n is not None:
            raise ValueError("pass lam/n with a policy name, not with a Policy object")
        return name
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    if lam is not None:
        _check_lam(lam)
    if n is not None:
        _check_n(n)

    def fixed(param: str, value: Any, want: Any) -> None:
        if value is not None and value != want:
            raise ValueError(f"policy {name!r} has {param}={want}; got {param}={value}")

    if name == "exact":
        fixed("lam", lam, 0)
        fixed("n", n, 0)
        return Policy(name)
    if name == "exact-prefetch":
        fixed("lam", lam, 0)
        return Policy(name, 0.0, DEFAULT_N if n is None else n)
    if name == "cache-prior":
        fixed("n", n, 0)
        return Policy(name, DEFAULT_LAM if lam is None else float(lam), 0)
    lam_ = DEFAULT_LAM if lam is None else float(lam)
    n_ = DEFAULT_N if n is None else n
    return Policy(name, lam_, n_, "physical" if name == "cache-prior-async" else "logical")


def parse_policy_args(args: str) -> dict[str, Any]:
    """`'lam=0.3,n=1'` -> `{'lam': 0.3, 'n': 1}` (only lam and n exist)."""
    kw: dict[str, Any] = {}
    for a in filter(None, (s.strip() for s in args.split(","))):
        k, eq, v = a.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or k not in ("lam", "n"):
            raise ValueError(f"policy parameter {a!r}: expected lam=<float> or n=<int>")
        if k in kw:
            raise ValueError(f"policy parameter {k!r} given twice")
        try:
            kw[k] = float(v) if k == "lam" else int(v)
        except ValueError:
            want = "a number" if k == "lam" else "an integer"
            raise ValueError(f"policy parameter {k}={v!r}: expected {want}") from None
    return kw


def parse_policy(spec: str) -> Policy:
    """`'psr:lam=0.3,n=1'`, `'cache-prior:lam=0.1'`, `'exact'` -> Policy."""
    name, _, args = spec.strip().partition(":")
    kw = parse_policy_args(args)
    return make_policy(name.strip(), kw.get("lam"), kw.get("n"))


def parse_policies(spec: str, *, with_baseline: bool = True) -> list[Policy]:
    """`';'`-separated policy specs, in order, without duplicates; `exact` is put first
    when missing (every comparison is against it) unless `with_baseline=False`."""
    out: list[Policy] = []
    for item in (s for s in spec.split(";") if s.strip()):
        p = parse_policy(item)
        if p not in out:
            out.append(p)
    if not out:
        raise ValueError(f"no policy in {spec!r}")
    if with_baseline and not any(p.name == BASELINE for p in out):
        out.insert(0, make_policy(BASELINE))
    return out


def default_block_k(top_k: int, slots: int) -> int:
    """Experts per layer and verify block in verify='budget' without an explicit block_k:
    twice the model's top-k, at most the slots per layer."""
    return min(2 * top_k, slots)


def default_verify_copies(top_k: int, cap: int | None) -> int:
    """Misses one verify block copies per MoE layer in verify='cpu' without an explicit M:
    the placement's own cap under experts_on cpu / hybrid (`cap`), else top-k (a block
    copies at most what one autoregressive token can miss; the rest run on the CPU)."""
    return top_k if cap is None else cap


def standard_policies(points: dict[str, Policy]) -> list[Policy]:
    """The four policies every comparison shows: exact, exact + prefetch (n = DEFAULT_N),
    and the given Cache-Prior and PSR points."""
    return [
        make_policy("exact"),
        make_policy("exact-prefetch", n=DEFAULT_N),
        points["cache-prior"],
        points["psr"],
    ]
