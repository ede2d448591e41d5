"""Fixtures the server tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One PSR_HOME per test module for its server and its reference model: the same
    operating points on both sides."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSR_HOME", str(tmp_path_factory.mktemp("serve_home")))
        yield
