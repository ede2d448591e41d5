"""Packaging: pyproject's supported ranges against the pins and the GPU image, and setup.py's
PSR_CUDA switch and CUDA architecture list (no network, no build: setup.py is loaded without
running setup())."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]

# What the GPU machine's image has (docs/gpu.md's `versions` stage reads them there).
GPU_IMAGE = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}
GPU_IMAGE_PYTHON = "3.12"
# Upper bounds: the next releases known or expected to break psr.
UPPER_BOUNDED = {"torch", "triton", "transformers"}


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _ranges() -> dict[str, Requirement]:
    proj = _pyproject()["project"]
    deps = list(proj["dependencies"])
    for extra in proj.get("optional-dependencies", {}).values():
        deps += extra
    reqs = [Requirement(d) for d in deps]
    return {canonicalize_name(r.name): r for r in reqs}


def _dev_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[canonicalize_name(req.name)] = Version(exact[0])
    return pins


def test_every_runtime_dependency_has_a_lower_bound() -> None:
    for dep in _pyproject()["project"]["dependencies"]:
        req = Requirement(dep)
        ops = {s.operator for s in req.specifier}
        assert ">=" in ops, f"{dep}: no lower bound (scripts/compat_check.sh installs it)"
        if canonicalize_name(req.name) in UPPER_BOUNDED:
            assert "<" in ops, f"{dep}: no upper bound"


def test_dev_pins_lie_in_the_declared_ranges() -> None:
    ranges = _ranges()
    pins = _dev_pins()
    assert {"torch", "triton", "transformers"} <= pins.keys()
    for name, version in pins.items():
        if name in ranges:
            spec = ranges[name].specifier
            assert spec.contains(version, prereleases=True), (
                f"requirements-dev.txt pins {name}=={version}, outside pyproject's {spec}"
            )


def test_gpu_image_lies_in_the_declared_ranges() -> None:
    ranges = _ranges()
    for name, version in GPU_IMAGE.items():
        spec = ranges[name].specifier
        assert spec.contains(version), f"the GPU image's {name} {version} is outside {spec}"
    requires_python = SpecifierSet(_pyproject()["project"]["requires-python"])
    assert requires_python.contains(GPU_IMAGE_PYTHON)
    here = ".".join(map(str, sys.version_info[:3]))
    assert requires_python.contains(here)


def test_paired_pins_agree() -> None:
    """torch's CUDA wheels pin one triton minor each (2.9: 3.5 ... 2.14: 3.8): the triton range
    must admit the pairing of both ends of the torch range, or the resolver backtracks."""
    ranges = _ranges()
    torch_spec, triton_spec = ranges["torch"].specifier, ranges["triton"].specifier
    pairs = {"2.9.0": "3.5.0", "2.11.0": "3.6.0", "2.13.0": "3.7.1", "2.14.1": "3.8.0"}
    for torch_v, triton_v in pairs.items():
        if torch_spec.contains(torch_v):
            assert triton_spec.contains(triton_v), f"torch {torch_v} needs triton {triton_v}"


def test_readme_states_the_ranges() -> None:
    """The README's Build section quotes the ranges as pyproject declares them."""
    readme = (ROOT / "README.md").read_text()
    build = readme.split("## Build", 1)[1].split("\n## ", 1)[0]
    ranges = _ranges()
    for name in ("torch", "triton", "transformers"):
        spec = ranges[name].specifier
        stated = [SpecifierSet(s) for s in re.findall(rf"`{name}([<>=!~][^`]*)`", build)]
        assert spec in stated, f"README's Build section does not state `{name}{spec}`"


@pytest.fixture(scope="module")
def setup_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_psr_setup_py", ROOT / "setup.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # __name__ is not "__main__": setup() does not run
    return mod


@pytest.mark.parametrize(
    ("env", "mode"),
    [
        ({}, "auto"),
        ({"PSR_CUDA": "auto"}, "auto"),
        ({"PSR_CUDA": " AUTO "}, "auto"),
        ({"PSR_CUDA": ""}, "auto"),
        ({"PSR_CUDA": "0"}, "0"),
        ({"PSR_CUDA": "off"}, "0"),
        ({"PSR_CUDA": "1"}, "1"),
        ({"PSR_CUDA": "true"}, "1"),
        ({"PSR_SKIP_CUDA_BUILD": "1"}, "0"),
        ({"PSR_FORCE_CUDA": "1"}, "1"),
        ({"PSR_SKIP_CUDA_BUILD": "0"}, "auto"),  # an alias not set to a true value: ignored
        ({"PSR_FORCE_CUDA": ""}, "auto"),
        ({"PSR_CUDA": "0", "PSR_SKIP_CUDA_BUILD": "1"}, "0"),
        ({"PSR_CUDA": "1", "PSR_FORCE_CUDA": "yes"}, "1"),
        ({"PSR_CUDA": "auto", "PSR_FORCE_CUDA": "1"}, "1"),
    ],
)
def test_cuda_mode(setup_py: ModuleType, env: dict[str, str], mode: str) -> None:
    assert setup_py.cuda_mode(env)[0] == mode


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"PSR_CUDA": "maybe"}, r"PSR_CUDA='maybe': expected auto, 0 or 1"),
        (
            {"PSR_CUDA": "1", "PSR_SKIP_CUDA_BUILD": "1"},
            r"^PSR_CUDA=1 contradicts PSR_SKIP_CUDA_BUILD=1$",
        ),
        ({"PSR_CUDA": "0", "PSR_FORCE_CUDA": "1"}, r"^PSR_CUDA=0 contradicts PSR_FORCE_CUDA=1$"),
        (
            {"PSR_SKIP_CUDA_BUILD": "1", "PSR_FORCE_CUDA": "1"},
            r"^PSR_SKIP_CUDA_BUILD=1 \(alias of PSR_CUDA=0\) contradicts PSR_FORCE_CUDA=1$",
        ),
    ],
)
def test_cuda_mode_rejects(setup_py: ModuleType, env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        setup_py.cuda_mode(env)


def _plan(setup_py: ModuleType, env: dict[str, str], on_path: str | None, exes: set[str]):
    return setup_py.plan_cuda(env, which=lambda _: on_path, is_exe=lambda p: p in exes)


def test_plan_cuda(setup_py: ModuleType) -> None:
    sys_nvcc = setup_py.SYSTEM_NVCC
    # auto: PATH; CUDA_HOME before PATH; CUDACXX first.
    nvcc, line = _plan(setup_py, {}, "/opt/bin/nvcc", {"/opt/bin/nvcc"})
    assert nvcc == "/opt/bin/nvcc" and line.startswith("psr: building backends: cpu+cuda")
    assert "from PATH" in line
    env = {"CUDA_HOME": "/cuda"}
    assert _plan(setup_py, env, "/opt/bin/nvcc", {"/cuda/bin/nvcc", "/opt/bin/nvcc"})[0] == (
        "/cuda/bin/nvcc"
    )
    env = {"CUDACXX": "/x/nvcc", "CUDA_PATH": "/cuda"}
    assert _plan(setup_py, env, None, {"/x/nvcc", "/cuda/bin/nvcc"})[0] == "/x/nvcc"
    # A CUDA_HOME without nvcc falls through to PATH.
    assert _plan(setup_py, {"CUDA_HOME": "/no"}, "/p/nvcc", {"/p/nvcc"})[0] == "/p/nvcc"
    # auto ignores /usr/local/cuda that nothing points at, and says so; PSR_CUDA=1 uses it.
    nvcc, line = _plan(setup_py, {}, None, {sys_nvcc})
    assert nvcc is None and line.startswith("psr: building backends: cpu (")
    assert sys_nvcc in line and "PSR_CUDA=1" in line
    nvcc, line = _plan(setup_py, {"PSR_CUDA": "1"}, None, {sys_nvcc})
    assert nvcc == sys_nvcc and "cpu+cuda" in line
    assert _plan(setup_py, {"PSR_FORCE_CUDA": "1"}, None, {sys_nvcc})[0] == sys_nvcc
    # 0 and its alias: CPU only whatever exists.
    for env in ({"PSR_CUDA": "0"}, {"PSR_SKIP_CUDA_BUILD": "1"}):
        nvcc, line = _plan(setup_py, env, "/p/nvcc", {"/p/nvcc", sys_nvcc})
        assert nvcc is None and "cpu (CUDA off" in line
    assert "PSR_SKIP_CUDA_BUILD=1" in line
    # 1 without any nvcc fails; auto without one builds the CPU backend.
    with pytest.raises(ValueError, match="no nvcc"):
        _plan(setup_py, {"PSR_CUDA": "1"}, None, set())
    with pytest.raises(ValueError, match="no nvcc"):
        _plan(setup_py, {"PSR_FORCE_CUDA": "1"}, None, set())
    nvcc, line = _plan(setup_py, {}, None, set())
    assert nvcc is None and "no nvcc" in line and "\n" not in line


# The one TORCH_CUDA_ARCH_LIST parser, for setup.py and bench/gpu_build.py alike.
CUDA_ARCHS_FILE = ROOT / "scripts" / "cuda_archs.py"


@pytest.fixture(scope="module")
def cuda_archs_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_psr_cuda_archs", CUDA_ARCHS_FILE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("spec", "cmake", "gencode", "names"),
    [
        ("9.0", "90-real", ["arch=compute_90,code=sm_90"], "90-real"),
        (
            "8.0;9.0+PTX",
            "80-real;90",
            [
                "arch=compute_80,code=sm_80",
                "arch=compute_90,code=sm_90",
                "arch=compute_90,code=compute_90",
            ],
            "80-real,90",
        ),
        (
            " 8.6, 9.0a 10.0+PTX ",
            "86-real;90a-real;100",
            [
                "arch=compute_86,code=sm_86",
                "arch=compute_90a,code=sm_90a",
                "arch=compute_100,code=sm_100",
                "arch=compute_100,code=compute_100",
            ],
            "86-real,90a-real,100",
        ),
        (
            "80;;89",
            "80-real;89-real",
            ["arch=compute_80,code=sm_80", "arch=compute_89,code=sm_89"],
            "80-real,89-real",
        ),
    ],
)
def test_one_arch_parser_for_cmake_and_nvcc(
    cuda_archs_py: ModuleType, spec: str, cmake: str, gencode: list[str], names: str
) -> None:
    assert cuda_archs_py.cmake_archs(spec) == cmake
    flags, got_names = cuda_archs_py.nvcc_gencode(spec)
    assert flags[0::2] == ["-gencode"] * len(gencode) and flags[1::2] == gencode
    assert got_names == names == cmake.replace(";", ",")  # the module reports CMake's names


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("9.0;Hopper", "entry 'Hopper': expected a compute capability"),
        ("9.0+ptx", r"entry '9\.0\+ptx'"),
        ("sm_90", "entry 'sm_90'"),
        ("9.0.1", r"entry '9\.0\.1'"),
        ("+PTX", r"entry '\+PTX'"),
        (" ; , ", "names no architecture"),
    ],
)
def test_arch_parser_names_a_bad_entry(cuda_archs_py: ModuleType, spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cuda_archs_py.parse_arch_list(spec)


def test_setup_and_gpu_build_use_the_one_parser(setup_py: ModuleType) -> None:
    assert setup_py.cuda_archs({}) == setup_py.DEFAULT_CUDA_ARCHS == "80;89;90"
    assert setup_py.cuda_archs({"TORCH_CUDA_ARCH_LIST": " "}) == "80;89;90"
    assert setup_py.cuda_archs({"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}) == "80-real;90"
    with pytest.raises(ValueError, match="cannot parse TORCH_CUDA_ARCH_LIST entry 'x'"):
        setup_py.cuda_archs({"TORCH_CUDA_ARCH_LIST": "9.0;x"})
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_build
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert gpu_build.CUDA_ARCHS_PY == setup_py.CUDA_ARCHS_PY == CUDA_ARCHS_FILE
    with pytest.raises(ValueError, match="cannot parse TORCH_CUDA_ARCH_LIST entry 'x'"):
        gpu_build.cuda_gencode("9.0;x")  # validated now; it used to pass 'x' on to nvcc
