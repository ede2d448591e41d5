"""Build psr: CMake (driven from here, Ninja) builds the pybind11 module psr._C.

Environment:
  PSR_SKIP_CUDA_BUILD=1   CPU backend only, even if nvcc exists.
  PSR_FORCE_CUDA=1        fail unless the CUDA backend can be built.
  TORCH_CUDA_ARCH_LIST    e.g. "8.0;9.0+PTX" (default archs: 80;89;90).
  PSR_SANITIZE=address,undefined
                          ASan + UBSan build of the C++ sources (any -fsanitize= list; the
                          CUDA sources are not instrumented); see scripts/sanitize.sh for how
                          to run it (LD_PRELOAD, ASAN_OPTIONS).
  CMAKE_BUILD_PARALLEL_LEVEL, PSR_BUILD_TYPE (Release; RelWithDebInfo with PSR_SANITIZE, so
                          the module keeps its symbols for the sanitizer's reports).
The build never imports torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.warnings import InformationOnly

ROOT = Path(__file__).resolve().parent

# `pip install -e .` prints this notice for every package-dir layout ("be careful with
# folders in your working directory with the same name as your package"): information
# about editable installs in general, not a warning about this project.
warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def find_nvcc() -> str | None:
    """nvcc from CUDACXX, CUDA_HOME/CUDA_PATH, PATH or /usr/local/cuda."""
    cands = [os.environ.get("CUDACXX")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "nvcc"))
    cands += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cuda_archs() -> str:
    """CMAKE_CUDA_ARCHITECTURES from TORCH_CUDA_ARCH_LIST ('8.0;9.0+PTX' -> '80-real;90')."""
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not spec:
        return "80;89;90"
    out = []
    for tok in spec.replace(",", ";").replace(" ", ";").split(";"):
        tok = tok.strip()
        if not tok:
            continue
        ptx = tok.endswith("+PTX")
        num = tok.removesuffix("+PTX").replace(".", "")
        if not num.isalnum():
            raise SystemExit(f"psr: cannot parse TORCH_CUDA_ARCH_LIST entry {tok!r}")
        out.append(num if ptx else f"{num}-real")
    return ";".join(out)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)

        nvcc = None if _truthy("PSR_SKIP_CUDA_BUILD") else find_nvcc()
        if _truthy("PSR_FORCE_CUDA") and nvcc is None:
            raise SystemExit(
                "psr: PSR_FORCE_CUDA=1 but no nvcc was found (set CUDA_HOME or put nvcc on PATH)"
                + (" and PSR_SKIP_CUDA_BUILD is set" if _truthy("PSR_SKIP_CUDA_BUILD") else "")
            )
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
            args += [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_archs()}"]
        if shutil.which("ninja") or _has_module("ninja"):
            args.append("-GNinja")
        print(f"psr: CUDA backend {'ON with ' + nvcc if nvcc else 'OFF'}", flush=True)
        if sanitize:
            print(f"psr: -fsanitize={sanitize} ({build_type}); run as scripts/sanitize.sh does")
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_temp), *args])
        subprocess.check_call(["cmake", "--build", str(build_temp), "--parallel"])


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


setup(
    ext_modules=[CMakeExtension("psr._C")],
    cmdclass={"build_ext": CMakeBuild},
)
