"""Fixtures of the CPU kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from psr import store


@pytest.fixture
def f32_dots() -> Iterator[None]:
    """The fp32-activation dot path for GGUF blocks (cpu_dot 'f32') as the process default
    while a test runs: the tests that hold that path to its tight dequantized references
    (the q8 path, whose activations are rounded to 8 bits, has its own: test_cpu_qdot.py)."""
    before = store.cpu_dot()
    store.set_cpu_dot("f32")
    yield
    store.set_cpu_dot(before)
