"""Quantized expert copies (expert_format): the host store keeps int8 / fp8 / int4 rows,
copies move their real bytes, the kernels dequantize on the fly; decoding stays
deterministic under copy delays and close to the unquantized model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
import psr_kernels as pk
from psr.eval.latency import PROFILES, simulate

IDS = torch.tensor([[(7 * i + 3) % 64 for i in range(40)]])
PROMPT = [5, 17, 33, 2, 9, 41, 12, 60]
FORMATS = ["bf16", "int8", "fp8", "int4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("q") / "olmoe")


def load(path, fmt, policy="psr", **kw):
    kw = {"lam": 0.5, "n": 1, **kw} if policy == "psr" else kw
    return psr.load(path, policy, 0.5, progress=False, expert_format=fmt, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_hold_the_formats_bytes_and_copies_count_them(ckpt, fmt) -> None:
    m = load(ckpt, fmt)
    H, F = m.runtime.spec.hidden_size, m.runtime.spec.ffn_size
    nbytes = 3 * H * F * 2 if fmt == "bf16" else pk.QuantLayout.of(fmt, H, F).nbytes
    assert m.runtime.store.expert_bytes[0] == nbytes
    rec = m.record_trace()
    m.generate(PROMPT, 10)
    s = m.stats
    assert s["copies"] > 0 and s["bytes_copied"] == s["copies"] * nbytes
    ratio = 1.0 if fmt == "bf16" else pk.bytes_ratio(fmt, H, F)
    assert rec.trace.bytes_ratio == pytest.approx(ratio)
    # The latency model prices a copy by the format's bytes: same counts, cheaper copies.
    prof = PROFILES["rtx4090"]
    per_copy = replace(prof, expert_bytes=round(prof.expert_bytes * ratio)).copy_s()
    quant = simulate(rec.trace, prof)
    rec.trace.bytes_ratio = 1.0
    full = simulate(rec.trace, prof)
    assert quant.copy_ms / full.copy_ms == pytest.approx(per_copy / prof.copy_s())


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_quantized_decoding_scores_as_it_decodes(ckpt, fmt) -> None:
    m = load(ckpt, fmt, "exact")
    ra = m.record_trace()
    a = m.score(IDS, 8)
    m2 = load(ckpt, fmt, "exact")
    rb = m2.record_trace()
    b = m2.decode_logits(IDS, 8)
    assert ra.trace.to_json() == rb.trace.to_json()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_quantized_logits_stay_close_to_native_on_the_embedded_model() -> None:
    """On the trained model (a random tiny one re-routes chaotically): mean relative logit
    error of a prefill, by format; a wrong dequantization would be near 1. The errors
    rank as the formats' precision does (int8 per channel < fp8 e4m3 < int4), which a
    format silently loaded as another (or not quantized at all: 0) would break."""
    ids = torch.tensor([[(7 * i + 3) % 2000 for i in range(40)]])
    kw = dict(progress=False, dtype="float32")
    native = psr.load(psr.DEFAULT_MODEL, "exact", 0.5, **kw)(ids)
    errs = {}
    for fmt, bound in (("int8", 0.02), ("fp8", 0.05), ("int4", 0.15)):
        q = psr.load(psr.DEFAULT_MODEL, "exact", 0.5, expert_format=fmt, **kw)(ids)
        errs[fmt] = err = float((q - native).abs().mean() / native.abs().mean())
        assert err < bound, f"{fmt}: mean relative logit error {err:.4f}"
    assert 0 < errs["int8"] < errs["fp8"] < errs["int4"], errs  # measured: .006, .021, .067


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_output_is_bit_identical_under_random_copy_delays(ckpt, fmt, monkeypatch) -> None:
    runs = []
    for seed in ("1", "2", "3"):
        monkeypatch.setenv("PSR_COPY_DELAY_US", "2000")
        monkeypatch.setenv("PSR_COPY_DELAY_SEED", seed)
        m = load(ckpt, fmt, lam=0.5, n=2)
        toks = m.generate(PROMPT, 12).tolist()
        logits = m.decode_logits(IDS[:, :24], 8)
        runs.append((toks, logits, m.stats.report()))
    for toks, logits, stats in runs[1:]:
        assert toks == runs[0][0] and stats == runs[0][2]
        assert torch.equal(logits, runs[0][1])


def test_offload_quantizes_a_built_model_and_refuses_lossy_restore(tmp_path) -> None:
    hf = tiny_model("olmoe")
    om = psr.offload(hf, "exact", 0.5, expert_format="int8", progress=False)
    assert om.runtime.store.dtype == torch.uint8
    assert om.generate(PROMPT, 4).shape[1] == len(PROMPT) + 4
    with pytest.raises(RuntimeError, match="quantized experts"):
        psr.restore(hf)
    with pytest.raises(RuntimeError, match="quantized experts"):
        hf.save_pretrained(tmp_path / "out")


def test_a_bad_format_is_named(ckpt) -> None:
    with pytest.raises(ValueError, match="expert_format must be one of native, bf16, int8"):
        load(ckpt, "int3")
