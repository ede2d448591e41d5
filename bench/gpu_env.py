"""What this machine has: versions and build tools, in one cheap command (stage 0 of
bench/gpu_bench.sh). Also the probe that bench/gpu_build.py plans its build from.

    python bench/gpu_env.py [--json OUT/versions.json]

Records python (and whether Python.h is there), torch (+ torch.version.cuda, the GPU),
triton, transformers, setuptools, pip, pybind11 (module or torch's bundled headers),
cmake, ninja, make, the C++ compiler, nvcc (found as setup.py finds it), CUDA headers
and cudart libraries (toolkit or the nvidia-* wheels), nvidia-smi. Never fails: what
cannot be read is recorded as such. Standard library only, except the torch import.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "tqdm",
    "matplotlib",
    "setuptools",
    "wheel",
    "pip",
    "pybind11",
    "cmake",
    "ninja",
    "pytest",
    "pytest-benchmark",
)


def _run(cmd: list[str], timeout: float = 20.0) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return f"error: {e}"
    out = (p.stdout + p.stderr).strip()
    return out if p.returncode == 0 else f"rc {p.returncode}: {out[-500:]}"


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def site_dirs() -> list[Path]:
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return [Path(d) for d in sorted(dirs) if Path(d).is_dir()]


def find_nvcc() -> str | None:
    """As setup.py does: CUDACXX, CUDA_HOME/CUDA_PATH, PATH, /usr/local/cuda."""
    cands = [os.environ.get("CUDACXX")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "nvcc"))
    cands += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cuda_roots(nvcc: str | None) -> list[Path]:
    roots = [Path(nvcc).resolve().parent.parent] if nvcc else []
    roots += [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    roots += [Path("/usr/local/cuda"), *map(Path, sorted(glob.glob("/usr/local/cuda-*")))]
    out: list[Path] = []
    for r in roots:
        if r.is_dir() and r not in out:
            out.append(r)
    return out


def cuda_include_dirs(nvcc: str | None) -> list[str]:
    """Directories holding cuda_runtime.h: the toolkit's, then the nvidia-* wheels'
    (cu12: nvidia/cuda_runtime/include; cu13: nvidia/cu13/include), plus the wheels'
    other include dirs (crt/ headers live in nvidia-cuda-crt on CUDA 13)."""
    cands = [r / "include" for r in cuda_roots(nvcc)]
    cands += [r / "targets" / "x86_64-linux" / "include" for r in cuda_roots(nvcc)]
    wheel_incs: list[Path] = []
    for sd in site_dirs():
        wheel_incs += [Path(p) for p in sorted(glob.glob(str(sd / "nvidia" / "*" / "include")))]
    main = [p for p in cands + wheel_incs if (p / "cuda_runtime.h").is_file()]
    if not main:
        return []
    extra = [p for p in wheel_incs if p not in main] if main[0] in wheel_incs else []
    seen: list[str] = []
    for p in main[:1] + extra:
        if str(p) not in seen:
            seen.append(str(p))
    return seen


def cudart_libs(nvcc: str | None) -> dict[str, str | None]:
    """libcudart_static.a of a toolkit and a shared libcudart (toolkit or wheel)."""
    static = shared = None
    for r in cuda_roots(nvcc):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            d = r / sub
            if static is None and (d / "libcudart_static.a").is_file():
                static = str(d / "libcudart_static.a")
            if shared is None:
                so = sorted(glob.glob(str(d / "libcudart.so*")))
                shared = so[-1] if so else None
    if shared is None:
        for sd in site_dirs():
            so = sorted(glob.glob(str(sd / "nvidia" / "*" / "lib" / "libcudart.so*")))
            if so:
                shared = so[-1]
                break
    return {"static": static, "shared": shared}


def pybind11_include() -> tuple[str | None, str]:
    """pybind11's headers: the pybind11 module's, else the copy torch ships."""
    if importlib.util.find_spec("pybind11") is not None:
        try:
            import pybind11

            return pybind11.get_include(), "pybind11 module"
        except Exception:
            pass
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        inc = Path(next(iter(spec.submodule_search_locations))) / "include"
        if (inc / "pybind11" / "pybind11.h").is_file():
            return str(inc), "torch's bundled headers"
    return None, "missing"


def pybind11_header_version(inc: str | None) -> str | None:
    if not inc:
        return None
    f = Path(inc) / "pybind11" / "detail" / "common.h"
    if not f.is_file():
        return None
    v = {}
    for line in f.read_text(errors="replace").splitlines():
        for key in ("MAJOR", "MINOR", "MICRO", "PATCH"):
            tag = f"#define PYBIND11_VERSION_{key} "
            if line.startswith(tag):
                v["MICRO" if key == "PATCH" else key] = line[len(tag) :].strip()
    return ".".join(v.get(k, "?") for k in ("MAJOR", "MINOR", "MICRO")) if v else None


def which(name: str) -> str | None:
    """On PATH, or beside this python (a venv's cmake/ninja wheels, PATH not activated)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def tools() -> dict:
    """The build-relevant facts (no torch import): what gpu_build.py plans from."""
    nvcc = find_nvcc()
    pyb_inc, pyb_src = pybind11_include()
    py_inc = sysconfig.get_paths()["include"]
    cmake, ninja = which("cmake"), which("ninja")
    return {
        "python": sys.executable,
        "python_h": (Path(py_inc) / "Python.h").is_file(),
        "python_include": py_inc,
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "cxx": os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"),
        # Triton compiles its launcher with a C compiler at the first kernel launch.
        "cc": os.environ.get("CC")
        or shutil.which("gcc")
        or shutil.which("cc")
        or shutil.which("clang"),
        "make": shutil.which("make"),
        "cmake": cmake,
        "cmake_module": importlib.util.find_spec("cmake") is not None,
        "ninja": ninja,
        "ninja_module": importlib.util.find_spec("ninja") is not None,
        "setuptools": _version("setuptools"),
        "wheel": _version("wheel"),
        "pip": _version("pip"),
        "pybind11_module": _version("pybind11"),
        "pybind11_include": pyb_inc,
        "pybind11_source": pyb_src,
        "pybind11_header_version": pybind11_header_version(pyb_inc),
        "nvcc": nvcc,
        "cuda_include": cuda_include_dirs(nvcc),
        "cudart": cudart_libs(nvcc),
    }


def probe(with_torch: bool = True) -> dict:
    t0 = time.time()
    info: dict = {
        "python_version": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {p: _version(p) for p in PACKAGES},
        "tools": tools(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "CUDA_HOME",
                "CUDA_PATH",
                "CUDACXX",
                "TORCH_CUDA_ARCH_LIST",
                "TRITON_INTERPRET",
                "PSR_COMPUTE",
                "PSR_BACKEND",
            )
        },
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        info["mem_total_kb"] = None
    git = _run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"])
    info["git_head"] = git if git and len(git) == 40 else None  # the device copy has no .git
    du = shutil.disk_usage(".")
    info["disk_free_gb"] = round(du.free / 1e9, 1)
    nvcc = info["tools"]["nvcc"]
    info["nvcc_version"] = _run([nvcc, "--version"]).splitlines()[-1] if nvcc else None
    for tool in ("cmake", "ninja"):
        exe = info["tools"][tool]
        out = _run([exe, "--version"]) if exe else None
        info[f"{tool}_version"] = out.splitlines()[0] if out else None
    smi = shutil.which("nvidia-smi")
    q = (
        "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,"
        "pcie.link.width.current,clocks.max.sm,power.limit"
    )
    info["nvidia_smi"] = (
        _run([smi, f"--query-gpu={q}", "--format=csv,noheader"]) if smi else "not found"
    )
    if with_torch:
        try:
            import torch

            t = {
                "version": torch.__version__,
                "cuda": torch.version.cuda,
                "cuda_available": torch.cuda.is_available(),
            }
            if t["cuda_available"]:
                t["device"] = torch.cuda.get_device_name(0)
                t["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
                t["device_count"] = torch.cuda.device_count()
            info["torch"] = t
        except Exception as e:
            info["torch"] = {"error": repr(e)}
    info["seconds"] = round(time.time() - t0, 2)
    return info


def text(info: dict) -> str:
    t, tl = info.get("torch", {}), info["tools"]
    pk = info["packages"]
    lines = [
        f"python       {info['python_version']} ({tl['python']}), Python.h "
        f"{'yes' if tl['python_h'] else 'NO'}",
        f"torch        {pk['torch']} (torch.version.cuda {t.get('cuda')}, cuda available "
        f"{t.get('cuda_available')}, {t.get('device', '-')} sm {t.get('capability', '-')})",
        f"triton       {pk['triton']}",
        f"transformers {pk['transformers']}",
        f"setuptools   {pk['setuptools']}, wheel {pk['wheel']}, pip {pk['pip']}",
        f"pybind11     module {pk['pybind11']}; headers: {tl['pybind11_source']} "
        f"({tl['pybind11_header_version']})",
        f"cmake        {info['cmake_version'] or 'missing'} (module: {pk['cmake']})",
        f"ninja        {info['ninja_version'] or 'missing'} (module: {pk['ninja']})",
        f"make         {tl['make'] or 'missing'}; c++ {tl['cxx'] or 'MISSING'}; cc (Triton's "
        f"launcher) {tl['cc'] or 'MISSING'}",
        f"nvcc         {tl['nvcc'] or 'missing'} {info['nvcc_version'] or ''}",
        f"cuda headers {', '.join(tl['cuda_include']) or 'missing'}",
        f"cudart       static {tl['cudart']['static']}, shared {tl['cudart']['shared']}",
        f"nvidia-smi   {info['nvidia_smi']}",
        f"machine      {info['cpus']} cpus, {(info['mem_total_kb'] or 0) / 2**20:.0f} GiB, "
        f"{info['disk_free_gb']} GB free disk",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch import")
    args = ap.parse_args(argv)
    info = probe(with_torch=not args.no_torch)
    print(text(info))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
