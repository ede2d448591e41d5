"""Test setup: without a GPU, the Triton interpreter must be on before any @triton.jit
runs (psr_kernels is imported after this file); with one, the kernels run compiled."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

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
