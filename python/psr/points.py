"""A model's operating points: the tuned Cache-Prior and PSR policy of one model at one
residency (`psr tune`), read from and written to files.

Lookup order: the user's tuned file (written by `psr tune`), then the file shipped beside
the model (`operating_points.json`), then psr.policy's defaults. Shipped files are never
written by psr. Kept apart from psr.policy so that module stays pure bookkeeping; this one
is in the same layer (no torch, no store), but reads, hashes and writes files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from psr.policy import Policy, make_policy

OPERATING_POINTS_FILE = "operating_points.json"


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
    """The user's tuned file for this model, where `psr tune` writes."""
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
    'defaults' (psr.policy's DEFAULT_LAM / DEFAULT_N)."""
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
