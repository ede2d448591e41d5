"""No function in python/psr over MAX_LINES lines (issue 40), Triton kernels excepted: a
long function is split into named pieces that read top to bottom.

A function's length is its `def` line to its last line (docstring and comments included,
decorators not), as `ast` reports them. ALLOWED names the offenders other lanes are still
splitting; the lead empties it once they merge (an entry that no longer offends fails too,
so the list only shrinks).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "psr"
MAX_LINES = 80

# "path under python/psr::function": offenders in files other lanes own this session.
ALLOWED: frozenset[str] = frozenset()


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with triton.jit (or autotune / heuristics over one): a kernel body."""
    return any(
        any(w in ast.unparse(d) for w in ("triton.jit", "triton.autotune", "triton.heuristics"))
        for d in fn.decorator_list
    )


def long_functions(source: str, name: str, max_lines: int = MAX_LINES) -> dict[str, int]:
    """`"name::function": lines` of every function (methods and nested ones too) in
    `source` longer than `max_lines`, Triton kernels left out."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > max_lines and not _is_triton_kernel(node):
                out[f"{name}::{node.name}"] = lines
    return out


def _package_offenders() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(PKG.rglob("*.py")):
        out.update(long_functions(path.read_text(), path.relative_to(PKG).as_posix()))
    return out


def test_no_function_in_psr_is_over_80_lines() -> None:
    offenders = {k: n for k, n in _package_offenders().items() if k not in ALLOWED}
    listed = ", ".join(f"{k} ({n})" for k, n in sorted(offenders.items()))
    assert not offenders, f"functions over {MAX_LINES} lines (split them): {listed}"


def test_the_allow_list_holds_only_current_offenders() -> None:
    stale = sorted(ALLOWED - set(_package_offenders()))
    assert not stale, f"no longer over {MAX_LINES} lines: remove from ALLOWED: {stale}"


def test_the_counter_sees_long_functions_and_skips_kernels() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    src = (
        f"def long():\n{body}\n\n"
        f"class C:\n    async def method(self):\n{body.replace('    ', '        ')}\n\n"
        f"@triton.jit\ndef kernel():\n{body}\n\n"
        f"def short():\n    return 1\n"
    )
    assert long_functions(src, "m.py") == {"m.py::long": 81, "m.py::method": 81}
    assert long_functions(src, "m.py", max_lines=81) == {}
