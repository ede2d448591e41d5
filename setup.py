"""Build psr: CMake (driven from here, Ninja) builds the pybind11 module psr._C.

Environment:
  PSR_CUDA=auto|0|1       which backends to build (default auto; the build prints one line
                          "psr: building backends ..." saying which and why; `pip -v` shows it):
                          auto  CPU, plus CUDA when nvcc is found through CUDACXX, CUDA_HOME,
                                CUDA_PATH or PATH (not /usr/local/cuda unless one of those
                                points there);
                          0     CPU backend only, even if nvcc exists;
                          1     CPU + CUDA, and fail unless nvcc is found (the places above,
                                then /usr/local/cuda/bin/nvcc).
  PSR_SKIP_CUDA_BUILD=1   alias of PSR_CUDA=0 (kept for old scripts).
  PSR_FORCE_CUDA=1        alias of PSR_CUDA=1 (kept for old scripts); contradicting settings
                          (say PSR_CUDA=1 with PSR_SKIP_CUDA_BUILD=1) fail the build.
  TORCH_CUDA_ARCH_LIST    e.g. "8.0;9.0+PTX" (default archs: 80;89;90).
  PSR_SANITIZE=address,undefined
                          ASan + UBSan build of the C++ sources (any -fsanitize= list; the
                          CUDA sources are not instrumented); see scripts/sanitize.sh for how
                          to run it (LD_PRELOAD, ASAN_OPTIONS).
  CMAKE_BUILD_PARALLEL_LEVEL, PSR_BUILD_TYPE (Release; RelWithDebInfo with PSR_SANITIZE, so
                          the module keeps its symbols for the sanitizer's reports).
The build never imports torch. The CUDA decision is the pure function `plan_cuda`, the
architectures `cuda_archs` (scripts/cuda_archs.py parses the list); tests/test_packaging.py
tests both, loading this file without running setup().
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.warnings import InformationOnly

ROOT = Path(__file__).resolve().parent
CUDA_ARCHS_PY = ROOT / "scripts" / "cuda_archs.py"


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
SYSTEM_NVCC = "/usr/local/cuda/bin/nvcc"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


def cuda_mode(env: Mapping[str, str]) -> tuple[str, str]:
    """('auto' | '0' | '1', where it came from) from PSR_CUDA and its two aliases.

    PSR_SKIP_CUDA_BUILD=1 means PSR_CUDA=0 and PSR_FORCE_CUDA=1 means PSR_CUDA=1 (an alias
    set to anything but a true value is ignored, as before). An unknown PSR_CUDA value or
    contradicting settings raise ValueError.
    """
    raw = env.get("PSR_CUDA", "").strip().lower()
    if raw in ("", "auto"):
        mode, source = "auto", ("PSR_CUDA=auto" if raw else "default PSR_CUDA=auto")
    elif raw in _FALSE:
        mode, source = "0", f"PSR_CUDA={env['PSR_CUDA'].strip()}"
    elif raw in _TRUE:
        mode, source = "1", f"PSR_CUDA={env['PSR_CUDA'].strip()}"
    else:
        raise ValueError(f"PSR_CUDA={env['PSR_CUDA']!r}: expected auto, 0 or 1")
    aliases = [
        (name, m)
        for name, m in (("PSR_SKIP_CUDA_BUILD", "0"), ("PSR_FORCE_CUDA", "1"))
        if _truthy(env.get(name))
    ]
    for name, m in aliases:
        if mode != "auto" and m != mode:
            raise ValueError(f"{source} contradicts {name}={env[name].strip()}")
        if mode == "auto":
            mode, source = m, f"{name}={env[name].strip()} (alias of PSR_CUDA={m})"
    return mode, source


def _is_exe(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def nvcc_candidates(
    env: Mapping[str, str], mode: str, which: Callable[[str], str | None] = shutil.which
) -> list[tuple[str, str]]:
    """(path, origin) in search order: CUDACXX, CUDA_HOME, CUDA_PATH, PATH; with mode '1'
    also /usr/local/cuda/bin/nvcc (auto does not look there: a toolkit nobody pointed at)."""
    cands: list[tuple[str, str]] = []
    if env.get("CUDACXX"):
        cands.append((env["CUDACXX"], "CUDACXX"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            cands.append((os.path.join(env[var], "bin", "nvcc"), var))
    on_path = which("nvcc")
    if on_path:
        cands.append((on_path, "PATH"))
    if mode == "1":
        cands.append((SYSTEM_NVCC, "the /usr/local/cuda fallback"))
    return cands


def plan_cuda(
    env: Mapping[str, str],
    which: Callable[[str], str | None] = shutil.which,
    is_exe: Callable[[str], bool] = _is_exe,
) -> tuple[str | None, str]:
    """(nvcc to build the CUDA backend with, or None for CPU only; the line the build prints).

    Raises ValueError for a bad or contradicting switch, or PSR_CUDA=1 without an nvcc.
    """
    mode, source = cuda_mode(env)
    if mode == "0":
        return None, f"psr: building backends: cpu (CUDA off: {source})"
    cands = nvcc_candidates(env, mode, which)
    found = next(((p, o) for p, o in cands if p and is_exe(p)), None)
    if found:
        nvcc, origin = found
        return nvcc, f"psr: building backends: cpu+cuda (nvcc {nvcc} from {origin}; {source})"
    looked = ", ".join(o for _, o in cands) or "nothing set"
    places = "CUDACXX, CUDA_HOME, CUDA_PATH, PATH"
    if mode == "1":
        raise ValueError(
            f"{source} but no nvcc was found (searched {places} and {SYSTEM_NVCC}; "
            f"candidates: {looked}): set CUDA_HOME or put nvcc on PATH"
        )
    why = f"no nvcc through {places}"
    if is_exe(SYSTEM_NVCC):
        why += f"; {SYSTEM_NVCC} exists but auto ignores it: PSR_CUDA=1 uses it"
    return None, f"psr: building backends: cpu (CUDA off: {why}; {source})"


def _load_cuda_archs() -> ModuleType:
    """scripts/cuda_archs.py, the one TORCH_CUDA_ARCH_LIST parser (bench/gpu_build.py uses
    it too), loaded by path: psr is not installed while this file runs."""
    spec = importlib.util.spec_from_file_location("_psr_cuda_archs", CUDA_ARCHS_PY)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DEFAULT_CUDA_ARCHS = "80;89;90"


def cuda_archs(env: Mapping[str, str]) -> str:
    """CMAKE_CUDA_ARCHITECTURES from TORCH_CUDA_ARCH_LIST ('8.0;9.0+PTX' -> '80-real;90'),
    DEFAULT_CUDA_ARCHS when unset. Raises ValueError naming an entry it cannot parse."""
    spec = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    return _load_cuda_archs().cmake_archs(spec) if spec else DEFAULT_CUDA_ARCHS


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)

        try:
            nvcc, line = plan_cuda(os.environ)
            archs = cuda_archs(os.environ) if nvcc else None
        except ValueError as e:
            raise SystemExit(f"psr: {e}") from None
        import pybind11  # build requirement

        sanitize = os.environ.get("PSR_SANITIZE", "").strip()
        default_type = "RelWithDebInfo" if sanitize else "Release"
        build_type = os.environ.get("PSR_BUILD_TYPE") or default_type
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPSR_OUTPUT_DIR={out_dir}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DPSR_WITH_CUDA={'ON' if nvcc else 'OFF'}",
            f"-DPSR_SANITIZE={sanitize}",
        ]
        if nvcc:
            args += [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        if shutil.which("ninja") or _has_module("ninja"):
            args.append("-GNinja")
        print(line, flush=True)
        if sanitize:
            print(f"psr: -fsanitize={sanitize} ({build_type}); run as scripts/sanitize.sh does")
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_temp), *args])
        subprocess.check_call(["cmake", "--build", str(build_temp), "--parallel"])


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":  # setuptools runs this file as __main__; the tests import it
    # `pip install -e .` prints this notice for every package-dir layout ("be careful with
    # folders in your working directory with the same name as your package"): information
    # about editable installs in general, not a warning about this project.
    warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)
    setup(
        ext_modules=[CMakeExtension("psr._C")],
        cmdclass={"build_ext": CMakeBuild},
    )
