"""Routing policies: exact + LRU, exact + prefetch, Cache-Prior, PSR, and the async strawman."""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("exact", "exact-prefetch", "cache-prior", "psr", "cache-prior-async")
DEFAULT_LAM = 0.2
DEFAULT_N = 1


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
    def biased(self) -> bool:
        return self.lam > 0

    def describe(self) -> str:
        if self.name == "exact":
            return "exact"
        if self.name == "exact-prefetch":
            return f"exact-prefetch(n={self.n})"
        if self.name == "cache-prior":
            return f"cache-prior(lam={self.lam:g})"
        return f"{self.name}(lam={self.lam:g}, n={self.n})"


def make_policy(name: str | Policy, lam: float | None = None, n: int | None = None) -> Policy:
    """Policy by name. Unused parameters must be left unset (or at the policy's value)."""
    if isinstance(name, Policy):
        if lam is not None or n is not None:
            raise ValueError("pass lam/n with a policy name, not with a Policy object")
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    if lam is not None and not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be a finite number >= 0, got {lam!r}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be an int >= 0, got {n!r}")

    def fixed(param: str, value, want) -> None:
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
