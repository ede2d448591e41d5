"""torch.library ops (device dispatch, fakes, torch.compile) and the vLLM routing hook."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import psr_kernels as pk


def _inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, generator=gen)
    mask = torch.rand(16, generator=gen) < 0.5
    hidden = torch.randn(3, 24, generator=gen)
    gate = torch.randn(16, 24, generator=gen)
    norm_w = torch.rand(24, generator=gen) + 0.5
    return logits, mask, hidden, gate, norm_w


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_ops_dispatch_to_kernel_or_reference_with_equal_results(monkeypatch, interpret) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    logits, mask, hidden, gate, norm_w = _inputs()
    w, ids = torch.ops.psr.route(logits, 4, mask, 0.3, "softmax", True)
    w2, ids2 = pk.route_ref(logits, 4, mask=mask, lam=0.3, renormalize=True)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2)
    ids, inc = torch.ops.psr.predict_next(hidden, norm_w, gate, 2, mask)
    ids_ref, inc_ref = pk.predict_next_ref(hidden, norm_w, gate, 2, mask=mask)
    assert torch.equal(ids, ids_ref) and torch.equal(inc, inc_ref)
    _, ids, logits2 = torch.ops.psr.route_hidden(hidden, gate, 4)
    torch.testing.assert_close(logits2, hidden @ gate.t())


def test_fake_implementations_pass_opcheck() -> None:
    logits, mask, hidden, gate, norm_w = _inputs()
    slab = torch.randn(4, 3 * 24 * 8)
    slots = torch.tensor([[0, 2]] * 3)
    w = torch.rand(3, 2)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.psr.route.default, (logits, 4, mask, 0.3), test_utils=tests)
    torch.library.opcheck(torch.ops.psr.route_hidden.default, (hidden, gate, 4), test_utils=tests)
    torch.library.opcheck(
        torch.ops.psr.predict_next.default, (hidden, norm_w, gate, 2, mask), test_utils=tests
    )
    torch.library.opcheck(
        torch.ops.psr.expert_ffn.default, (hidden, slab, slots, w, 24, 8), test_utils=tests
    )


def test_ops_compose_with_torch_compile() -> None:
    _, mask, hidden, gate, _ = _inputs()
    slab = torch.randn(4, 3 * 24 * 8)

    def moe_step(h: torch.Tensor) -> torch.Tensor:
        w, ids, _ = torch.ops.psr.route_hidden(h, gate, 2, mask, 0.5)
        slots = ids % 4  # stand-in for the expert -> slot map
        return torch.ops.psr.expert_ffn(h[:, :24], slab, slots, w, 24, 8) * 2

    compiled = torch.compile(moe_step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(hidden), moe_step(hidden))


def test_vllm_custom_routing_function() -> None:
    logits, mask, hidden, _, _ = _inputs()
    state = {"mask": None}
    fn = pk.make_vllm_routing_function(lambda: state["mask"], lam=0.5)
    w, ids = fn(hidden, logits, 4, True)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == (3, 4)
    assert torch.equal(ids.long(), pk.route_ref(logits, 4)[1])
    torch.testing.assert_close(w.sum(-1), torch.ones(3))
    state["mask"] = mask  # the hook reads the cache at call time
    _, ids_b = fn(hidden, logits, 4, True)
    assert torch.equal(ids_b.long(), pk.route_ref(logits, 4, mask=mask, lam=0.5)[1])


def test_psr_kernels_imports_without_psr() -> None:
    code = (
        "import sys, psr_kernels, torch\n"
        "assert 'psr' not in sys.modules, sorted(m for m in sys.modules if m.startswith('psr'))\n"
        "print(psr_kernels.route_ref(torch.randn(1, 8), 2)[1].shape)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch.Size([1, 2])" in out.stdout
