"""torch.library ops (dispatch, fakes, torch.compile) and the vLLM routing hook."""

from __future__ import annotations

import dataclasses
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


@pytest.fixture
def torch_path(monkeypatch):
    """The CPU path without the interpreter: what a CPU-only process runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PSR_COMPUTE", "torch")


@pytest.mark.parametrize(
    ("interpret", "compute", "path"),
    [
        ("1", "triton", "triton"),
        ("1", "auto", "torch"),
        ("1", "torch", "torch"),
        ("0", "", "torch"),
    ],
)
def test_ops_dispatch_with_equal_results(monkeypatch, interpret, compute, path) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setenv("PSR_COMPUTE", compute)
    assert pk.kernel_ops("auto", "cpu").path == path
    logits, mask, hidden, gate, norm_w = _inputs()
    w, ids = torch.ops.psr.route(logits, 4, mask, 0.3, "softmax", True)
    w2, ids2 = pk.route_ref(logits, pk.RouteSpec(4, lam=0.3, renormalize=True), mask=mask)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2)
    ids, inc = torch.ops.psr.predict_next(hidden, norm_w, gate, 2, mask)
    ids_ref, inc_ref = pk.predict_next_ref(hidden, norm_w, gate, 2, pk.RouteSpec(2), mask=mask)
    assert torch.equal(ids, ids_ref) and torch.equal(inc, inc_ref)
    _, ids, logits2 = torch.ops.psr.route_hidden(hidden, gate, 4)
    torch.testing.assert_close(logits2, hidden @ gate.t())
    assert torch.equal(ids, pk.route_ref(hidden @ gate.t(), pk.RouteSpec(4))[1])


def test_route_op_schemas_list_the_arguments_of_route_args() -> None:
    """The routing ops' schemas and `_route_args` (which builds their RouteSpec) are
    one list of arguments, in one order, with the same defaults, covering RouteSpec."""
    import inspect

    from psr_kernels.ops import _route_args

    params = inspect.signature(_route_args).parameters.values()
    want = [(p.name, None if p.default is p.empty else p.default) for p in params]
    fields = {f.name for f in dataclasses.fields(pk.RouteSpec)}
    assert {name for name, _ in want} == fields | {"mask", "bias"}
    for op, lead in ((torch.ops.psr.route, 1), (torch.ops.psr.route_hidden, 2)):
        args = op.default._schema.arguments[lead:]
        assert [(a.name, a.default_value) for a in args] == want, op
    spec, mask, bias = _route_args(3, None, 0.5, "sigmoid", True, None, 4, 2, 2.5)
    assert spec == pk.RouteSpec(3, 0.5, "sigmoid", True, 4, 2, 2.5) and mask is bias is None


def test_ops_refuse_triton_on_cpu_without_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PSR_COMPUTE", "triton")
    with pytest.raises(RuntimeError, match=r"compute='triton' \(from PSR_COMPUTE\) needs a CUDA"):
        torch.ops.psr.route(torch.randn(2, 8), 2)


def _op_cases():
    """(op, args, kwargs) covering every op and its optional inputs."""
    logits, mask, hidden, gate, norm_w = _inputs()
    gen = torch.Generator().manual_seed(1)
    tok_mask = torch.rand(3, 16, generator=gen) < 0.5
    bias = torch.randn(16, generator=gen) * 0.05
    slab = torch.randn(4, 3 * 24 * 8, generator=gen)
    slots = torch.tensor([[0, 2], [3, 1], [2, 2]])
    w = torch.rand(3, 2, generator=gen)
    grouped = dict(scoring="sigmoid", bias=bias, n_group=4, topk_group=2)
    ops = torch.ops.psr
    return [
        (ops.route.default, (logits, 4, mask, 0.3), {}),
        (ops.route.default, (logits.t().contiguous().t(), 4), {"scoring": "topk_softmax"}),
        (ops.route.default, (logits.bfloat16(), 3, tok_mask, 0.5), {"renormalize": True}),
        (ops.route.default, (logits, 4, mask, 0.3), {**grouped, "scaling": 2.5}),
        (ops.route_hidden.default, (hidden, gate, 4), {}),
        (ops.route_hidden.default, (hidden, gate, 3, tok_mask, 0.4), grouped),
        (ops.predict_next.default, (hidden, norm_w, gate, 2, mask), {}),
        (ops.predict_next.default, (hidden, norm_w, gate, 3), grouped),
        (ops.predict_next.default, (hidden, norm_w, gate, 0, mask), {}),
        (ops.expert_ffn.default, (hidden, slab, slots, w, 24, 8), {}),
        (ops.expert_ffn.default, (hidden.half(), slab.half(), slots.int(), w, 24, 8), {}),
        (ops.expert_ffn.default, (hidden, slab, slots, w, 24, 8), {"out_dtype": torch.bfloat16}),
    ]


@pytest.mark.usefixtures("torch_path")
def test_every_op_passes_opcheck_on_the_cpu_path() -> None:
    """Fakes match the real outputs in shape, dtype and strides (test_faketensor), and
    the ops trace under AOT dispatch; all of opcheck's default checks."""
    for op, args, kwargs in _op_cases():
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.usefixtures("torch_path")
def test_fakes_declare_the_real_outputs() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    for op, args, kwargs in _op_cases():
        real = op(*args, **kwargs)
        real = real if isinstance(real, tuple) else (real,)
        mode = FakeTensorMode()
        fargs, fkwargs = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        with mode:
            fake = op(*fargs, **fkwargs)
        fake = fake if isinstance(fake, tuple) else (fake,)
        for r, f in zip(real, fake, strict=True):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), op
            assert r.is_contiguous()


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_ops_compose_with_torch_compile_inductor() -> None:
    """Inductor (CPU, C++ codegen) around all four ops matches eager."""
    import torch._inductor.config as inductor_config

    logits, mask, hidden, gate, norm_w = _inputs()
    slab = torch.randn(4, 3 * 24 * 8, generator=torch.Generator().manual_seed(2))

    def moe_step(h: torch.Tensor, lg: torch.Tensor):
        w, ids = torch.ops.psr.route(lg, 2, mask, 0.5, "softmax", True)
        w2, ids2, lg2 = torch.ops.psr.route_hidden(h, gate, 2, mask, 0.5)
        pred, inc = torch.ops.psr.predict_next(h, norm_w, gate, 2, mask)
        y = torch.ops.psr.expert_ffn(h, slab, ids2 % 4, w, 24, 8)  # ids % 4: the slot map
        return y * 2, ids + pred, w2.sum(-1), lg2.relu(), inc

    torch._dynamo.reset()
    try:
        with inductor_config.patch(compile_threads=1):
            compiled = torch.compile(moe_step, backend="inductor", fullgraph=True)
            got = compiled(hidden, logits)
    finally:
        torch._dynamo.reset()
    want = moe_step(hidden, logits)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


# --- the vLLM hook, without vLLM ---------------------------------------------------


@pytest.mark.parametrize("compute", ["torch", "triton"])
def test_vllm_custom_routing_function_contract(monkeypatch, compute) -> None:
    """vLLM's FusedMoE calls `custom_routing_function(hidden_states=, gating_output=,
    topk=, renormalize=)` and wants contiguous (float32 [T, k], int32 [T, k])."""
    monkeypatch.setenv("PSR_COMPUTE", compute)
    logits, mask, hidden, _, _ = _inputs()
    state = {"mask": None}
    fn = pk.make_vllm_routing_function(lambda: state["mask"], lam=0.5)
    for dtype in (torch.float32, torch.bfloat16):
        gating = logits.to(dtype)
        w, ids = fn(hidden_states=hidden, gating_output=gating, topk=4, renormalize=True)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32
        assert w.shape == ids.shape == (3, 4)
        assert w.is_contiguous() and ids.is_contiguous()
        assert torch.equal(ids.long(), pk.route_ref(gating, pk.RouteSpec(4))[1])
        torch.testing.assert_close(w.sum(-1), torch.ones(3))
    # renormalize=False: plain softmax probabilities of the chosen experts.
    w, ids = fn(hidden_states=hidden, gating_output=logits, topk=4, renormalize=False)
    torch.testing.assert_close(w, torch.softmax(logits, -1).gather(1, ids.long()))
    # The mask is read at call time (the layer's cache as it is now).
    state["mask"] = mask
    w_b, ids_b = fn(hidden_states=hidden, gating_output=logits, topk=4, renormalize=True)
    w_ref, ids_ref = pk.route_ref(logits, pk.RouteSpec(4, lam=0.5, renormalize=True), mask=mask)
    assert torch.equal(ids_b.long(), ids_ref)
    torch.testing.assert_close(w_b, w_ref)
    # A fixed mask works too; lam 0 is vLLM's own softmax top-k.
    exact = pk.make_vllm_routing_function(mask)
    _, ids_e = exact(hidden_states=hidden, gating_output=logits, topk=2, renormalize=False)
    assert torch.equal(ids_e.long(), logits.topk(2).indices)


def test_vllm_hook_refuses_grouped_and_sigmoid_routing() -> None:
    with pytest.raises(ValueError, match="grouped top-k"):
        pk.make_vllm_routing_function(n_group=8, topk_group=4)
    with pytest.raises(ValueError, match="softmax routers only"):
        pk.make_vllm_routing_function(scoring="sigmoid")
    with pytest.raises(ValueError, match="unknown"):
        pk.make_vllm_routing_function(scoring="softplus")


def test_psr_kernels_imports_without_psr() -> None:
    code = (
        "import sys, psr_kernels, torch\n"
        "assert 'psr' not in sys.modules, sorted(m for m in sys.modules if m.startswith('psr'))\n"
        "print(psr_kernels.route_ref(torch.randn(1, 8), psr_kernels.RouteSpec(2))[1].shape)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch.Size([1, 2])" in out.stdout


def test_vllm_hook_per_router_kind() -> None:
    """For every family's router, the hook either reproduces it on vLLM's gating output
    (the router logits, gpt-oss's bias included) or refuses to be built. ERNIE's
    softmax + correction bias is the one kind the hook cannot express (vLLM passes no
    bias to a custom routing function): psr documents it as unsupported there."""
    from tiny_models import FAMILIES, NEW_FAMILIES, tiny_config

    from psr.models.families import FAMILIES as TABLE
    from psr.models.families import moe_spec

    built = set()
    for family in FAMILIES + NEW_FAMILIES:
        spec = moe_spec(tiny_config(family))
        kind = TABLE[family].router_kind
        kw = dict(scoring=spec.scoring, scaling=spec.scaling)
        kw |= dict(n_group=spec.n_group, topk_group=spec.topk_group)
        if kind in ("softmax_topk", "topk_softmax"):
            fn = pk.make_vllm_routing_function(lam=0.0, **kw)
            logits = torch.randn(5, spec.num_experts, generator=torch.Generator().manual_seed(7))
            w, ids = fn(
                hidden_states=None, gating_output=logits, topk=spec.top_k,
                renormalize=spec.renormalize,
            )  # fmt: skip
            w_ref, ids_ref = pk.route_ref(logits, spec.route_spec(0.0))
            assert torch.equal(ids.long(), ids_ref), family
            torch.testing.assert_close(w, w_ref)
            built.add(kind)
        elif kind == "softmax_bias":
            continue
        else:
            with pytest.raises(ValueError, match=r"vLLM|grouped|supported"):
                pk.make_vllm_routing_function(**kw)
    assert built == {"softmax_topk", "topk_softmax"}
