"""Test setup: without a GPU, the Triton interpreter must be on before any @triton.jit
runs (psr_kernels is imported after this file); with one, the kernels run compiled."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
