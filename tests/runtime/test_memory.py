"""`model.memory()`: bytes by place, against counts made here from the model's own shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint

import psr
import psr_kernels as pk


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_memory_by_place(tmp_path: Path, fmt: str) -> None:
    hf = tiny_model("qwen3_moe")
    ckpt = write_checkpoint(hf, tmp_path / "m")
    cfg = hf.config
    E, H, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    layers = cfg.num_hidden_layers
    model = psr.load(ckpt, "exact", slots=3, device="cpu", expert_format=fmt, progress=False)
    mem = model.memory(context=100)
    row = 3 * H * F * 4 if fmt == "native" else pk.QuantLayout.of("int8", H, F).nbytes
    assert mem["host_experts"] == layers * E * row
    assert mem["device_slab"] == layers * 3 * row
    dense = sum(p.numel() * 4 for n, p in hf.named_parameters() if ".experts." not in n)
    tied = hf.lm_head.weight.numel() * 4 if cfg.tie_word_embeddings else 0
    buffers = sum(b.numel() * b.element_size() for _, b in hf.named_buffers())
    assert mem["device_dense"] == dense - tied + buffers
    head_dim = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    assert mem["device_kv"] == layers * 2 * cfg.num_key_value_heads * head_dim * 4 * 100
    assert model.memory()["device_kv"] == mem["device_kv"] // 100 * cfg.max_position_embeddings
    model.close()


def test_memory_counts_sliding_windows() -> None:
    """gpt-oss's sliding layers hold at most their window of tokens."""
    from psr.runtime.kv import kv_bytes

    cfg = tiny_model("gpt_oss").config
    kinds = cfg.layer_types
    w = cfg.sliding_window
    per = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    want = sum(per * (min(5 * w, w) if k == "sliding_attention" else 5 * w) for k in kinds)
    assert kv_bytes(cfg, 2, 5 * w) == want
    assert "sliding_attention" in kinds and "full_attention" in kinds
