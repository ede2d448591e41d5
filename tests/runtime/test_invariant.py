"""The row-invariant CPU forward (issue 36): every token's logits and KV bit-identical
whatever the prefill chunking, a decode step equal to that row of a prefill; the CPU
backend's default wherever the attention and the experts allow it; rows_attention against
an eager reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import gguf_tiny_model, write_gguf
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.models import DEFAULT_MODEL
from psr.runtime.attention import rows_attention
from psr.runtime.chunked import PromptCache
from psr.runtime.dense import RowLinear, row_invariant

T = 70  # prompt tokens: chunks 1, 7, 64 and whole cut it differently


def _logits_and_kv(model: psr.OffloadedModel, ids: torch.Tensor, chunk: int):
    """Every prompt position's logits (prefill in chunks of `chunk`) and the KV cache after
    the prompt (the prompt cache's entry at its end)."""
    model.set_prefill_chunk(chunk)
    logits = model.decode_logits(ids, ids.shape[1])
    cache = PromptCache(1 << 30)
    model.generate(ids, max_new_tokens=1, prompt_cache=cache)
    longer = torch.cat([ids[0], ids[0, :1]])
    at, entry = cache.lookup(model._prefill_key(False), longer)
    assert at == ids.shape[1] and entry is not None  # the prompt's end is kept
    kv = [(x.keys, x.values) for x in entry.kv[1].layers]
    return logits, kv


def _check_chunk_invariance(model: psr.OffloadedModel) -> None:
    model.set_row_invariant(True)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=g)
    base = _logits_and_kv(model, ids, T)
    for chunk in (64, 7, 1):
        got = _logits_and_kv(model, ids, chunk)
        assert torch.equal(got[0], base[0]), f"logits differ at chunk {chunk}"
        for (k, v), (k0, v0) in zip(got[1], base[1], strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0), f"KV differs at chunk {chunk}"
    # decode steps (exact routing) equal the prefill rows they replace
    model.set_prefill_chunk(64)
    assert torch.equal(model.decode_logits(ids, T - 5), base[0])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inv")
    out = {f: write_checkpoint(tiny_model(f), root / f) for f in ("olmoe", "qwen2_moe")}
    out["deepseek_v3"] = write_checkpoint(tiny_model("deepseek_v3"), root / "ds")
    return out


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek_v3"])
def test_tiny_families_are_chunk_invariant(ckpts, family) -> None:
    with psr.load(ckpts[family], "exact", 1.0, device="cpu", progress=False) as model:
        assert not model.row_invariant  # loader.ROW_INVARIANT_DEFAULT
        _check_chunk_invariance(model)
        linears = [m for m in model.hf.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m, RowLinear) and row_invariant(m) for m in linears)


def test_the_embedded_model_is_chunk_invariant() -> None:
    with psr.load(DEFAULT_MODEL, "exact", 1.0, device="cpu", progress=False) as model:
        _check_chunk_invariance(model)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_a_gguf_native_model_is_chunk_invariant(tmp_path, family) -> None:
    """GGML dense blocks kept native (QuantLinear, DeepSeek's split MLA kv_b: MlaKvB)."""
    path = tmp_path / f"{family}.gguf"
    write_gguf(gguf_tiny_model(family), path, {"experts": "Q4_K", "dense": "Q8_0"})
    with psr.load(path, "exact", 1.0, device="cpu", progress=False) as model:
        dense = [m for m in model.hf.modules() if type(m).__name__ in ("QuantLinear", "MlaKvB")]
        assert dense and all(row_invariant(m) for m in dense)
        _check_chunk_invariance(model)


def test_switching_off_restores_the_chunked_forward(ckpts) -> None:
    with psr.load(ckpts["olmoe"], "exact", 1.0, device="cpu", progress=False) as model:
        impl = model.config._attn_implementation
        model.set_row_invariant(True)
        assert model.config._attn_implementation == "psr_rows"
        assert model.runtime.compute.row_invariant
        model.set_row_invariant(False)
        assert not model.row_invariant and model.config._attn_implementation == impl
        assert not any(isinstance(m, RowLinear) for m in model.hf.modules())
        assert not model.runtime.compute.row_invariant
        model.set_row_invariant(True)
        assert model.row_invariant and "row-invariant" in _graph_status(model)
        psr.restore(model)  # the model's own forward back
        assert model.config._attn_implementation == impl
        assert not any(isinstance(m, RowLinear) for m in model.hf.modules())


def _graph_status(model: psr.OffloadedModel) -> str:
    model.graphs = True
    model.generate(torch.arange(4)[None], max_new_tokens=1)
    return model.graph_status


def test_models_it_cannot_cover_are_refused_in_one_line(tmp_path) -> None:
    """Linear attention (Qwen3-Next) and expert kinds the CPU kernels lack (gpt-oss)."""
    for family, why in (("qwen3_next", "linear_attention"), ("gpt_oss", "CPU kernels")):
        ck = write_checkpoint(tiny_model(family), tmp_path / family)
        with psr.load(ck, "exact", 1.0, device="cpu", progress=False) as model:
            with pytest.raises(ValueError, match=f"row-invariant forward unavailable: .*{why}"):
                model.set_row_invariant(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "sinks"), [(None, False), (5, False), (None, True), (6, True)])
def test_rows_attention_matches_eager_and_is_row_invariant(dtype, window, sinks) -> None:
    torch.manual_seed(0)
    n, hq, hkv, d, dv = 23, 4, 2, 16, 8
    q, k = torch.randn(n, hq, d, dtype=dtype), torch.randn(n, hkv, d, dtype=dtype)
    v = torch.randn(n, hkv, dv, dtype=dtype)
    s = torch.randn(hq) if sinks else None
    full = rows_attention(q, k, v, q_start=0, scale=0.3, window=window, sinks=s)
    for t in (0, 9, n - 1):  # one row alone (a decode step) against its keys only
        one = rows_attention(
            q[t : t + 1], k[: t + 1].clone(), v[: t + 1].clone(), q_start=t, scale=0.3,
            window=window, sinks=s,
        )  # fmt: skip
        assert torch.equal(one[0], full[t])
    # eager reference: repeated kv heads, a causal (windowed) mask, the sink column
    kk, vv = k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1)
    scores = torch.einsum("thd,jhd->htj", q.float(), kk) * 0.3
    i = torch.arange(n)
    seen = i[None] <= i[:, None]
    if window:
        seen &= i[None] > i[:, None] - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if s is not None:
        scores = torch.cat([scores, s[:, None, None].expand(hq, n, 1)], -1)
    w = torch.softmax(scores, -1)[..., :n]
    ref = torch.einsum("htj,jhd->thd", w, vv)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(full.float(), ref, atol=tol, rtol=tol)


def test_rows_attention_refuses_shapes_that_do_not_fit() -> None:
    q, k = torch.zeros(3, 3, 4), torch.zeros(5, 2, 4)
    with pytest.raises(ValueError, match="not a multiple of 2 kv heads"):
        rows_attention(q, k, k, q_start=0, scale=1.0)
    with pytest.raises(ValueError, match="5 keys do not reach the last query"):
        rows_attention(torch.zeros(3, 2, 4), k, k, q_start=3, scale=1.0)
