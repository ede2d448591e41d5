"""psr_kernels.resolve_compute / kernel_ops: the one compute dispatcher."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import psr_kernels as pk


@pytest.fixture(autouse=True)
def _no_env_default(monkeypatch):
    monkeypatch.delenv("PSR_COMPUTE", raising=False)


@pytest.mark.parametrize(
    ("compute", "device", "interpret", "path"),
    [
        ("auto", "cpu", "0", "torch"),
        ("auto", "cpu", "1", "torch"),  # the interpreter does not make "auto" pick Triton
        ("auto", "cuda", "0", "triton"),
        ("auto", "cuda:1", "0", "triton"),
        (None, "cpu", "0", "torch"),
        (None, "cuda", "0", "triton"),
        ("auto", "meta", "0", "torch"),
        ("torch", "cuda", "0", "torch"),
        ("torch", "cpu", "1", "torch"),
        ("triton", "cuda", "0", "triton"),
        ("triton", "cpu", "1", "triton"),
        ("triton", torch.device("cpu"), "1", "triton"),
    ],
)
def test_resolve_compute(monkeypatch, compute, device, interpret, path) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert pk.resolve_compute(compute, device) == path
    ops = pk.kernel_ops(compute, device)
    assert ops.path == path


def test_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for device in ("cpu", "meta"):
        with pytest.raises(RuntimeError, match=r"compute='triton' needs a CUDA device, got "):
            pk.resolve_compute("triton", device)
    with pytest.raises(RuntimeError, match=r"set TRITON_INTERPRET=1 before importing psr_kernels"):
        pk.kernel_ops("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="needs a CUDA device, got meta"):
        pk.resolve_compute("triton", "meta")  # the interpreter runs CPU tensors only


@pytest.mark.parametrize("bad", ["cuda", "Triton", "", "reference", 1, ["torch"], True])
def test_unknown_compute_lists_the_accepted_values(bad) -> None:
    with pytest.raises(ValueError, match=r"compute must be one of 'auto', 'triton', 'torch', got"):
        pk.resolve_compute(bad, "cpu")
    with pytest.raises(ValueError, match="compute must be one of"):
        pk.kernel_ops(bad, "cpu")


def test_env_default_is_read_at_call_time(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pk.default_compute() == "auto"
    monkeypatch.setenv("PSR_COMPUTE", "torch")
    assert pk.default_compute() == "torch"
    # The default steers "auto" (and None) on any device ...
    assert pk.resolve_compute("auto", "cuda") == "torch"
    assert pk.resolve_compute(None, "cuda") == "torch"
    # ... but an explicit choice wins.
    assert pk.resolve_compute("triton", "cuda") == "triton"
    monkeypatch.setenv("PSR_COMPUTE", " Triton ")  # case and spaces are forgiven
    assert pk.resolve_compute("auto", "cuda") == "triton"
    assert pk.resolve_compute("torch", "cpu") == "torch"
    with pytest.raises(RuntimeError, match=r"compute='triton' \(from PSR_COMPUTE\) needs a CUDA"):
        pk.resolve_compute("auto", "cpu")
    monkeypatch.setenv("PSR_COMPUTE", "auto")
    assert pk.resolve_compute("auto", "cpu") == "torch"
    monkeypatch.setenv("PSR_COMPUTE", "cuda")
    with pytest.raises(ValueError, match=r"PSR_COMPUTE='cuda': expected one of 'auto', 'triton'"):
        pk.resolve_compute("auto", "cpu")
    assert pk.resolve_compute("torch", "cpu") == "torch"  # an explicit choice needs no default


def test_kernel_ops_are_the_kernels_or_the_references(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tri, ref = pk.kernel_ops("triton", "cpu"), pk.kernel_ops("torch", "cpu")
    assert isinstance(tri, pk.KernelOps) and isinstance(ref, pk.KernelOps)
    names = ("route", "route_hidden", "predict_next", "expert_ffn", "decode_step", "route_counted")
    # One entry per operation: expert_ffn serves float and quantized rows (its fmt).
    assert [f.name for f in dataclasses.fields(pk.KernelOps)] == ["path", *names]
    assert [getattr(tri, n) for n in names] == [getattr(pk, n) for n in names]
    assert [getattr(ref, n) for n in names] == [getattr(pk, n + "_ref") for n in names]
    assert (tri.path, ref.path) == ("triton", "torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        tri.route = pk.route_ref  # type: ignore[misc]
    # Both paths route alike (the kernel tests check each op in depth).
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    mask = torch.arange(16) % 3 == 0
    spec = pk.RouteSpec(4, lam=0.3)
    w1, ids1 = tri.route(logits, spec, mask=mask)
    w2, ids2 = ref.route(logits, spec, mask=mask)
    assert torch.equal(ids1, ids2)
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-6)
