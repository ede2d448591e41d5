"""Lazy package exports (PEP 562) of `psr.runtime` and `psr.models`: a name's module is
imported when the name is first used, so importing a package pulls in neither torch nor
what its exports need. (`psr` itself keeps its own two functions: `import psr` imports
no other module, tests/test_architecture.py checks it.)"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) of `package` whose `exports` map module -> names and
    whose globals are `namespace` (its `__all__` listed by `__dir__`)."""
    where = {name: mod for mod, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *namespace.get("__all__", ())])

    return getattr_, dir_
