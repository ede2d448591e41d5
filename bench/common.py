"""What the bench scripts share (bench/ is not a package: scripts import it as a sibling,
`from common import write_json`)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` through a temporary file, so a run cut short by its
    stage's time limit leaves the previous file or the whole new one, never half of it.
    Values JSON cannot hold are written as their str()."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def tree_runs(
    trees: Sequence[Path], rounds: int, cmd: Sequence[str]
) -> Iterator[tuple[int, Path, dict[str, Any]]]:
    """(round, tree, result) of `cmd` run once per tree and round, the trees' order
    alternating round by round, each in a process whose path starts with the tree's
    `python/` (a checkout with its extension built in place) and the tree, at one thread;
    the result is the JSON object on the process's last stdout line. A failed run raises
    RuntimeError with the tail of its stderr."""
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": f"{tree / 'python'}:{tree}", "OMP_NUM_THREADS": "1"}
            p = subprocess.run(list(cmd), env=env, capture_output=True, text=True, check=False)
            if p.returncode:
                raise RuntimeError(f"{tree}: {p.stderr[-3000:]}")
            yield r, tree, json.loads(p.stdout.strip().splitlines()[-1])


def built_trees(spec: str) -> list[Path]:
    """The comma-separated checkouts of `spec`, resolved; each must have its extension built
    in place (python/psr/_C*.so), else SystemExit naming it."""
    trees = [Path(t).resolve() for t in spec.split(",")]
    for t in trees:
        if not list((t / "python" / "psr").glob("_C*.so")):
            raise SystemExit(f"{t}: no built extension in python/psr (build_ext --inplace)")
    return trees


def emit(text: str, out: Path | None) -> None:
    """Print a result table and, given `out`, write it there (its folder made)."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
