"""Dense weights kept in their stored format: `QuantLinear` / `QuantEmbedding` against the
references on both compute paths, and `psr.load(..., dense_format=)` of a GGUF file with
Q8_0 and Q4_K dense matrices: native (the file's blocks) against float (dequantized) and
the transformers twin, its memory smaller by what the header says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ggml_blocks import random_blocks
from gguf_files import gguf_tiny_model, twin_model, write_gguf

import psr
import psr_kernels as pk
from psr.load_config import LoadConfig
from psr.models.dense_bytes import dense_bytes, keeps_blocks
from psr.models.gguf import GGUFCheckpoint
from psr.runtime.dense import MlaKvB, QuantEmbedding, QuantLinear
from psr_kernels.linear import LinearFormat

PROMPT = torch.tensor([[1, 50, 7, 90, 33, 200, 12, 5]])
FORMATS = [(t, None) for t in pk.BLOCK_TYPES] + [("int8", None), ("fp8", 64), ("int4", 32)]


def _weight(word: str, group: int | None, n: int) -> tuple[LinearFormat, int, torch.Tensor, Any]:
    fmt = LinearFormat.parse(word, group)
    k = 256 if fmt.block is None or fmt.block.block_len > 32 else 64
    if fmt.block is not None:
        raw = random_blocks(word, n, k, np.random.default_rng(n))
        return fmt, k, torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8), None
    q, s = pk.quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), fmt)
    return fmt, k, q, s


@pytest.mark.parametrize(("word", "group"), FORMATS)
@pytest.mark.parametrize("compute", ["triton", "torch"])
def test_quant_linear_equals_the_reference(word: str, group, compute: str, f32_dots) -> None:
    fmt, k, q, s = _weight(word, group, 12)
    bias = torch.randn(12)
    lin = QuantLinear(q.reshape(12, -1), fmt, k, scales=s, bias=bias, compute=compute)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(7))
    want = pk.linear_ref(x.reshape(6, k), lin.qweight, fmt, k, s, bias).reshape(2, 3, 12)
    w = lin.dequantized()
    # fp32 sums in another order: a few ulps of the sum of |x| |w| per output (a fixed 1e-5
    # failed now and then on fp8's larger sums, with x drawn from the process's generator)
    bound = (x.abs() @ w.abs().T) * 1e-5 + 1e-6
    for ref in (want, x @ w.T + bias):
        err = (lin(x) - ref).abs()
        assert bool((err <= bound).all()), float((err / bound).max())
    if word in ("Q4_K", "int8"):  # the embedding: only the looked-up rows, in its dtype
        emb = QuantEmbedding(lin.qweight, fmt, k, torch.bfloat16, scales=s)
        ids = torch.tensor([[3, 0], [11, 3]])
        assert torch.equal(emb(ids), w[ids].to(torch.bfloat16))


def _q8_takes(word: str) -> bool:
    """Whether the default dot path (`auto`) takes `word` rows through q8 on this CPU."""
    fmt, k, q, _ = _weight(word, None, 4)
    assert fmt.block is not None
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    kw = dict(ggml_type=fmt.block.type_id, in_features=k)
    auto = psr.store.cpu_linear(x, q.reshape(4, -1), dot="auto", **kw)
    return not torch.equal(auto, psr.store.cpu_linear(x, q.reshape(4, -1), dot="f32", **kw))


def _gguf(tmp_path: Path, tied: bool, family: str = "qwen3_moe") -> tuple[Path, Any]:
    """A tiny Qwen3-MoE GGUF: dense matrices Q8_0 in layer 0, Q4_K elsewhere (embeddings and
    output head included), Q8_0 experts; and its transformers twin. DeepSeek-V3 (MLA: rows
    of 64 and 128): Q8_0 dense, llama.cpp's split attn_k_b / attn_v_b."""
    model = gguf_tiny_model(family, head_dim=64, vocab=256)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    path = tmp_path / f"{family}{'_tied' if tied else ''}.gguf"
    types: dict[str, Any] = {"experts": "Q8_0", "dense": "Q8_0"}
    if family == "qwen3_moe":
        types["dense"] = lambda layer: "Q8_0" if layer == 0 else "Q4_K"
    return path, twin_model(model, write_gguf(model, path, types))


def _load(
    path: Path, dense_format: str, compute: str = "torch", cpu_dot: str = "f32"
) -> psr.OffloadedModel:
    """`cpu_dot` f32 by default: the twin computes with fp32 activations (the q8 path
    rounds them to 8 bits; its own tolerance below and in tests/store/test_cpu_qdot.py)."""
    return psr.load(
        path, "exact", residency=0.5, device="cpu", compute=compute, progress=False,
        dense_format=dense_format, cpu_dot=cpu_dot,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("family", "tied"), [("qwen3_moe", False), ("qwen3_moe", True), ("deepseek_v3", False)]
)
def test_native_equals_float_and_the_twin_in_less_memory(
    tmp_path: Path, family: str, tied: bool
) -> None:
    path, twin = _gguf(tmp_path, tied, family)
    with torch.no_grad():
        want = twin(input_ids=PROMPT).logits
        tokens = twin.generate(PROMPT, max_new_tokens=3, do_sample=False)
    native, flt = _load(path, "native"), _load(path, "float")
    hf = native.hf
    assert isinstance(hf.model.embed_tokens, QuantEmbedding)
    attn = hf.model.layers[1].self_attn
    assert isinstance(hf.lm_head, QuantLinear) and isinstance(attn.o_proj, QuantLinear)
    if family == "deepseek_v3":
        assert isinstance(attn.kv_b_proj, MlaKvB)
        assert str(attn.kv_b_proj.k_fmt) == str(attn.kv_b_proj.v_fmt) == "Q8_0"
    else:
        assert str(hf.model.layers[0].self_attn.q_proj.fmt) == "Q8_0"
        assert str(hf.model.layers[1].mlp.gate.inner.weight.dtype) == "torch.float32"  # router
        assert str(hf.lm_head.fmt) == "Q4_K"
    if tied:  # one copy of the blocks
        assert hf.lm_head.qweight.data_ptr() == hf.model.embed_tokens.qweight.data_ptr()
    for m in (native, flt):
        torch.testing.assert_close(m(PROMPT), want, rtol=3e-4, atol=3e-4)
        assert torch.equal(m.generate(PROMPT, max_new_tokens=3), tokens)
    # the same weights: the CPU kernels' fp32 dot of the blocks vs F.linear of them
    # dequantized differ only in summation order
    torch.testing.assert_close(native(PROMPT), flt(PROMPT), rtol=1e-5, atol=1e-5)
    # the default dot path (q8 for the K-quants, and for Q8_0 on AVX2: activations rounded
    # to 8 bits a block): measured within 1.6e-3 of the logits' scale here with Q8_0 on
    # fp32 (AVX-512), 2.8e-2 for DeepSeek's all-Q8_0 dense part through q8 (AVX2)
    q8 = _load(path, "native", cpu_dot="auto")
    tol = 4e-2 if family == "deepseek_v3" and _q8_takes("Q8_0") else 5e-3
    torch.testing.assert_close(q8(PROMPT), want, rtol=0, atol=tol * want.abs().max().item())
    ck = GGUFCheckpoint(path)
    table = ck.tensor_table()
    ck.close()
    dense = [n for n in table if "_exps." not in n]
    kept = [n for n in dense if keeps_blocks(n, table[n].type_name, len(table[n].shape))]
    if family == "qwen3_moe":
        assert {table[n].type_name for n in kept} == {"Q8_0", "Q4_K"}
        assert len(kept) == 9 + (not tied)
    else:  # every dense matrix but the routers, the split kv_b included
        assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"} <= set(kept)
    saved = dense_bytes(table, dense, "float", 4) - dense_bytes(table, dense, "native", 4)
    assert saved == sum(int(np.prod(table[n].shape)) * 4 - table[n].nbytes for n in kept)
    got = flt.memory()["device_dense"] - native.memory()["device_dense"]
    assert got == saved
    # 4 B -> ~1 B a weight (fp32 routers, norms and rotary tables stay)
    assert native.memory()["device_dense"] < flt.memory()["device_dense"] / 3
    native.close()
    flt.close()


def test_triton_path_on_kept_blocks(tmp_path: Path) -> None:
    """The Triton dense kernels (interpreted) in the loaded model: one forward."""
    path, twin = _gguf(tmp_path, tied=False)
    with torch.no_grad():
        want = twin(input_ids=PROMPT).logits
    with _load(path, "native", compute="triton") as m:
        torch.testing.assert_close(m(PROMPT), want, rtol=3e-4, atol=3e-4)


def test_mla_kv_b_on_both_paths(tmp_path: Path, f32_dots: None) -> None:
    """DeepSeek's kv_b_proj from the split blocks: Triton (interpreted) = torch = the float
    path's recomposed matrix (the fp32 dot: a load earlier in the process may have left
    another default)."""
    path, _ = _gguf(tmp_path, tied=False, family="deepseek_v3")
    ck = GGUFCheckpoint(path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    w = ck.get(name)
    (kt, k), (vt, v), heads = ck.get_split_kv_b(name)
    ck.close()
    x = torch.randn(3, w.shape[1])
    fk, fv = LinearFormat.parse(kt), LinearFormat.parse(vt)
    for compute in ("triton", "torch"):
        m = MlaKvB(k.clone(), fk, v.clone(), fv, heads, compute=compute)
        torch.testing.assert_close(m(x[None])[0], x @ w.T, rtol=1e-5, atol=1e-5)


def test_a_block_type_the_dense_kernels_lack_is_refused(tmp_path: Path) -> None:
    model = gguf_tiny_model("qwen3_moe", head_dim=64, vocab=256)
    path = tmp_path / "tq.gguf"
    write_gguf(model, path, {"experts": "Q8_0", "dense": "TQ2_0"})
    with pytest.raises(ValueError, match=r"'token_embd.weight' is TQ2_0, a block type psr's "):
        _load(path, "native")
    _load(path, "float").close()  # dequantized by gguf-py, as before


def test_dense_format_option() -> None:
    assert LoadConfig().dense_format == "native"
    with pytest.raises(
        ValueError, match=r"^dense_format must be one of native, float, int8, fp8; got 'q4'$"
    ):
        LoadConfig(dense_format="q4")
    from psr.cli import build_parser
    from psr.cli.generate import load_options

    args = build_parser().parse_args(["generate", "--prompt", "x", "--dense-format", "float"])
    assert LoadConfig.of("load", **load_options(args)).dense_format == "float"


def test_the_dense_custom_ops_pass_opcheck() -> None:
    """What a compiled forward (graphs on the CPU) calls: the ops' fake shapes and schemas."""
    import psr.runtime.dense  # noqa: F401  (registers the ops)

    _, k, q, _ = _weight("Q8_0", None, 8)
    q = q.reshape(8, -1)
    x = torch.randn(3, k)
    ops = torch.ops.psr_dense
    torch.library.opcheck(ops.linear, (x, q, None, torch.randn(8), "Q8_0", 0, k, "torch"))
    torch.library.opcheck(ops.rows, (q[[1, 5]], None, "Q8_0", 0, k))
    torch.library.opcheck(ops.heads_t, (torch.randn(3, 4), q, "Q8_0", 2, "torch"))
    _, k8, q8, s8 = _weight("int8", None, 8)
    torch.library.opcheck(ops.linear, (torch.randn(2, k8), q8, s8, None, "int8", 0, k8, "torch"))


@pytest.mark.parametrize("word", ["int8", "fp8"])
def test_int8_fp8_dense_weights_of_a_float_checkpoint(tmp_path: Path, word: str) -> None:
    """dense_format int8 / fp8 quantizes a safetensors checkpoint's dense Linear / Embedding
    weights per output channel: equal to the float model holding the same dequantized
    weights, in the bytes of the codes and scales; routers and experts untouched."""
    from tiny_models import tiny_model, write_checkpoint

    ck = write_checkpoint(tiny_model("qwen2_moe"), tmp_path / "qwen2_moe")
    ids = PROMPT % 64
    quant = psr.load(ck, "exact", 0.5, device="cpu", progress=False, dense_format=word)
    flt = psr.load(ck, "exact", 0.5, device="cpu", progress=False, dense_format="float")
    fmt = LinearFormat.parse(word)
    saved = 0
    mods = dict(flt.hf.named_modules())
    for name, mod in quant.hf.named_modules():
        if isinstance(mod, QuantLinear | QuantEmbedding):
            assert mod.fmt == fmt, name
            w = mods[name].weight
            k = w.shape[1]
            deq = pk.dequantize_weight(mod.qweight, fmt, k, mod.scales)
            saved += w.numel() * w.element_size() - fmt.nbytes(w.shape[0], k)
            with torch.no_grad():
                w.copy_(deq.to(w.dtype))  # the float model, fake-quantized
    names = {n for n, m in quant.hf.named_modules() if isinstance(m, QuantLinear)}
    want = {"model.layers.0.mlp.shared_expert.down_proj", "model.layers.1.mlp.down_proj"}
    assert want | {"lm_head", "model.layers.0.mlp.shared_expert_gate"} <= names
    assert not any(".mlp.gate" in n and "proj" not in n for n in names)  # routers stay
    assert isinstance(quant.hf.model.embed_tokens, QuantEmbedding)
    torch.testing.assert_close(quant(ids), flt(ids), rtol=1e-5, atol=1e-5)
    assert flt.memory()["device_dense"] - quant.memory()["device_dense"] == saved
    with pytest.raises(ValueError, match=r"dense weights are stored quantized already"):
        _load(_gguf(tmp_path, tied=False)[0], word)


@pytest.mark.parametrize("word", ["Q4_K", "Q8_0", "Q6_K"])
def test_quant_linear_cpu_plan_is_cpu_linear_and_follows_a_replaced_weight(word: str) -> None:
    """The layer's prepared CPU call (its weight's checks done once) gives cpu_linear's bits,
    and a replaced weight or bias (load_state_dict, `.to()`) is read, not the old one."""
    from psr.store import cpu_linear

    fmt, k, q, _ = _weight(word, None, 12)
    assert fmt.block is not None
    lin = QuantLinear(q.reshape(12, -1), fmt, k, bias=torch.randn(12), compute="torch")
    x = torch.randn(2, 3, k)

    def want(m: QuantLinear) -> torch.Tensor:
        y = cpu_linear(x.reshape(6, k), m.qweight, ggml_type=fmt.block.type_id, in_features=k,
                       bias=m.bias)  # fmt: skip
        return y.reshape(2, 3, 12)

    assert torch.equal(lin(x), want(lin))
    _, _, q2, _ = _weight(word, None, 13)
    lin.load_state_dict({"qweight": q2[:12].reshape(12, -1).clone(), "bias": torch.randn(12)})
    assert torch.equal(lin(x), want(lin))
    lin.qweight = q2[1:].reshape(12, -1).clone()
    assert torch.equal(lin(x), want(lin))
    with pytest.raises(ValueError, match=f"x has {2 * k} features, the layer takes {k}"):
        lin(torch.randn(1, 2 * k))  # a reshape to [-1, k] would take it silently
