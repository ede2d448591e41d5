"""Stage 2 of bench/gpu_bench.sh: every test marked `gpu`.

    python bench/gpu_tests.py --out OUT [--mini]

With pytest installed: `pytest -v -m gpu` over the files that mark tests gpu (-n 4 with
xdist; junit XML in OUT/gpu_tests.xml). The GPU machine's image may lack pytest and nothing
can be installed there, so without it (or with --mini) a minimal runner takes over: it puts a small
stand-in `pytest` module in place (mark.* / parametrize, raises(match=), skip, fixture as a
no-op), imports every test file under tests/ that marks tests `gpu`, expands parametrize,
passes `tmp_path`, and runs each test function (skipped without a CUDA device, as
tests/conftest.py does). Writes OUT/gpu_tests.json; exit status 1 if any test failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Skipped(Exception):
    pass


class _Mark:
    """`pytest.mark.<name>` (a value) and `pytest.mark.<name>(...)` (a decorator)."""

    def __init__(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self.name, self.args, self.kwargs = name, args, kwargs or {}
        self.configured = bool(args or kwargs)

    def __call__(self, *args, **kwargs):
        bare = len(args) == 1 and callable(args[0]) and not kwargs
        if bare and (self.configured or not isinstance(args[0], type)):
            fn = args[0]
            fn.__dict__.setdefault("_marks", []).append(self)
            return fn
        return _Mark(self.name, args, kwargs)


class _MarkGen:
    def __getattr__(self, name: str) -> _Mark:
        return _Mark(name)


@contextlib.contextmanager
def _raises(exc, match: str | None = None):
    try:
        yield
    except exc as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{type(e).__name__}({e!s}) does not match {match!r}") from e
        return
    raise AssertionError(f"DID NOT RAISE {exc}")


def stub_pytest() -> types.ModuleType:
    m = types.ModuleType("pytest")
    m.mark = _MarkGen()
    m.raises = _raises
    m.fixture = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f)

    def skip(reason: str = "") -> None:
        raise Skipped(reason)

    m.skip = skip
    m.importorskip = lambda name, *a, **k: importlib.import_module(name)
    m.approx = lambda v, rel=1e-6, abs=1e-12: v  # exact compare: enough for these tests
    return m


def gpu_test_files() -> list[Path]:
    return sorted(
        f
        for f in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"mark\.gpu\b", f.read_text(errors="replace"))
    )


def _marks(obj) -> list[_Mark]:
    ms = getattr(obj, "_marks", [])
    return list(reversed(ms))  # decorators apply bottom-up; pytest orders top-down


def expand(fn) -> list[tuple[str, dict]]:
    """(id, kwargs) per parametrize combination."""
    axes = []
    for mk in _marks(fn):
        if mk.name == "parametrize":
            names, values = mk.args[0], mk.args[1]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
            axes.append([(names, v if len(names) > 1 else (v,)) for v in values])
    if not axes:
        return [("", {})]
    out = []
    for combo in itertools.product(*axes):
        kw, ids = {}, []
        for names, vals in combo:
            kw.update(zip(names, vals, strict=True))
            ids += [str(v).removeprefix("torch.") for v in vals]
        out.append(("[" + "-".join(ids) + "]", kw))
    return out


def mini(out: Path, files: list[Path] | None = None, need_cuda: bool = True) -> int:
    import torch

    real_pytest = sys.modules.get("pytest")
    sys.modules["pytest"] = stub_pytest()
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        return _mini(out, gpu_test_files() if files is None else files, need_cuda, torch)
    finally:
        sys.path.remove(str(ROOT / "tests"))
        if real_pytest is not None:
            sys.modules["pytest"] = real_pytest
        else:
            sys.modules.pop("pytest", None)


def _mini(out: Path, files: list[Path], need_cuda: bool, torch) -> int:
    has_cuda = torch.cuda.is_available() or not need_cuda
    results = []
    for f in files:
        rel = f.relative_to(ROOT) if f.is_relative_to(ROOT) else Path(f.name)
        name = "gpu_test_" + "_".join(rel.with_suffix("").parts)
        try:
            spec = importlib.util.spec_from_file_location(name, f)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except Exception:
            results.append({"test": str(rel), "status": "error", "detail": traceback.format_exc()})
            continue
        module_gpu = any(getattr(m, "name", "") == "gpu" for m in _as_list(mod, "pytestmark"))
        for fname, fn in inspect.getmembers(mod, inspect.isfunction):
            if not fname.startswith("test_") or fn.__module__ != name:
                continue
            if not (module_gpu or any(mk.name == "gpu" for mk in _marks(fn))):
                continue
            for pid, kw in expand(fn):
                tid = f"{rel}::{fname}{pid}"
                t0 = time.time()
                if not has_cuda:
                    results.append({"test": tid, "status": "skipped", "detail": "no CUDA device"})
                    continue
                params = inspect.signature(fn).parameters
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        if "tmp_path" in params:
                            kw = {**kw, "tmp_path": Path(tmp)}
                        fn(**kw)
                    status, detail = "passed", ""
                except Skipped as e:
                    status, detail = "skipped", str(e)
                except Exception:
                    status, detail = "failed", traceback.format_exc()
                results.append(
                    {
                        "test": tid,
                        "status": status,
                        "seconds": round(time.time() - t0, 2),
                        "detail": detail[-3000:],
                    }
                )
                print(f"{status.upper():8} {tid} ({time.time() - t0:.1f} s)", flush=True)
    counts = {s: sum(r["status"] == s for r in results) for s in ("passed", "failed", "error")}
    counts["skipped"] = sum(r["status"] == "skipped" for r in results)
    for r in results:
        if r["status"] in ("failed", "error"):
            print(f"--- {r['test']}\n{r['detail']}", flush=True)
    (out / "gpu_tests.json").write_text(
        json.dumps({"runner": "mini (no pytest)", "counts": counts, "results": results}, indent=1)
    )
    print(", ".join(f"{v} {k}" for k, v in counts.items() if v) + " (mini runner, no pytest)")
    return 1 if counts["failed"] or counts["error"] else 0


def _as_list(mod, attr: str) -> list:
    v = getattr(mod, attr, [])
    return v if isinstance(v, list) else [v]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--mini", action="store_true", help="the runner without pytest, always")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.mini and importlib.util.find_spec("pytest") is not None:
        # -v: each result streams into the log, so a run cut at its limit still says which
        # tests failed; xdist (in the GPU image) spreads them over 4 processes on the one GPU.
        # Only the files that mark tests gpu: collecting all of tests/ took most of the
        # stage's time in run 3 and failed on the serve tests' clients (openai, anthropic),
        # which the image lacks and no gpu test needs.
        files = [str(p.relative_to(ROOT)) for p in gpu_test_files()]
        cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", *files, "-p", "no:cacheprovider"]
        cmd += ["--continue-on-collection-errors", f"--junitxml={out / 'gpu_tests.xml'}", "-rfE"]
        if importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", "4"]
        print("$ " + " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=os.environ.copy()).returncode
        return 0 if rc == 5 else rc  # 5: nothing collected
    print("pytest not available: the mini runner" if not args.mini else "mini runner", flush=True)
    return mini(out)


if __name__ == "__main__":
    sys.exit(main())
