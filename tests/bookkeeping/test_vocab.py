"""psr.vocab is the one list of option words; psr_kernels' own copies must agree with it."""

from __future__ import annotations

import pytest

import psr_kernels as pk
from psr import vocab
from psr_kernels import dispatch


def test_kernel_vocabularies_equal_psrs() -> None:
    assert pk.QUANT_FORMATS == vocab.QUANT_FORMATS
    assert dispatch.COMPUTE_CHOICES == vocab.COMPUTE_CHOICES


def test_dtype_aliases_name_torch_dtypes() -> None:
    import torch

    for alias, name in vocab.DTYPE_ALIASES.items():
        assert isinstance(getattr(torch, name), torch.dtype), alias
    assert set(vocab.DTYPE_ALIASES.values()) == set(vocab.DTYPE_NAMES)


@pytest.mark.parametrize(
    ("given", "want"), [("bf16", "bfloat16"), ("torch.float16", "float16"), ("float", "float32")]
)
def test_canonical_dtype(given: str, want: str) -> None:
    assert vocab.canonical_dtype(given) == want


def test_bad_words_are_named() -> None:
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        vocab.canonical_dtype("float8")
    with pytest.raises(ValueError, match="expert_format must be one of native, bf16"):
        vocab.expert_format("int2")
    with pytest.raises(ValueError, match="compute must be one of auto, triton, torch"):
        vocab.compute_choice("cuda")
    assert vocab.expert_format("native") is None and vocab.expert_format("int4") == "int4"
