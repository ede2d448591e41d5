"""`psr.inspect` of a header-faithful GGUF file (bench/fit_table.py), two psr trees side
by side: each run in a fresh process, alternating, wall time and peak RSS of the whole
process (imports included) and of opening the file alone (GGUFCheckpoint after the
imports: the header read).

    PYTHONPATH=python:. .venv/bin/python bench/inspect_side_by_side.py --old /tmp/old-tree \
        [--model 'Qwen3-30B-A3B Q4_K_M'] [--repeat 3]

--old is a tree holding `python/` and `psr_kernels/` of the commit to compare with (e.g.
`git archive COMMIT python psr_kernels | tar -x -C /tmp/old-tree`, plus the built _C).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import torch, transformers  # noqa: F401
from psr.models.gguf import GGUFCheckpoint
import psr
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
t1, r1 = time.perf_counter(), rss()
try:
    ck = GGUFCheckpoint(sys.argv[1]); ck.close(); del ck
    t2, r2 = time.perf_counter(), rss()
    psr.inspect(sys.argv[1])
    err = None
except OSError as e:
    t2, r2, err = time.perf_counter(), rss(), str(e)
t3 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"imports_s": t1 - t0, "open_s": t2 - t1, "open_rss": r2 - r1,
                  "total_s": t3 - t0, "peak_rss": peak, "error": err}))
"""


def run(tree: Path, path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'python'}:{tree}", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env
    )
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    res: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--model", default="Qwen3-30B-A3B Q4_K_M")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import fit_table

    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        files = fit_table.write(fit_table.SPECS[a.model], Path(d) / "m.gguf")
        size = sum(f.stat().st_size for f in files)
        rows = []
        for i in range(a.repeat):
            for name, tree in (("before", Path(a.old)), ("after", ROOT)):
                r = run(tree, files[0]) | {"tree": name, "run": i}
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(json.dumps({"model": a.model, "file_bytes": size}))


if __name__ == "__main__":
    main()
