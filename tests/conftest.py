"""Test setup: without a GPU, the Triton interpreter must be on before any @triton.jit
runs (psr_kernels is imported after this file); with one, the kernels run compiled."""

import os
import random
import zlib

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import numpy as np
import pytest

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files holding a slow test first (a stable sort: each file stays whole and in order):
    # xdist's loadfile hands out files in this order, so the long ones start at once
    # instead of running alone at the end (tests/store's ASan build was collected last).
    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _seed(name: str) -> None:
    seed = zlib.crc32(name.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.fixture(autouse=True, scope="module")
def _seeded_module(request: pytest.FixtureRequest) -> None:
    """A module's fixtures draw unseeded inputs from a seed of the module's path."""
    _seed(str(request.path.relative_to(request.config.rootpath)))


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Each test draws its unseeded inputs (torch's, random's and numpy's global
    generators) from a seed of its own id: the same inputs whichever tests its worker ran
    before (under --dist loadfile the generators' state depended on that, and a tight
    tolerance could fail now and then)."""
    _seed(request.node.nodeid)


@pytest.fixture(autouse=True)
def _psr_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuned operating points go to a per-test folder, never the user's."""
    monkeypatch.setenv("PSR_HOME", str(tmp_path_factory.mktemp("psr_home")))


@pytest.fixture
def f32_dots() -> Iterator[None]:
    """The fp32-activation dot path for GGUF blocks (cpu_dot 'f32') as the process default
    while a test runs: the tests that hold that path to its tight dequantized references
    (the q8 path, whose activations are rounded to 8 bits, has its own: test_cpu_qdot.py)."""
    from psr import store  # here: psr_kernels must see TRITON_INTERPRET first

    before = store.cpu_dot()
    store.set_cpu_dot("f32")
    yield
    store.set_cpu_dot(before)
