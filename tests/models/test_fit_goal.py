"""bench/fit_table.py's dynamic low-bit rows (issue 39's goal restated per file type) and
its goal figures, against sizes worked out from gguf-py's block sizes: psr reads the
mix from the header (every MoE layer's row format, one expert's bytes), the plan's largest
slab on 24 GB at 8k is what is left after the dense part, KV and workspace, and the memory
a 10% slab needs is the same parts plus ceil(0.1 x experts) slots."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as QT
from gguf_files import fit_table

import psr


def _size(qtype: str, values: int) -> int:
    """Bytes of `values` values in GGML type `qtype` (gguf-py's block sizes)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[QT[qtype]]
    return values // block * nbytes


def test_a_dynamic_low_bit_deepseek_file_reads_as_its_mix(tmp_path: Path) -> None:
    """DeepSeek-V3 in Unsloth's UD-IQ1_S layout: routed gate/up IQ1_S, down IQ2_XXS in the
    first eighth of the 58 MoE layers (7) and IQ1_S after; psr's slot bytes per layer are
    one expert's three matrices in those types, and the dense part kept in its blocks is
    llama.cpp's `--cpu-moe` device part (shared experts in Q6_K included)."""
    fit = fit_table()
    spec = fit.SPECS["DeepSeek-V3 UD-IQ1_S"]
    (path,) = fit.write(spec, tmp_path / "ds.gguf")
    found = psr.inspect(path)
    assert found.expert_types == {"gguf:IQ1_S,IQ1_S,IQ2_XXS": 7, "gguf:IQ1_S,IQ1_S,IQ1_S": 51}
    H, F = 7168, 2048
    one = {d: 2 * _size("IQ1_S", F * H) + _size(d, H * F) for d in ("IQ2_XXS", "IQ1_S")}
    assert found.memory is not None
    assert found.memory.rows == [one["IQ2_XXS"]] * 7 + [one["IQ1_S"]] * 51
    table = fit.tensors(spec)
    shexp = {t for n, _, t in table if "_shexp." in n}
    assert shexp == {"Q6_K"}
    llama = sum(fit.nbytes(sh, t) for n, sh, t in table if "_exps." not in n)
    bias = sum(fit.nbytes(sh, t) for n, sh, t in table if ".exp_probs_b." in n)
    assert found.dense_bytes_native == llama - bias


@pytest.mark.parametrize("model", ["DeepSeek-V3 UD-IQ1_S", "Qwen3-30B-A3B Q4_K_M"])
def test_the_goal_figures_are_the_plans_parts(model: str, tmp_path: Path) -> None:
    """The goal table's cells for one file: the largest slab on 24 GB at 8k is what the
    dense part, the KV cache and the workspace leave, in whole slots; a 10% slab needs
    those parts plus ceil(0.1 E) slots; the goal is met exactly when that fits 24 GB (the
    dense parts equal llama.cpp's here), and the smallest GPU is the first that holds it."""
    fit = fit_table()
    spec = fit.SPECS[model]
    (path,) = fit.write(spec, tmp_path / "m.gguf")
    mem = psr.inspect(path).memory
    assert mem is not None
    plans = fit._plans(mem, 0.1)
    p8, g8 = plans["native@8192"], plans["goal@8192"]
    slot, E = sum(mem.rows), mem.num_experts
    fixed = p8["dense"] + p8["kv"] + p8["workspace"]
    assert p8["slots"] == min(E, (fit.GPU - fixed) // slot)
    assert (g8["slots"], g8["device_total"]) == (math.ceil(0.1 * E), fixed + g8["slots"] * slot)
    table = fit.tensors(spec)
    llama = sum(fit.nbytes(sh, t) for n, sh, t in table if "_exps." not in n)
    g = fit.goal({"plans": plans, "llama_dense": llama})
    assert g["need"] == g8["device_total"] and g["ratio"] <= 1.0
    assert g["met"] is (g["need"] <= fit.GPU)
    # DeepSeek-V3 at 1.6 bits: 10% of its 120 GiB of experts and 10.3 GiB dense > 22.35 GiB
    assert g["met"] is (model == "Qwen3-30B-A3B Q4_K_M")
    first = next(f"{gb} GB ({n})" for gb, n in fit.GPUS if gb * 10**9 >= g["need"])
    assert fit.smallest_gpu(g["need"]) == first
    assert fit.smallest_gpu(10**13) == f"> {fit.GPUS[-1][0]} GB"
