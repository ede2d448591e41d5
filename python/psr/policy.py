"""Routing policies and every policy default: exact + LRU, exact + prefetch, Cache-Prior,
PSR, and the timing-dependent strawman; the one parser of policy specs; operating points.

Pure bookkeeping: nothing here touches the store or the kernels. The CLI, the
evaluation harness and the benchmarks all build policies through this module, so a
default changed here changes everywhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POLICIES = ("exact", "exact-prefetch", "cache-prior", "psr", "cache-prior-async")
DEFAULT_POLICY = "psr"
DEFAULT_LAM = 0.2
DEFAULT_N = 1
DEFAULT_RESIDENCY = 0.5
# What `parse_policies` adds when a spec omits a policy that a comparison needs.
BASELINE = "exact"
OPERATING_POINTS_FILE = "operating_points.json"
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


# ------------------------------------------------------------------ operating points
#
# An operating point is the tuned Cache-Prior and PSR policy of one model at one
# residency (`psr tune`). Lookup order: the user's tuned file (written by `psr tune`),
# then the file shipped beside the model (`operating_points.json`), then the defaults
# above. Shipped files are never written by psr.


def _points_home() -> Path:
    """Where `psr tune` writes: $PSR_HOME/operating_points, else the user data folder."""
    home = os.environ.get("PSR_HOME", "").strip()
    if home:
        return Path(home) / "operating_points"
    import platformdirs

    return Path(platformdirs.user_data_dir("psr")) / "operating_points"


def model_key(model_dir: str | Path) -> str:
    """A model's identity for tuned files: folder name + hash of its config and weight
    file sizes (cheap; a retrained model gets a new key)."""
    d = Path(model_dir)
    h = hashlib.sha256()
    cfg = d / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for f in sorted(d.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{d.resolve().name}-{h.hexdigest()[:12]}"


def user_points_file(model_dir: str | Path) -> Path:
    return _points_home() / f"{model_key(model_dir)}.json"


def _parse_points(raw: dict[str, Any], residency: float) -> dict[str, Policy] | None:
    at = raw.get("points", {}).get(f"{residency:g}")
    if at is None:
        return None
    return {
        "cache-prior": make_policy("cache-prior", at["cache-prior"]["lam"]),
        "psr": make_policy("psr", at["psr"]["lam"], int(at["psr"]["n"])),
    }


def operating_points(model_dir: str | Path, residency: float) -> dict[str, Policy]:
    """The tuned `cache-prior` and `psr` policies of a model at a residency."""
    points, _ = operating_points_with_source(model_dir, residency)
    return points


def operating_points_with_source(
    model_dir: str | Path, residency: float
) -> tuple[dict[str, Policy], str]:
    """(points, where they came from): the user's tuned file, the shipped file, or
    'defaults' (this module's DEFAULT_LAM / DEFAULT_N)."""
    points, source, _ = _find_points(model_dir, residency)
    return points, source


def _find_points(
    model_dir: str | Path, residency: float
) -> tuple[dict[str, Policy], str, float | None]:
    """`operating_points_with_source` plus the quality budget the points were tuned for
    (None: the defaults, or a file that does not record one); each file is read once."""
    for f in (user_points_file(model_dir), Path(model_dir) / OPERATING_POINTS_FILE):
        if f.is_file():
            try:
                raw = json.loads(f.read_text())
                pts = _parse_points(raw, residency)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"corrupt operating points file {f}: {e}") from None
            if pts is not None:
                budget = raw.get("budget_nats")
                return pts, str(f), float(budget) if isinstance(budget, (int, float)) else None
    defaults = {"cache-prior": make_policy("cache-prior"), "psr": make_policy("psr")}
    return defaults, "defaults", None


def resolve_policy(
    name: str | Policy,
    lam: float | None = None,
    n: int | None = None,
    *,
    model_dir: str | Path | None = None,
    residency: float | None = None,
    quality_budget: float | None = None,
) -> tuple[Policy, str]:
    """The policy `psr.load` runs, and its source: `cache-prior` / `psr` without lam and
    n take the model's operating point at this residency when one exists (tuned or
    shipped); anything else is `make_policy`. With `quality_budget` (nats/token) the
    operating point is required, and must have been tuned for that budget or a tighter
    one."""
    if quality_budget is not None:
        if isinstance(quality_budget, bool) or not isinstance(quality_budget, (int, float)):
            raise ValueError(f"quality_budget must be a number, got {quality_budget!r}")
        if not (math.isfinite(quality_budget) and quality_budget >= 0):
            raise ValueError(f"quality_budget must be finite and >= 0, got {quality_budget!r}")
        if not isinstance(name, str) or name not in ("cache-prior", "psr"):
            raise ValueError(f"quality_budget applies to 'cache-prior' or 'psr', not {name!r}")
        if (lam, n) != (None, None):
            raise ValueError("quality_budget chooses lam and n: pass neither")
        if model_dir is None or residency is None:
            raise ValueError("quality_budget needs the model folder and residency to look up")
    if (
        isinstance(name, str)
        and name in ("cache-prior", "psr")
        and lam is None
        and n is None
        and model_dir is not None
        and residency is not None
    ):
        points, source, tuned = _find_points(model_dir, residency)
        if quality_budget is not None:
            if tuned is None:
                raise ValueError(
                    f"no operating point of {model_dir} at residency {residency:g} was tuned "
                    f"for a quality budget; run: psr tune --model {model_dir} "
                    f"--residency {residency:g} --budget {quality_budget:g}"
                )
            if tuned > quality_budget:
                raise ValueError(
                    f"the operating points in {source} were tuned for a budget of {tuned:g} "
                    f"nats/token, above the {quality_budget:g} asked for; run: psr tune "
                    f"--model {model_dir} --residency {residency:g} --budget {quality_budget:g}"
                )
        if source != "defaults":
            return points[name], source
    return make_policy(name, lam, n), "arguments" if (lam, n) != (None, None) else "defaults"


def write_operating_points(
    model_dir: str | Path,
    points: dict[str, dict[str, Policy]],
    meta: dict[str, Any],
    path: str | Path | None = None,
) -> Path:
    """Write tuned points (`{residency: {"cache-prior": Policy, "psr": Policy}}`) to the
    user's file for this model, or to `path`; never into an installed psr package."""
    out = Path(path) if path is not None else user_points_file(model_dir)
    pkg = Path(__file__).resolve().parent
    if out.resolve().is_relative_to(pkg):
        raise ValueError(f"{out} is inside the installed psr package; write elsewhere")
    body = {
        "points": {
            rho: {
                fam: {k: v for k, v in p.params().items() if k != "policy" and v is not None}
                for fam, p in fams.items()
            }
            for rho, fams in points.items()
        },
        "model": str(Path(model_dir).resolve()),
        "model_key": model_key(model_dir),
        **meta,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(out)  # atomic: a reader never sees half a file
    return out


def standard_policies(points: dict[str, Policy]) -> list[Policy]:
    """The four policies every comparison shows: exact, exact + prefetch (n = DEFAULT_N),
    and the given Cache-Prior and PSR points."""
    return [
        make_policy("exact"),
        make_policy("exact-prefetch", n=DEFAULT_N),
        points["cache-prior"],
        points["psr"],
    ]
