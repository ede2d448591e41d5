"""transformers' RMS norms through psr's row kernel (runtime/norms.py, `cpu_rms_norm`): the
norm's value to rounding, each row's bits independent of the other rows and of strides,
the class's own forward for what the kernel does not take, bad input refused."""

from __future__ import annotations

import copy

import pytest
import torch
from gguf_files import gguf_tiny_model
from tiny_models import tiny_model, write_checkpoint
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

import psr
from psr.runtime.norms import has_row_kernel, is_rms_norm, row_norms
from psr.store import cpu_rms_norm


def _norm(cls: type, n: int, seed: int) -> torch.nn.Module:
    m = cls(n)
    m.weight.data = torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.5
    return m


@pytest.mark.parametrize("cls", [OlmoeRMSNorm, Qwen3MoeRMSNorm, GptOssRMSNorm])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 2048])
def test_kernel_is_the_norm_and_each_row_its_own(cls: type, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    m = _norm(cls, n, n)
    x = torch.randn(9, 2, n, generator=g) * 3
    want = cls.forward(m, x)  # the class's torch forward
    got = cpu_rms_norm(x, m.weight, m.variance_epsilon)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    flat = x.reshape(18, n)
    whole = cpu_rms_norm(flat, m.weight, m.variance_epsilon)
    for i in (0, 5, 17):
        one = cpu_rms_norm(flat[i : i + 1].clone(), m.weight, m.variance_epsilon)
        assert torch.equal(one, whole[i : i + 1])
    wide = torch.randn(18, n + 5, generator=g)  # rows inside a wider tensor (DeepSeek's split)
    wide[:, :n] = flat
    assert torch.equal(cpu_rms_norm(wide[:, :n], m.weight, m.variance_epsilon), whole)


def test_row_norms_installs_on_audited_norms_only_and_falls_back() -> None:
    model = gguf_tiny_model("olmoe", layers=2)
    norms = [m for m in model.modules() if is_rms_norm(m)]
    assert len(norms) == 2 * 4 + 1  # input, post-attention, q and k norms; the final norm
    gemma = _norm(GemmaRMSNorm, 8, 0)
    assert not is_rms_norm(gemma) and not is_rms_norm(torch.nn.LayerNorm(8))
    x = torch.randn(3, 1, 256)
    norm = norms[0]
    before = norm(x)
    assert row_norms(model) == len(norms) and row_norms(model) == 0  # idempotent
    assert isinstance(norm, OlmoeRMSNorm) and has_row_kernel(norm) and is_rms_norm(norm)
    assert copy.deepcopy(norm)(x).equal(norm(x))  # a class, no bound method: copies work
    with torch.no_grad():
        assert torch.equal(norm(x), cpu_rms_norm(x, norm.weight, norm.variance_epsilon))
        torch.testing.assert_close(norm(x), before, rtol=2e-6, atol=1e-6)
        xb = x.to(torch.bfloat16)  # not the kernel's: the class's own forward, bit for bit
        assert torch.equal(norm(xb), OlmoeRMSNorm.forward(norm, xb))
    y = norm(x.requires_grad_())  # autograd: the class's forward
    assert y.grad_fn is not None
    assert row_norms(model, False) == len(norms)
    assert not has_row_kernel(norm) and type(norm) is OlmoeRMSNorm


def test_loaded_cpu_models_norm_by_the_kernel(tmp_path) -> None:
    path = write_checkpoint(tiny_model("qwen3_moe"), tmp_path / "q")
    om = psr.load(path, "exact", residency=0.5, device="cpu", progress=False, dtype="float32")
    hooked = [m for m in om.hf.modules() if has_row_kernel(m) and is_rms_norm(m)]
    layers = om.config.num_hidden_layers
    assert len(hooked) == layers * 4 + 1
    hf = psr.restore(om)
    assert not any(has_row_kernel(m) for m in hf.modules() if is_rms_norm(m))


@pytest.mark.parametrize(
    ("x", "w", "match"),
    [
        (torch.randn(2, 4, dtype=torch.bfloat16), torch.ones(4), "x must be a float32 CPU tensor"),
        (torch.randn(2, 4), torch.ones(5), r"weight must be a float32 CPU tensor \[4\]"),
        (torch.randn(2, 4), torch.ones(4, dtype=torch.float64), r"weight must be a float32"),
        (torch.randn(2, 0), torch.ones(0), "last dimension of at least 1"),
    ],
)
def test_bad_input(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cpu_rms_norm(x, w, 1e-6)
