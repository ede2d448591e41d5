"""Issue 39's bad input at load: a dense block type psr's kernels lack, and a dense_format
asked of a file whose dense weights are stored quantized already, are refused in one line
naming the tensor or the option before any weight is copied (the copy functions patched
to fail); the KV format's refusal is tests/runtime/test_kv_quant.py's, the plan's
shortfall tests/models/test_memory_plan.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import gguf_tiny_model, write_gguf

import psr
import psr.models.dense_weights as dense_weights
import psr.models.loader as loader


@pytest.fixture(scope="module")
def tq_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Dense matrices in TQ2_0 (a type no psr kernel computes), experts in Q8_0."""
    path = tmp_path_factory.mktemp("refuse") / "tq.gguf"
    model = gguf_tiny_model("qwen3_moe", head_dim=64, vocab=256)
    write_gguf(model, path, {"experts": "Q8_0", "dense": "TQ2_0"})
    return path


@pytest.fixture
def no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    def copied(*a: Any, **k: Any) -> None:
        raise AssertionError("a weight was copied before the refusal")

    monkeypatch.setattr(loader, "set_tensor", copied)
    monkeypatch.setattr(loader, "make_store", copied)
    monkeypatch.setattr(dense_weights, "_module", copied)


def _refused(path: Path, match: str, **options: Any) -> str:
    with pytest.raises(ValueError, match=match) as e:
        psr.load(path, device="cpu", progress=False, **options)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def test_a_dense_block_type_the_kernels_lack_before_any_copy(tq_gguf: Path, no_copy) -> None:
    msg = _refused(tq_gguf, r"is TQ2_0, a block type psr's dense kernels lack")
    assert "'token_embd.weight'" in msg and "dense_format='float'" in msg


@pytest.mark.parametrize("word", ["int8", "fp8"])
def test_a_dense_format_on_quantized_dense_weights_before_any_copy(
    tq_gguf: Path, no_copy, word: str
) -> None:
    _refused(tq_gguf, r"dense weights are stored quantized already", dense_format=word)
