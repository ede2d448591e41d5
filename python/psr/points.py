"""A model's operating points: the tuned Cache-Prior and PSR policy of one model at one
residency (`psr tune`), read from and written to files.

Lookup order: the user's tuned file (written by `psr tune`, named by the checkpoint's
`model_key`), then the file shipped beside the model (`operating_points.json`), then
psr.policy's defaults (the untuned default, which `psr.load` warns about). A file psr
wrote records its checkpoint's key, and a file tuned for another checkpoint is refused,
never applied. Shipped files are never written by psr. Kept apart from psr.policy so that
module stays pure bookkeeping; this one is in the same layer (no torch, no store), but
reads, hashes and writes files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shlex
from pathlib import Path
from typing import Any

from psr.policy import Policy, make_policy

OPERATING_POINTS_FILE = "operating_points.json"
FAMILIES = ("cache-prior", "psr")  # the policies with tuned operating points
# `model.policy_source` besides "tuned (<file>)" (tuned_source).
UNTUNED = "untuned default"  # a biased policy at psr.policy's DEFAULT_LAM: nothing measured
GIVEN = "given"  # lam / n or a Policy passed, or a policy without bias (exact routing)

log = logging.getLogger("psr")


def _points_home() -> Path:
    """Where `psr tune` writes: $PSR_HOME/operating_points, else the user data folder."""
    home = os.environ.get("PSR_HOME", "").strip()
    if home:
        return Path(home) / "operating_points"
    import platformdirs

    return Path(platformdirs.user_data_dir("psr")) / "operating_points"


def _canonical_json(f: Path) -> bytes:
    """A JSON file's content independent of its formatting (its raw bytes if not JSON)."""
    raw = f.read_bytes()
    try:
        return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        return raw


def _safetensors_header(f: Path) -> bytes:
    """A safetensors file's JSON header (names, dtypes, shapes, offsets): its first 8 + N
    bytes; the tensors' bytes are never read."""
    size = f.stat().st_size
    with f.open("rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise ValueError(f"{f} is not a safetensors file (header of {n} bytes in {size})")
        return fh.read(n)


def model_key(model_dir: str | Path) -> str:
    """A checkpoint's identity for its tuned points: a hash of its config.json, its weights
    index and every safetensors file's header (names, dtypes, shapes, offsets), so it is
    cheap (the tensors' bytes are never read) and the same wherever the folder lies. Two
    checkpoints with the same config and tensor layout (a fine-tune saved unchanged) share
    a key."""
    d = Path(model_dir)
    ggufs = [d] if d.is_file() else sorted(d.glob("*.gguf")) if d.is_dir() else []
    if ggufs and not (d / "config.json").is_file():
        return _gguf_key(ggufs)
    h = hashlib.sha256(b"psr model key v2\0")
    for name in ("config.json", "model.safetensors.index.json"):
        f = d / name
        h.update(f"{name}:".encode() + (_canonical_json(f) if f.is_file() else b"") + b"\0")
    for f in sorted(d.glob("*.safetensors")):
        h.update(f"{f.name}:".encode() + _safetensors_header(f) + b"\0")
    return h.hexdigest()[:16]


# A GGUF file's head holds its metadata (config, tokenizer) and tensor table (names,
# types, shapes, offsets) before any weight: its first bytes identify the model.
_GGUF_KEY_BYTES = 32 << 20


def _gguf_key(files: list[Path]) -> str:
    """model_key of GGUF files (one, or a split set): each file's size and head."""
    h = hashlib.sha256(b"psr model key gguf v1\0")
    for f in files:
        h.update(f"{f.stat().st_size}:".encode())
        with f.open("rb") as fh:  # hashed in 1 MiB reads: `psr inspect` stays small
            left = _GGUF_KEY_BYTES
            while left and (chunk := fh.read(min(left, 1 << 20))):
                h.update(chunk)
                left -= len(chunk)
        h.update(b"\0")
    return h.hexdigest()[:16]


def user_points_file(model_dir: str | Path) -> Path:
    """The user's tuned file for this model, where `psr tune` writes."""
    return _points_home() / f"{model_key(model_dir)}.json"


def _parse_points(raw: dict[str, Any], residency: float) -> dict[str, Policy] | None:
    """The families tuned at this residency (`psr tune` leaves out a family none of whose
    candidates held within budget); None when there are none."""
    at = raw.get("points", {}).get(f"{residency:g}") or {}
    out = {}
    if "cache-prior" in at:
        out["cache-prior"] = make_policy("cache-prior", at["cache-prior"]["lam"])
    if "psr" in at:
        out["psr"] = make_policy("psr", at["psr"]["lam"], int(at["psr"]["n"]))
    return out or None


def operating_points(model_dir: str | Path, residency: float) -> dict[str, Policy]:
    """The tuned `cache-prior` and `psr` policies of a model at a residency."""
    points, _ = operating_points_with_source(model_dir, residency)
    return points


def operating_points_with_source(
    model_dir: str | Path, residency: float
) -> tuple[dict[str, Policy], str]:
    """(points, where they came from): per family the user's tuned file, else the shipped
    file, else 'defaults' (psr.policy's DEFAULT_LAM / DEFAULT_N); the sources joined by
    ' + ' when the families' differ."""
    found = _find_points(model_dir, residency)
    points = {fam: found[fam][0] if fam in found else make_policy(fam) for fam in FAMILIES}
    sources = dict.fromkeys(found[fam][1] if fam in found else "defaults" for fam in FAMILIES)
    return points, " + ".join(sources)


def _check_owner(f: Path, raw: dict[str, Any], model_dir: str | Path) -> None:
    """A points file psr wrote names its checkpoint (`model_key`): one written for another
    checkpoint is never applied. A file without a key (written by hand) is the folder's own."""
    key = raw.get("model_key")
    if key is None:
        return
    mine = model_key(model_dir)
    if key != mine:
        raise ValueError(
            f"the operating points in {f} were tuned for another checkpoint, "
            f"{raw.get('model', '?')} (model key {key}), not {model_dir} (model key {mine}); "
            f"they are never applied to another model: remove the file or run: "
            f"{tune_command(model_dir)}"
        )


def _find_points(
    model_dir: str | Path, residency: float
) -> dict[str, tuple[Policy, str, float | None]]:
    """Per family tuned at this residency: (its point, the file it came from, the quality
    budget that file was tuned for, None if it records none). The user's file first, then
    the shipped one; each file is read once."""
    found: dict[str, tuple[Policy, str, float | None]] = {}
    for f in (user_points_file(model_dir), Path(model_dir) / OPERATING_POINTS_FILE):
        if f.is_file():
            try:
                raw = json.loads(f.read_text())
                pts = _parse_points(raw, residency)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"corrupt operating points file {f}: {e}") from None
            _check_owner(f, raw, model_dir)
            budget = raw.get("budget_nats")
            tuned = float(budget) if isinstance(budget, (int, float)) else None
            for fam, pol in (pts or {}).items():
                found.setdefault(fam, (pol, str(f), tuned))
    return found


def tuned_points(model_dir: str | Path, residency: float) -> dict[str, tuple[Policy, str]]:
    """Per policy family tuned for this checkpoint at `residency`: (its point, the file);
    families absent take the untuned default. Raises ValueError for a corrupt file or one
    tuned for another checkpoint."""
    return {fam: (pol, f) for fam, (pol, f, _) in _find_points(model_dir, residency).items()}


def tune_command(model_dir: str | Path, residency: float | None = None) -> str:
    """The `psr tune` command that measures a model's operating point: on its heldout.txt
    when it ships one, else on the user's text (`--text`)."""
    cmd = f"psr tune --model {shlex.quote(str(model_dir))}"
    if not (Path(model_dir) / "heldout.txt").is_file():
        cmd += " --text YOUR_TEXT"
    return cmd + (f" --residency {residency:g}" if residency is not None else "")


def tuned_source(file: str | Path) -> str:
    """`model.policy_source` of an operating point read from `file`."""
    return f"tuned ({file})"


def _warn_untuned(policy: Policy, model_dir: str | Path, residency: float) -> None:
    log.warning(
        "psr: %s is the untuned default: its quality cost was not measured for %s at "
        "residency %g; measure it and tune the point with: %s",
        policy.describe(),
        model_dir,
        residency,
        tune_command(model_dir, residency),
    )


def _check_budget(
    name: str | Policy,
    lam: float | None,
    n: int | None,
    model_dir: str | Path | None,
    residency: float | None,
    quality_budget: float,
) -> None:
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


def resolve_policy(
    name: str | Policy,
    lam: float | None = None,
    n: int | None = None,
    *,
    model_dir: str | Path | None = None,
    residency: float | None = None,
    quality_budget: float | None = None,
) -> tuple[Policy, str]:
    """The policy `psr.load` runs, and its source (`model.policy_source`):
    `cache-prior` / `psr` without lam and n take the model's operating point at this
    residency when one exists (tuned or shipped): "tuned (<file>)". A biased policy whose
    lam is psr.policy's DEFAULT_LAM is the "untuned default", and with a model folder a
    one-line warning (logger "psr") names the `psr tune` command that measures it; anything
    else is "given". With `quality_budget` (nats/token) the operating point is required,
    and must have been tuned for that budget or a tighter one."""
    if quality_budget is not None:
        _check_budget(name, lam, n, model_dir, residency, quality_budget)
    if (
        isinstance(name, str)
        and name in ("cache-prior", "psr")
        and lam is None
        and n is None
        and model_dir is not None
        and residency is not None
    ):
        point, source, tuned = _find_points(model_dir, residency).get(
            name, (None, "defaults", None)
        )
        if quality_budget is not None:
            if tuned is None:
                raise ValueError(
                    f"no operating point of {model_dir} at residency {residency:g} was tuned "
                    f"for a quality budget; run: {tune_command(model_dir, residency)} "
                    f"--budget {quality_budget:g}"
                )
            if tuned > quality_budget:
                raise ValueError(
                    f"the operating points in {source} were tuned for a budget of {tuned:g} "
                    f"nats/token, above the {quality_budget:g} asked for; run: "
                    f"{tune_command(model_dir, residency)} --budget {quality_budget:g}"
                )
        if point is not None:
            return point, tuned_source(source)
    pol = make_policy(name, lam, n)
    if isinstance(name, Policy) or lam is not None or pol.lam == 0:
        return pol, GIVEN
    if model_dir is not None and residency is not None and pol.name in ("cache-prior", "psr"):
        _warn_untuned(pol, model_dir, residency)
    return pol, UNTUNED


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
