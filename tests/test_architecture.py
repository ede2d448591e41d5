"""The import rules that keep the architecture visible in the tree.

Layers, lowest first; a module may import from its own layer and the ones below:
  psr_kernels < psr.store, psr.cache, psr.policy < psr.runtime < psr.models < psr.eval
  < psr.serve < psr.cli
plus: psr_kernels never imports psr; cache and policy are pure bookkeeping (no torch,
no store, no kernels); only psr.store touches the extension; `import psr` (and using its
core exports) loads no evaluation, CLI or plotting code.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"psr": ROOT / "python" / "psr", "psr_kernels": ROOT / "psr_kernels"}

LAYERS = [
    ("psr_kernels",),
    ("psr.store", "psr.cache", "psr.policy", "psr.points", "psr.vocab"),
    ("psr.runtime",),
    ("psr.models",),
    ("psr.eval",),
    ("psr.serve",),
    ("psr.cli",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, root in SOURCES.items():
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _layer(name: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


MODULES = _modules()
IMPORTS = {m: _imports(p, m) for m, p in MODULES.items()}


def test_the_tree_is_what_the_layers_name() -> None:
    assert {"psr.store", "psr.cache", "psr.policy", "psr.cli"} <= set(MODULES)
    for pkg in ("psr.runtime", "psr.models", "psr.eval"):
        assert any(m.startswith(pkg + ".") for m in MODULES), pkg
    # The package root only re-exports; every other module belongs to a layer.
    assert {m for m in MODULES if _layer(m) is None} == {"psr"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) is not None))
def test_imports_point_only_downward(module: str) -> None:
    own = _layer(module)
    bad = sorted(
        i
        for i in IMPORTS[module]
        if (i == "psr" or i.startswith(("psr.", "psr_kernels")))
        and _layer(i) is not None
        and _layer(i) > own
    )
    assert not bad, f"{module} imports from a higher layer: {bad}"
    if module.startswith("psr."):
        assert "psr" not in IMPORTS[module], f"{module} imports the package root"


def test_kernels_import_nothing_from_psr() -> None:
    for m in (m for m in MODULES if m.startswith("psr_kernels")):
        assert not [i for i in IMPORTS[m] if i == "psr" or i.startswith("psr.")], m


@pytest.mark.parametrize("module", ["psr.cache", "psr.policy"])
def test_bookkeeping_is_pure(module: str) -> None:
    heavy = [
        i
        for i in IMPORTS[module]
        if i.split(".")[0] in ("torch", "triton", "psr_kernels", "numpy")
        or i.startswith(("psr.store", "psr._C", "psr.runtime", "psr.models", "psr.eval"))
    ]
    assert not heavy, f"{module} imports {heavy}"


def test_only_the_store_touches_the_extension() -> None:
    users = sorted(m for m, imps in IMPORTS.items() if any(i.startswith("psr._C") for i in imps))
    assert users == ["psr.store"]


def test_import_psr_loads_no_eval_cli_or_plotting_code() -> None:
    code = (
        "import sys, json, psr\n"
        "before = sorted(m for m in sys.modules if m.startswith(('psr', 'torch')))\n"
        "psr.load, psr.offload, psr.ExpertStore, psr.OffloadedModel, psr.make_policy\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('psr.eval', 'psr.cli', "
        "'matplotlib', 'lm_eval')))\n"
        "print(json.dumps({'before': before, 'bad': bad}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["before"] == ["psr"], "import psr alone should import nothing else"
    assert res["bad"] == []


def test_every_export_resolves() -> None:
    import psr

    assert set(psr._WHERE) == set(psr.__all__)
    for name in psr.__all__:
        assert getattr(psr, name) is not None
