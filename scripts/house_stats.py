"""The house in numbers at one or more git revisions: lines per folder, the largest
functions, and the `duplicates` pairs in product code (issue 40's "how to judge it").

    python scripts/house_stats.py 6d9b435 HEAD --out bench/results/house/HOUSE.md

Each revision is exported with `git archive` into a temporary folder; lines are counted
without blank lines; functions are measured with `ast` (first line to last, decorators
excluded) in python/psr and psr_kernels, Triton kernels (`@triton.jit`) listed apart.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

FOLDERS = (
    "python/psr/runtime",
    "python/psr/models",
    "python/psr/eval",
    "python/psr/serve",
    "python/psr/cli",
    "python/psr/store",
    "python/psr",  # the package's own modules (bookkeeping), sub-packages excluded
    "psr_kernels",
    "csrc",
    "tests",
    "bench",
    "scripts",
)
SOURCE = (".py", ".h", ".cpp", ".cu", ".cuh")
PRODUCT = ("python/psr", "psr_kernels", "csrc")


def export(rev: str, into: Path) -> None:
    data = subprocess.run(["git", "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")


def _folder(rel: str) -> str | None:
    for f in FOLDERS:
        if rel.startswith(f + "/"):
            if f == "python/psr" and rel.count("/") > 2:
                return None  # a sub-package without its own row (e.g. __pycache__)
            return f
    return None


def line_counts(tree: Path) -> dict[str, tuple[int, int]]:
    """(files, non-blank lines) of source files per folder."""
    out: dict[str, tuple[int, int]] = {f: (0, 0) for f in FOLDERS}
    for p in tree.rglob("*"):
        if not p.is_file() or p.suffix not in SOURCE:
            continue
        f = _folder(str(p.relative_to(tree)))
        if f is None:
            continue
        n = sum(1 for line in p.read_text(errors="replace").splitlines() if line.strip())
        files, lines = out[f]
        out[f] = (files + 1, lines + n)
    return out


def _is_jit(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def functions(tree: Path) -> list[tuple[int, str, bool]]:
    """(lines, 'path:qualname', is a Triton kernel) of every function in product Python."""
    out: list[tuple[int, str, bool]] = []
    for root in ("python/psr", "psr_kernels"):
        for p in sorted((tree / root).rglob("*.py")):
            mod = ast.parse(p.read_text())
            rel = p.relative_to(tree)
            stack: list[tuple[ast.AST, str]] = [(mod, "")]
            while stack:
                node, prefix = stack.pop()
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.ClassDef):
                        stack.append((child, f"{prefix}{child.name}."))
                    elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                        n = (child.end_lineno or child.lineno) - child.lineno + 1
                        out.append((n, f"{rel}:{prefix}{child.name}", _is_jit(child)))
                        stack.append((child, f"{prefix}{child.name}."))
    return sorted(out, reverse=True)


def duplicate_pairs(tree: Path) -> list[str]:
    """`duplicates`' rows over the product folders of the exported tree."""
    rows: list[str] = []
    for root in PRODUCT:
        r = subprocess.run(
            ["duplicates", "--repo", str(tree / root), "--most", "40", "--seconds", "120"],
            capture_output=True,
            text=True,
        )
        rows += [f"{root}: {line}" for line in r.stdout.splitlines() if line.strip()]
    return rows


def report(revs: list[str], top: int) -> str:
    stats = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rev in revs:
            tree = Path(tmp) / rev.replace("/", "_")
            tree.mkdir()
            export(rev, tree)
            stats[rev] = (line_counts(tree), functions(tree), duplicate_pairs(tree))
    lines = ["| folder | " + " | ".join(f"{r} files / lines" for r in revs) + " |"]
    lines.append("|---|" + "---|" * len(revs))
    for f in FOLDERS:
        cells = [f"{stats[r][0][f][0]} / {stats[r][0][f][1]:,}" for r in revs]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    for r in revs:
        fns = stats[r][1]
        plain = [x for x in fns if not x[2]]
        over = [x for x in plain if x[0] > 80]
        lines += ["", f"## {r}: the {top} largest functions (Triton kernels apart)", ""]
        lines += [f"- {n} lines: `{name}`" for n, name, _ in plain[:top]]
        lines += [f"- functions over 80 lines (not Triton): {len(over)}"]
        jit = [x for x in fns if x[2]][:3]
        lines += ["- largest Triton kernels: " + ", ".join(f"`{x[1]}` {x[0]}" for x in jit)]
        lines += ["", f"## {r}: `duplicates` over {', '.join(PRODUCT)}", "", "```"]
        lines += stats[r][2] + ["```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="+", help="git revisions, e.g. the issue's start and HEAD")
    ap.add_argument("--top", type=int, default=12, help="how many of the largest functions")
    ap.add_argument("--out", type=Path, help="write the markdown here too")
    a = ap.parse_args()
    text = report(a.revs, a.top)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
