"""The server's max_model_len is psr.load's context= (issue 42) when given, else the
checkpoint's max_position_embeddings."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

import psr
from psr.serve.worker import Engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("ctx") / "olmoe")
    write_tokenizer(path)
    return path


async def _context(loader) -> int | None:
    engine = Engine(loader)
    engine.start(asyncio.get_running_loop())
    try:
        assert await asyncio.to_thread(engine.ready.wait, 120), engine.load_error
        return engine.context
    finally:
        engine.stop(30)


@pytest.mark.parametrize(("context", "want"), [(48, 48), (None, 128)])
def test_max_model_len_is_the_load_context(ckpt, context, want) -> None:
    load = lambda: psr.load(ckpt, "exact", 0.5, context=context, progress=False)  # noqa: E731
    assert asyncio.run(_context(load)) == want
