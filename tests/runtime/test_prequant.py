"""Checkpoints shipped quantized, loaded as they are: gpt-oss's MXFP4 experts and block-wise
FP8 (DeepSeek-V3 / Qwen3-FP8's weight + weight_scale_inv), against transformers on the float
twin (the same values dequantized: gguf-py's MXFP4 decoder, the FP8 tile formula)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_models import tiny_config

import psr
import psr_kernels as pk

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])


def _model(family: str, **over):
    import transformers

    cfg = tiny_config(family)
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "router" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "experts" in name or "embed" in name or "lm_head" in name:
                p.normal_(0, 0.2)
    return m


def _write(model, path: Path, sd: dict[str, torch.Tensor], qc: dict) -> Path:
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's (blocks [R, nb, 16], scales [R, nb]) of w [R, K] and its dequantized twin."""
    R, K = w.shape
    g = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    twin = torch.from_numpy(
        gguf.quants.dequantize(g, gguf.GGMLQuantizationType.MXFP4).reshape(R, K).copy()
    )
    b = torch.from_numpy(g.reshape(R, K // 32, 17).astype(np.int32))
    qs = b[..., 1:]
    v = torch.cat([qs & 0xF, qs >> 4], -1)  # the block's 32 codes in value order
    blocks = (v[..., 0::2] | (v[..., 1::2] << 4)).to(torch.uint8)  # low nibble: even value
    return blocks, b[..., 0].to(torch.uint8), twin


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    m = _model("gpt_oss", hidden_size=64, intermediate_size=32)
    sd = {k: v for k, v in m.state_dict().items() if ".experts.gate_up_proj" not in k}
    sd = {k: v for k, v in sd.items() if not k.endswith("experts.down_proj")}
    with torch.no_grad():
        for d, layer in enumerate(m.model.layers):
            ex = layer.mlp.experts
            p = f"model.layers.{d}.mlp.experts"
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(ex, name).data  # [E, in, out]
                parts = [_mxfp4(w[e].t().contiguous()) for e in range(w.shape[0])]
                sd[f"{p}.{name}_blocks"] = torch.stack([q[0] for q in parts])
                sd[f"{p}.{name}_scales"] = torch.stack([q[1] for q in parts])
                getattr(ex, name).copy_(torch.stack([q[2].t() for q in parts]))  # the twin
            sd[f"{p}.gate_up_proj_bias"] = ex.gate_up_proj_bias.data
            sd[f"{p}.down_proj_bias"] = ex.down_proj_bias.data
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    return _write(m, tmp_path_factory.mktemp("mxfp4") / "m", sd, qc), _logits(m)


@pytest.mark.parametrize("compute", ["torch", "triton"])
def test_gpt_oss_mxfp4_experts_load_as_they_are(gpt_oss_mxfp4, compute: str) -> None:
    path, want = gpt_oss_mxfp4
    model = psr.load(path, "exact", residency=0.5, device="cpu", compute=compute, progress=False)
    rt = model.runtime
    assert rt.expert_formats == [pk.ggml_format("MXFP4", "MXFP4", "MXFP4")] * 3
    H, F = 64, 32
    assert model.memory()["host_experts"] == 3 * 8 * pk.GGMLLayout.of(rt.expert_format, H, F).nbytes
    torch.testing.assert_close(model(PROMPT), want, rtol=2e-4, atol=2e-4)
    with pytest.raises(RuntimeError, match=r"quantized experts .* GGUF"):
        model.restore()


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes, scale_inv per 128 x 128 tile, the dequantized twin) of w [R, K]."""
    R, K = w.shape
    tiles = torch.nn.functional.pad(w.float(), (0, -K % 128, 0, -R % 128))
    t = tiles.reshape(tiles.shape[0] // 128, 128, tiles.shape[1] // 128, 128)
    s = t.abs().amax((1, 3)) / 448.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    full = s.repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :K]
    codes = (w.float() / full).to(torch.float8_e4m3fn)
    return codes, s, codes.float() * full


@pytest.fixture(scope="module")
def qwen3_fp8(tmp_path_factory):
    m = _model("qwen3_moe", hidden_size=128, moe_intermediate_size=128, intermediate_size=128)
    fp8 = ("proj.weight",)  # every linear but the routers, embeddings and the head
    sd = {}
    with torch.no_grad():
        for k, v in m.state_dict().items():
            if ".experts." in k:
                continue
            if k.endswith(fp8) and v.dim() == 2:
                codes, s, twin = _fp8(v)
                sd[k], sd[f"{k}_scale_inv"] = codes, s
                m.get_parameter(k).copy_(twin)
            else:
                sd[k] = v
        for d, layer in enumerate(m.model.layers):
            ex = layer.mlp.experts
            gu, dn = ex.gate_up_proj.data, ex.down_proj.data  # [E, 2F, H], [E, H, F]
            F = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                for name, w in (
                    ("gate_proj", gu[e, :F]),
                    ("up_proj", gu[e, F:]),
                    ("down_proj", dn[e]),
                ):
                    codes, s, twin = _fp8(w)
                    n = f"model.layers.{d}.mlp.experts.{e}.{name}.weight"
                    sd[n], sd[f"{n}_scale_inv"] = codes, s
                    w.copy_(twin)
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    return _write(m, tmp_path_factory.mktemp("fp8") / "m", sd, qc), _logits(m)


@pytest.mark.parametrize("compute", ["torch", "triton"])
def test_block_fp8_checkpoint_loads_as_it_is(qwen3_fp8, compute: str) -> None:
    path, want = qwen3_fp8
    model = psr.load(path, "exact", residency=0.5, device="cpu", compute=compute, progress=False)
    assert model.runtime.expert_format == pk.ggml_format("FP8_B128", "FP8_B128", "FP8_B128")
    torch.testing.assert_close(model(PROMPT), want, rtol=2e-4, atol=2e-4)


def test_prequantized_checkpoints_refuse_requantizing_and_other_methods(
    qwen3_fp8, tmp_path: Path
) -> None:
    path, _ = qwen3_fp8
    with pytest.raises(ValueError, match="experts stay in their own blocks"):
        psr.load(path, "exact", device="cpu", expert_format="int4", progress=False)
    other = tmp_path / "awq"
    other.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}
    (other / "config.json").write_text(json.dumps(cfg))
    (other / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match="quant_method 'awq' is not one psr loads"):
        psr.load(other, "exact", device="cpu", progress=False)
