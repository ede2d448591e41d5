"""The import rules that keep the architecture visible in the tree.

Layers, lowest first; a module may import from its own layer and the ones below:
  psr_kernels
  < psr.store, and the bookkeeping: psr.cache, psr.policy, psr.points, psr.vocab,
    psr.machine, psr.load_config
  < psr.runtime < psr.models < psr.eval < psr.serve < psr.cli
plus:
- psr_kernels never imports psr; the bookkeeping is pure (no torch, no store, no
  kernels); only the psr.store package touches the extension; `import psr` (and using its core
  exports) loads no evaluation, CLI or plotting code;
- bench/ uses the library, never the command line (psr.cli);
- within psr.runtime, the engine never imports the generation driver (generate, model,
  speculative): the driver calls the engine, not the other way round;
- the torch-free modules import no torch, triton, transformers or matplotlib anywhere in
  their own source (tests/test_torch_free.py imports them with those blocked).
Imports are read from the source (ast), at any depth: function-local ones count.
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
    (
        "psr.store",
        "psr.cache",
        "psr.policy",
        "psr.points",
        "psr.vocab",
        "psr.machine",
        "psr.load_config",
        "psr.lazy",
    ),
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


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations
    only, which never run)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(path: Path, module: str, typing_too: bool = True) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included; those
    under `if TYPE_CHECKING:` unless `typing_too` is False)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree) if typing_too else _run_time_nodes(tree):
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
RUN_TIME_IMPORTS = {m: _imports(p, m, typing_too=False) for m, p in MODULES.items()}


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


@pytest.mark.parametrize(
    "module",
    ["psr.cache", "psr.policy", "psr.points", "psr.vocab", "psr.machine", "psr.load_config"],
)
def test_bookkeeping_is_pure(module: str) -> None:
    heavy = [
        i
        for i in IMPORTS[module]
        if i.split(".")[0] in ("torch", "triton", "psr_kernels", "numpy")
        or i.startswith(("psr.store", "psr._C", "psr.runtime", "psr.models", "psr.eval"))
    ]
    assert not heavy, f"{module} imports {heavy}"


def _named(imports: set[str], prefixes: tuple[str, ...]) -> list[str]:
    """The imports that are one of `prefixes` (a module or package) or lie under one."""
    return sorted(i for i in imports if any(i == p or i.startswith(p + ".") for p in prefixes))


BENCH = sorted((ROOT / "bench").glob("*.py"))


@pytest.mark.parametrize("path", BENCH, ids=[p.name for p in BENCH])
def test_bench_uses_the_library_not_the_cli(path: Path) -> None:
    found = _imports(path, f"bench.{path.stem}")
    # `psr.cli.main(...)` after a bare `import psr` reaches the CLI without importing it.
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            found.add(f"{node.value.id}.{node.attr}")
    bad = _named(found, ("psr.cli",))
    assert not bad, f"bench/{path.name} uses the command line: {bad}"


DRIVER = (
    "psr.runtime.batch",
    "psr.runtime.generate",
    "psr.runtime.model",
    "psr.runtime.speculative",
)
# The engine: every runtime module but the driver and the package root (which re-exports
# both). These are named so that a rename shows here.
ENGINE = sorted(m for m in MODULES if m.startswith("psr.runtime.") and m not in DRIVER)
NAMED_ENGINE = (
    "accounting bookkeeping compute context device_decode engine guard host_decode kv layer "
    "prefill slots spec stats steering step window"
).split()


def test_the_engine_modules_are_the_named_ones() -> None:
    assert {f"psr.runtime.{n}" for n in NAMED_ENGINE} <= set(ENGINE)
    assert set(DRIVER) <= set(MODULES)


@pytest.mark.parametrize("module", ENGINE)
def test_the_engine_never_imports_the_generation_driver(module: str) -> None:
    bad = _named(IMPORTS[module], DRIVER)
    assert not bad, f"{module} imports the generation driver: {bad}"


# The steps and the steering: the engine imports them, so they see it only through the
# protocols of psr.runtime.context (no import of psr.runtime.engine, not even for types).
STEPS = tuple(
    f"psr.runtime.{n}"
    for n in ("device_decode", "host_decode", "prefill", "window", "steering", "step", "context")
)


@pytest.mark.parametrize("module", STEPS)
def test_the_steps_never_import_the_engine(module: str) -> None:
    bad = _named(IMPORTS[module], ("psr.runtime.engine",))
    assert not bad, f"{module} imports the engine (use psr.runtime.context): {bad}"


TORCH_FREE = (
    "psr.vocab",
    "psr.load_config",
    "psr.machine",
    "psr.policy",
    "psr.points",
    "psr.cache",
    "psr.runtime.trace",
    "psr.runtime.stats",
    "psr.eval.latency",
    "psr.eval.report",
    "psr.eval.labels",
    "psr.eval.defaults",
    "psr.models.memory_plan",
)
HEAVY = ("torch", "triton", "transformers", "matplotlib")


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_import_no_heavy_library(module: str) -> None:
    bad = _named(IMPORTS[module], HEAVY)
    assert not bad, f"{module} must stay torch-free but imports {bad}"


def test_the_import_reader_sees_nested_and_relative_imports(tmp_path: Path) -> None:
    """The rules above are only as good as `_imports`: function-local, conditional and
    relative imports all count."""
    src = tmp_path / "mod.py"
    src.write_text(
        "def f():\n"
        "    if True:\n"
        "        import torch.nn as nn\n"
        "    from .model import OffloadedModel\n"
        "    from . import generate\n"
        "    from ..runtime import speculative\n"
    )
    found = _imports(src, "psr.runtime.mod")
    assert _named(found, HEAVY) == ["torch.nn"]
    assert _named(found, DRIVER) == [
        "psr.runtime.generate",
        "psr.runtime.model",
        "psr.runtime.model.OffloadedModel",
        "psr.runtime.speculative",
    ]


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (module -> modules it imports), or [] when none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(m: str) -> list[str]:
        if m in path:
            return [*path[path.index(m) :], m]
        if m in done:
            return []
        path.append(m)
        for n in sorted(graph[m]):
            found = visit(n)
            if found:
                return found
        path.pop()
        done.add(m)
        return []

    for m in sorted(graph):
        found = visit(m)
        if found:
            return found
    return []


def test_no_import_circle() -> None:
    """No module imports, even lazily, one that imports it back (package roots, which
    only re-export, and annotation-only imports under TYPE_CHECKING aside)."""
    files = {m for m, p in MODULES.items() if p.name != "__init__.py"}
    graph = {m: RUN_TIME_IMPORTS[m] & files for m in files}
    assert _cycle(graph) == []
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# The one name left shared, until the lanes that own both files have merged: the CLI's
# `psr generate` command and the runtime's generation driver.
SHARED_NAMES = {"generate.py"}


def test_module_names_are_unique() -> None:
    """A file name says which module it is: no two modules of psr or psr_kernels (package
    roots aside) share one."""
    seen: dict[str, list[str]] = {}
    for m, p in MODULES.items():
        if p.name != "__init__.py":
            seen.setdefault(p.name, []).append(m)
    clashes = {n: ms for n, ms in seen.items() if len(ms) > 1 and n not in SHARED_NAMES}
    assert not clashes


def test_only_the_store_touches_the_extension() -> None:
    users = sorted(m for m, imps in IMPORTS.items() if any(i.startswith("psr._C") for i in imps))
    assert users and all(u.startswith("psr.store.") for u in users), users


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


_FRAME_CALLS = ("_getframe", "currentframe", "stack")  # of sys / inspect
_FRAME_ATTRS = ("f_back", "f_locals", "f_globals")


def private_reads(source: str) -> list[str]:
    """`obj._name` reads of another object's private attribute (not self / cls) and frame
    walks (sys._getframe, inspect.currentframe / stack, f_back, f_locals) in `source`."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if not isinstance(n, ast.Attribute):
            continue
        base = ast.unparse(n.value)
        private = n.attr.startswith("_") and not n.attr.startswith("__")
        frame = (n.attr in _FRAME_CALLS and base in ("sys", "inspect")) or n.attr in _FRAME_ATTRS
        if (private and base not in ("self", "cls")) or frame:
            out.append(f"{n.lineno}: {ast.unparse(n)}")
    return out


def test_eval_measures_by_contract() -> None:
    """eval/ learns what it measures from the runtime's public API and the store's copy
    reasons, never from private attributes or stack frames (issue 40 item 5)."""
    found = {
        p.relative_to(ROOT).as_posix(): hits
        for p in sorted((SOURCES["psr"] / "eval").rglob("*.py"))
        if (hits := private_reads(p.read_text()))
    }
    assert not found, found


def test_the_private_read_finder_sees_what_it_forbids() -> None:
    src = "a = rt._slots\nb = self._x\nc = sys._getframe(1).f_back\nd = inspect.stack()\n"
    assert sorted(private_reads(src)) == [
        "1: rt._slots",
        "3: sys._getframe",
        "3: sys._getframe(1).f_back",
        "4: inspect.stack",
    ]
