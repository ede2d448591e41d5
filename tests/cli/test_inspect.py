"""`psr.inspect` / `psr inspect`: what psr would load, read from config.json alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, NEW_FAMILIES, tiny_config, tiny_model

import psr
import psr_kernels as pk
from psr.models.families import FAMILIES as TABLE
from psr.models.hf import moe_layer_indices


@pytest.mark.parametrize("family", FAMILIES + NEW_FAMILIES)
def test_inspect_agrees_with_the_built_model(tmp_path, family) -> None:
    tiny_config(family).save_pretrained(tmp_path)  # config only: no weights to read
    found = psr.inspect(tmp_path)
    assert found.supported and found.family == family
    assert found.router_kind == TABLE[family].router_kind
    model = tiny_model(family)
    assert found.sparse_layers == moe_layer_indices(model)
    assert sorted(found.sparse_layers + found.dense_layers) == list(range(found.num_layers))
    spec = psr.models.moe_spec(model.config)
    H, F, E = spec.hidden_size, spec.ffn_size, spec.num_experts
    assert (found.hidden_size, found.ffn_size, found.num_experts) == (H, F, E)
    n = len(found.sparse_layers)
    assert found.expert_bytes["bf16"] == 3 * H * F * 2
    assert found.expert_bytes["int4"] == pk.QuantLayout.of("int4", H, F, 128).nbytes
    assert found.host_bytes["int8"] == n * E * found.expert_bytes["int8"]
    experts = {id(p) for i in found.sparse_layers for p in _block(model, i).experts.parameters()}
    dense = sum(p.numel() * 4 for p in model.parameters() if id(p) not in experts)
    assert found.dense_bytes == dense  # fp32 tiny models
    half = found.device_bytes["native"]["0.5"]
    assert half == dense + n * round(0.5 * E) * found.expert_bytes["native"]
    json.dumps(found.to_dict())  # serialisable
    # No tuned point for a fresh checkpoint: psr.load would take the untuned default.
    assert all("untuned default" in v for v in found.operating_points.values())
    assert set(found.operating_points) == {"cache-prior", "psr"}


def _block(model: torch.nn.Module, i: int) -> torch.nn.Module:
    from psr.models.hf import block_of

    return block_of(model, i)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "psr.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_embedded_model_shows_its_tuned_points() -> None:
    found = psr.inspect(psr.DEFAULT_MODEL)
    assert all(
        "tuned (" in v and "operating_points.json" in v for v in found.operating_points.values()
    )


def test_cli_table_json_and_unsupported(tmp_path: Path) -> None:
    tiny_config("deepseek_v2").save_pretrained(tmp_path / "v2")
    (tmp_path / "l4").mkdir()
    (tmp_path / "l4" / "config.json").write_text(json.dumps({"model_type": "llama4"}))
    runs = [
        ("inspect", "--model", str(tmp_path / "v2")),
        ("inspect", "--model", str(tmp_path / "v2"), "--json"),
        ("inspect", "--model", str(tmp_path / "l4")),
        ("inspect", "--model", str(tmp_path / "nowhere")),
    ]
    # Independent processes, each mostly its imports on one core: run side by side.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        out, js_run, bad, missing = pool.map(lambda a: _cli(*a), runs)
    assert out.returncode == 0, out.stderr
    assert "softmax_group_max" in out.stdout and "1 dense [0]" in out.stdout
    js = json.loads(js_run.stdout)
    assert js["family"] == "deepseek_v2" and js["sparse_layers"] == [1, 2]
    assert bad.returncode == 1
    assert bad.stdout.strip().endswith(
        "architecture 'llama4' is not supported yet: psr lacks the multimodal Llama 4 "
        "checkpoint (its text model, llama4_text, is supported)"
    )
    assert len(bad.stdout.strip().splitlines()) == 1
    assert missing.returncode != 0 and "no such folder" in missing.stderr


def test_inspect_a_gguf_file_before_loading_agrees_with_memory(tmp_path) -> None:
    """A GGUF file's per-layer types and bytes, read from its tensor table, are what the
    loaded model holds (`model.memory()`)."""
    from gguf_files import gguf_tiny_model, write_gguf

    model = gguf_tiny_model("qwen3_moe", head_dim=32)
    path = tmp_path / "m.gguf"
    mixed = {"gate": "Q4_K", "up": "Q4_K", "down": lambda i: "Q6_K" if i == 0 else "Q8_0"}
    write_gguf(model, path, mixed | {"dense": "F32"})
    found = psr.inspect(path)
    assert found.supported and found.family == "qwen3_moe"
    assert found.expert_types == {"gguf:Q4_K,Q4_K,Q6_K": 1, "gguf:Q4_K,Q4_K,Q8_0": 1}
    with psr.load(path, "exact", residency=0.5, device="cpu", progress=False) as m:
        mem = m.memory(context=1024)
    assert found.host_bytes["gguf"] == mem["host_experts"]
    assert found.device_bytes["gguf"]["0.5"] == found.dense_bytes + mem["device_slab"]
    assert found.kv_bytes_per_1k_tokens == mem["device_kv"]
    assert "Q4_K,Q4_K,Q6_K (gate, up, down) in 1 layers" in found.table()
