"""Copy the pure-Python packages psr needs that the GPU machine's image lacks into .carry/py.

    python bench/gpu_carry.py [--packages gguf,platformdirs]

The lent device machine cannot install anything (docs/gpu.md): on 2026-12-04 its image had
torch 2.11, triton 3.6 and transformers 5.17 but neither `gguf` (GGUF files, the ggml tables)
nor `platformdirs` (the machine profile's path), and every stage that loads a model failed.
This copies each named package from this environment into .carry/py (git-ignored through
.git/info/exclude); `bash bench/gpu_bench.sh` puts .carry/py on PYTHONPATH when it is there.
Pass `carry: [".carry"]` to the device run. Compiled packages are refused (the image's
Python differs from this one's).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / ".carry" / "py"


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"gpu_carry.py: {name!r} is not installed here: pip install {name}")
    return Path(spec.origin).parent


def carry(name: str) -> int:
    src = package_dir(name)
    compiled = [p.name for p in src.rglob("*") if p.suffix in (".so", ".pyd")]
    if compiled:
        raise SystemExit(f"gpu_carry.py: {name!r} has compiled files ({compiled[0]}): not carried")
    dest = DEST / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())


def ignore_carry() -> None:
    exclude = ROOT / ".git" / "info" / "exclude"
    if not (ROOT / ".git").is_dir():  # a worktree: .git is a file; the main tree ignores it
        return
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if "/.carry/" not in lines:
        exclude.write_text("\n".join([*lines, "/.carry/"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--packages", default="gguf,platformdirs", help="comma-separated names")
    a = ap.parse_args(argv)
    ignore_carry()
    for name in a.packages.split(","):
        print(f"{name}: {carry(name) / 2**20:.2f} MiB -> {DEST / name}")
    print('device run: carry [".carry"], command `bash bench/gpu_bench.sh --device`')
    return 0


if __name__ == "__main__":
    sys.exit(main())
