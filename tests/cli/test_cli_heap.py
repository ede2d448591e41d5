"""The `psr` command freezes its process's heap after loading (a full garbage collection of
torch's, transformers' and the model's objects stalled a decode); main() called in-process
leaves its caller's collector alone."""

from __future__ import annotations

import gc
import sys

import pytest
from tiny_models import tiny_model, write_checkpoint

import psr.cli.generate as cli_generate
from psr.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("heap_cli") / "olmoe")


def _generate(ckpt, monkeypatch, own_process: bool) -> int:
    """gc.get_freeze_count() right after `psr generate` loaded its model."""
    seen: list[int] = []
    load = cli_generate.load_model

    def spy(*a, **k):
        model = load(*a, **k)
        seen.append(gc.get_freeze_count())
        return model

    monkeypatch.setattr(cli_generate, "load_model", spy)
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "5,17,33", "--quiet"]
    argv += ["--max-new-tokens", "2"]
    try:
        if own_process:
            monkeypatch.setattr(sys, "argv", ["psr", *argv])
            assert main() == 0
        else:
            assert main(argv) == 0
    finally:
        gc.unfreeze()
    assert len(seen) == 1
    return seen[0]


def test_the_command_freezes_its_heap_and_in_process_calls_do_not(ckpt, monkeypatch) -> None:
    gc.unfreeze()
    assert _generate(ckpt, monkeypatch, own_process=False) == 0
    assert _generate(ckpt, monkeypatch, own_process=True) > 1000
