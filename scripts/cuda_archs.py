"""TORCH_CUDA_ARCH_LIST, parsed once for every build of psr._C: setup.py (CMake's
CMAKE_CUDA_ARCHITECTURES) and bench/gpu_build.py (nvcc's -gencode flags).

Standard library only, and loaded by file path: setup.py runs before psr (or torch) is
installed, and gpu_build.py runs where setuptools may be missing, so neither can import
the other or psr. A list is entries separated by ';', ',' or spaces, each a compute
capability ("8.0", "9.0a", or "90"), "+PTX" adding that architecture's PTX.
"""

from __future__ import annotations

import re

# Major and minor digits (the dot is optional), then an optional feature suffix (9.0a).
_ENTRY = re.compile(r"[0-9]+(?:\.[0-9]+)?[a-z]?")


def parse_arch_list(spec: str) -> list[tuple[str, bool]]:
    """`(arch, ptx)` per entry: '8.0;9.0+PTX' -> [('80', False), ('90', True)].

    Raises ValueError naming the first entry that is no compute capability, or a list
    that names none.
    """
    out = []
    for tok in spec.replace(",", ";").replace(" ", ";").split(";"):
        tok = tok.strip()
        if not tok:
            continue
        ptx = tok.endswith("+PTX")
        num = tok.removesuffix("+PTX")
        if not _ENTRY.fullmatch(num):
            raise ValueError(
                f"cannot parse TORCH_CUDA_ARCH_LIST entry {tok!r}: expected a compute "
                "capability such as 8.0, 9.0a or 9.0+PTX"
            )
        out.append((num.replace(".", ""), ptx))
    if not out:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST={spec!r} names no architecture")
    return out


def cmake_archs(spec: str) -> str:
    """CMAKE_CUDA_ARCHITECTURES: '8.0;9.0+PTX' -> '80-real;90' (cubin only, or cubin + PTX)."""
    return ";".join(num if ptx else f"{num}-real" for num, ptx in parse_arch_list(spec))


def nvcc_gencode(spec: str) -> tuple[list[str], str]:
    """nvcc -gencode flags and the PSR_CUDA_ARCHS string (CMake's names, comma-separated):
    '9.0' -> sm_90 cubin, '90-real'; '9.0+PTX' adds compute_90 PTX, '90'."""
    flags: list[str] = []
    names: list[str] = []
    for num, ptx in parse_arch_list(spec):
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
        if ptx:
            flags += ["-gencode", f"arch=compute_{num},code=compute_{num}"]
        names.append(num if ptx else f"{num}-real")
    return flags, ",".join(names)
