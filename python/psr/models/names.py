"""Model names as a llama.cpp / Ollama user gives them (issue 42): a local path, a Hugging
Face repo id (`org/name`) or `org/name:FILE.gguf`, resolved from the local Hub cache only
(never downloaded: an absent model is a one-line error with the command that fetches it);
the name a server shows for a path; and the cached checkpoints psr can load (`psr list`).

The cache is huggingface_hub's layout: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`$XDG_CACHE_HOME/huggingface/hub` or `~/.cache/huggingface/hub`; a repo is
`models--org--name/`, its revisions `snapshots/<commit>/` and `refs/main` the commit the
main branch had when it was fetched.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# org/name, optionally :FILE (a .gguf file inside the repo).
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>.+\.gguf))?$")


def hub_cache() -> Path:
    """The local Hugging Face Hub cache folder (its environment variables read now)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot of `refs/main`, else the only one there is, else None."""
    snaps = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        rev = ref.read_text().strip()
        if (snaps / rev).is_dir():
            return snaps / rev
    found = [p for p in snaps.iterdir() if p.is_dir()] if snaps.is_dir() else []
    return found[0] if len(found) == 1 else None


def _fetch_hint(repo: str, file: str | None) -> str:
    return f"hf download {repo}" + (f" {file}" if file else "")


def resolve_model(name: str | Path) -> str:
    """`name` as a local path: an existing path as it is; `org/name` as its snapshot folder
    in the local Hub cache (a repo holding only GGUF files: its one .gguf file), and
    `org/name:FILE.gguf` as that file in it. Anything else is returned unchanged (the
    loader says what is wrong with it). Nothing is downloaded: a repo or file not in the
    cache is a FileNotFoundError naming the cache and the command that fetches it."""
    text = str(name)
    m = _REPO_ID.match(text)
    if Path(text).expanduser().exists() or m is None:
        return text
    repo, file = m["repo"], m["file"]
    cache = hub_cache()
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snap = _snapshot(repo_dir) if repo_dir.is_dir() else None
    if snap is None:
        raise FileNotFoundError(
            f"{text}: not a local path, and not in the local Hugging Face cache ({cache}); "
            f"psr downloads nothing: fetch it with `{_fetch_hint(repo, file)}`"
        )
    if file is not None:
        if not (snap / file).is_file():
            raise FileNotFoundError(
                f"{text}: {file} is not in the cached {repo} ({snap}); fetch it with "
                f"`{_fetch_hint(repo, file)}`"
            )
        return str(snap / file)
    if (snap / "config.json").is_file():
        return str(snap)
    ggufs = sorted(p.name for p in snap.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(snap / ggufs[0])
    if ggufs:
        raise ValueError(
            f"{text}: the cached repo holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); "
            f"name one: {repo}:FILE.gguf"
        )
    raise FileNotFoundError(
        f"{text}: the cached snapshot {snap} has no config.json and no .gguf file; fetch the "
        f"checkpoint with `{_fetch_hint(repo, None)}`"
    )


def served_name(path: str | Path) -> str:
    """The model name a server shows for a local path: a GGUF file's stem (without
    `.gguf`), the repo id of a Hub cache snapshot (`org/name`), else the folder's name."""
    p = Path(path).resolve() if Path(path).exists() else Path(path)
    if p.suffix == ".gguf":
        return p.stem
    parts = p.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/", 1)
    return p.name


@dataclass(frozen=True)
class Cached:
    """A checkpoint in the local Hub cache that psr can load."""

    name: str  # what --model takes: org/name or org/name:FILE.gguf
    family: str  # model_type
    size: int  # bytes on disk (the files the snapshot links to)
    path: Path


def _size(paths: list[Path]) -> int:
    total = 0
    for f in paths:
        try:
            total += f.resolve().stat().st_size  # snapshot files link into blobs/
        except OSError:
            pass
    return total


def cached_models(cache: Path | None = None) -> list[Cached]:
    """The cache's checkpoints psr supports, by name: a snapshot with a config.json of a
    supported family and safetensors weights, and each GGUF file of a supported one (its
    family from its metadata). Unreadable or unsupported entries are left out."""
    from psr.models.families import SUPPORTED
    from psr.models.sources import model_config

    cache = hub_cache() if cache is None else cache
    out: list[Cached] = []
    repos = sorted(cache.glob("models--*")) if cache.is_dir() else []
    for repo_dir in repos:
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        snap = _snapshot(repo_dir)
        if snap is None:
            continue
        candidates: list[tuple[str, Path, list[Path]]] = []
        if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
            candidates.append((repo, snap, [f for f in snap.rglob("*") if f.is_file()]))
        for g in sorted(snap.glob("*.gguf")):
            candidates.append((f"{repo}:{g.name}", g, [g]))
        for name, path, files in candidates:
            try:
                family = str(model_config(path).get("model_type"))
            except (ValueError, OSError, KeyError, TypeError):  # a listing skips those
                continue
            if family in SUPPORTED:
                out.append(Cached(name, family, _size(files), path))
    return out


def table(models: list[Cached], cache: Path) -> str:
    """`psr list`'s output: name, family, size; or a line saying the cache has none."""
    if not models:
        return f"no checkpoint psr can load in the local Hugging Face cache ({cache})"
    rows = [("NAME", "FAMILY", "SIZE")]
    rows += [(m.name, m.family, f"{m.size / 2**30:.2f} GiB") for m in models]
    w = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{a:<{w[0]}}  {b:<{w[1]}}  {c}" for a, b, c in rows]
    return "\n".join(lines) + f"\n(cache: {cache}; `psr inspect --model NAME` for details)"
