"""CPU decoding runs the C++ expert kernels (psr.store.cpu_expert_ffn) at the one dispatch
point, ExpertCompute.slab; PSR_CPU_EXPERTS=torch forces the torch reference. Both decode
reproducibly, and their logits agree to fp32 rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.runtime import compute, store_ops

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("qwen3_moe"), tmp_path_factory.mktemp("cpuk") / "q3")


def _run(path: Path, **kw) -> tuple[list[int], torch.Tensor]:
    model = psr.load(path, "psr", 0.5, lam=0.5, n=1, progress=False, device="cpu", **kw)
    tokens = model.generate(PROMPT, max_new_tokens=NEW)
    logits = model.decode_logits(tokens, PROMPT.shape[1])
    model.close()
    return tokens[0].tolist(), logits


def _counting(monkeypatch) -> list[int]:
    calls = [0]
    real = compute.cpu_expert_ffn

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(compute, "cpu_expert_ffn", counted)
    monkeypatch.setattr(store_ops, "cpu_expert_ffn", counted)  # the slab's (eager and op)
    return calls


@pytest.mark.parametrize("fmt", [None, "int8", "int4"])
def test_kernels_serve_cpu_decode_and_match_the_reference(ckpt, monkeypatch, fmt) -> None:
    calls = _counting(monkeypatch)
    monkeypatch.delenv("PSR_CPU_EXPERTS", raising=False)
    tok_k, log_k = _run(ckpt, expert_format=fmt)
    assert calls[0] > 0
    again = _run(ckpt, expert_format=fmt)  # reproducible: the same tokens and logits
    assert again[0] == tok_k and torch.equal(again[1], log_k)
    n = calls[0]
    monkeypatch.setenv("PSR_CPU_EXPERTS", "torch")
    _run(ckpt, expert_format=fmt)
    assert calls[0] == n  # the reference path never called the kernels
    # Teacher-forced on the kernels' tokens, the reference's logits agree to rounding.
    model = psr.load(ckpt, "psr", 0.5, lam=0.5, n=1, progress=False, device="cpu",
                     expert_format=fmt)  # fmt: skip
    ref = model.decode_logits(torch.tensor([tok_k]), PROMPT.shape[1])
    model.close()
    torch.testing.assert_close(ref, log_k, rtol=1e-4, atol=1e-4)


def test_bad_env_value_is_a_clear_error(ckpt, monkeypatch) -> None:
    monkeypatch.setenv("PSR_CPU_EXPERTS", "gpu")
    with pytest.raises(ValueError, match="PSR_CPU_EXPERTS='gpu'"):
        psr.load(ckpt, "psr", 0.5, progress=False, device="cpu")
