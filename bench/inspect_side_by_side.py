"""`psr inspect --json` of a header-faithful GGUF file (bench/fit_table.py), two psr
trees side by side: each run in a fresh process, alternating; per run the wall time from
the first import to the answer (total_s) and of the whole process (process_wall_s), its
CPU time (user + system), its peak RSS (VmHWM) and which of torch / transformers /
triton it imported.

    PYTHONPATH=python:. .venv/bin/python bench/inspect_side_by_side.py --old /tmp/old-tree \
        [--model 'Qwen3-30B-A3B Q4_K_M'] [--repeat 3] [--split-bytes N]

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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import contextlib, io, json, os, sys, time
t0 = time.perf_counter()
from psr.cli import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        rc = main(["inspect", "--json", "--model", sys.argv[1]])
    err = None
except SystemExit as e:
    rc, err = e.code, None
except OSError as e:
    rc, err = 1, str(e)
t1 = time.perf_counter()
cpu = os.times()
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
mods = [m for m in ("torch", "transformers", "triton") if m in sys.modules]
print(json.dumps({"total_s": t1 - t0, "cpu_s": cpu.user + cpu.system,
                  "peak_rss": int(hwm.split()[1]) * 1024, "imported": mods,
                  "rc": rc, "error": err}))
"""


def run(tree: Path, path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'python'}:{tree}", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - t0  # the whole process: interpreter start to exit
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    res: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return res | {"process_wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--model", default="Qwen3-30B-A3B Q4_K_M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--split-bytes", type=int, default=0, help="write the file in parts")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import fit_table

    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        files = fit_table.write(
            fit_table.SPECS[a.model], Path(d) / "m.gguf", split_bytes=a.split_bytes
        )
        size = sum(f.stat().st_size for f in files)
        rows = []
        for i in range(a.repeat):
            for name, tree in (("before", Path(a.old)), ("after", ROOT)):
                r = run(tree, files[0]) | {"tree": name, "run": i}
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(json.dumps({"model": a.model, "file_bytes": size, "parts": len(files)}))


if __name__ == "__main__":
    main()
