"""Which of the big offloaded MoE models fit a 24 GB GPU: header-faithful GGUF files (the
metadata and tensor table as published, the data left as holes) of DeepSeek-V3, Kimi-K2,
GLM-4.5-Air, Qwen3-235B-A22B, gpt-oss-120b and Qwen3-30B-A3B, each opened with `psr
inspect`, and per model psr's memory plans (psr.models.memory_plan, the one source of the
figures: before the plan, and the plan with the dense part dequantized to bf16 or in the
file's own blocks) beside llama.cpp's `--cpu-moe` plan computed from the same tensor table
(every non-expert tensor in its file type on the device, the routed experts on the CPU).
DeepSeek-V3 and Kimi-K2 also in the low-bit "dynamic" mixes they are run as on one card
(UD_MIXES: Unsloth's UD-IQ1_S to UD-Q2_K_XL layouts). Issue 39's goal is checked file by
file: the largest slab on 24 GB at 8k tokens, the memory a 10% slab needs and the smallest
GPU that holds it, and the plan's modeled decode time beside no slab. `psr inspect` is
timed by `/usr/bin/time -v` in a fresh process per file.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python bench/fit_table.py [--dir /tmp/psr-fit] \
        [--models 'Qwen3-30B-A3B Q4_K_M,...'] [--residency 0.1] [--split-gb 45] \
        [--out bench/results/fit]

Files are written sparse under --dir (logical sizes up to ~400 GB, a few MB on disk) and
deleted afterwards. Where the published file is not reproduced exactly, the spec below
says what is assumed (`notes`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

GiB = 2**30
GPU = 24 * 10**9  # "a 24 GB GPU": 24e9 bytes (an RTX 4090 has 23.99e9 usable at most)

Q = {  # llama.cpp's fallback when a row is not a whole number of 256-value K blocks
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
}


@dataclass(frozen=True)
class Spec:
    """A published GGUF file's shape: its config as the converter writes it, and the
    quantization recipe (llama.cpp's Q4_K_M rules, or gpt-oss's MXFP4 file)."""

    name: str
    arch: str
    layers: int  # block_count as written (MTP layers included where the file keeps them)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense FFN (leading dense layers)
    expert_ffn: int
    experts: int
    top_k: int
    vocab: int
    merges: int  # assumed: about the vocabulary size (byte-level BPE)
    dense_layers: int = 0  # leading dense layers
    shared: int = 0  # shared experts
    nextn: int = 0  # MTP layers kept in the file (GLM); DeepSeek's converter drops them
    mla: tuple[int, int, int, int, int] | None = None  # q_lora, kv_lora, nope, rope, v
    recipe: str = "Q4_K_M"  # "Q4_K_M", "MXFP4" or a UD_MIXES key
    keys: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    published: str = ""  # the published file's size, where known (the modeled one is beside)


SPECS = {
    s.name: s
    for s in (
        Spec(
            "DeepSeek-V3 Q4_K_M",
            "deepseek2",
            61,
            7168,
            128,
            128,
            128,
            18432,
            2048,
            256,
            8,
            129280,
            127741,
            dense_layers=3,
            shared=1,
            mla=(1536, 512, 128, 64, 128),
            keys={
                "expert_gating_func": 2,
                "expert_weights_scale": 2.5,
                "expert_weights_norm": True,
                "expert_group_count": 8,
                "expert_group_used_count": 4,
                "rope.freq_base": 10000.0,
                "yarn": (40.0, 4096, 0.1 * 1.0),
                "context_length": 163840,
            },
            notes="MTP layer dropped by the converter; attn_kv_b split (llama.cpp's MLA files)",
        ),
        Spec(
            "Kimi-K2 Q4_K_M",
            "deepseek2",
            61,
            7168,
            64,
            64,
            128,
            18432,
            2048,
            384,
            8,
            163840,
            163328,
            dense_layers=1,
            shared=1,
            mla=(1536, 512, 128, 64, 128),
            keys={
                "expert_gating_func": 2,
                "expert_weights_scale": 2.827,
                "expert_weights_norm": True,
                "expert_group_count": 1,
                "expert_group_used_count": 1,
                "rope.freq_base": 50000.0,
                "yarn": (32.0, 4096, 0.1),
            },
            notes="Q4_K_M recipe assumed for 'Q4_K-class'; merges count assumed",
        ),
        Spec(
            "GLM-4.5-Air Q4_K_M",
            "glm4moe",
            47,
            4096,
            96,
            8,
            128,
            10944,
            1408,
            128,
            8,
            151552,
            318088,
            dense_layers=1,
            shared=1,
            nextn=1,
            keys={
                "expert_weights_scale": 1.0,
                "expert_weights_norm": True,
                "expert_gating_func": 2,
                "rope.freq_base": 1000000.0,
                "rope.dimension_count": 64,
            },
            notes="expert FFN 1408 is not a multiple of 256: down in Q5_0/Q8_0 (llama.cpp's "
            "fallback); MTP layer 46 kept (attention + experts + nextn tensors)",
        ),
        Spec(
            "Qwen3-235B-A22B Q4_K_M",
            "qwen3moe",
            94,
            4096,
            64,
            4,
            128,
            12288,
            1536,
            128,
            8,
            151936,
            151387,
            keys={"rope.freq_base": 1000000.0},
        ),
        Spec(
            "gpt-oss-120b MXFP4",
            "gpt-oss",
            36,
            2880,
            64,
            8,
            64,
            2880,
            2880,
            128,
            4,
            201088,
            446189,
            recipe="MXFP4",
            keys={
                "rope.freq_base": 150000.0,
                "yarn": (32.0, 4096, None),
                "attention.sliding_window": 128,
            },
            notes="non-expert matrices Q8_0 (ggml-org's 63.4 GB file; assumed), routed "
            "experts MXFP4, router/biases/sinks F32",
        ),
        Spec(
            "Qwen3-30B-A3B Q4_K_M",
            "qwen3moe",
            48,
            2048,
            32,
            4,
            128,
            6144,
            768,
            128,
            8,
            151936,
            151387,
            keys={"rope.freq_base": 1000000.0},
        ),
    )
}


# Unsloth's "dynamic" low-bit files, the ones DeepSeek-V3 / R1 and Kimi-K2 run as on one 24
# GB card (unsloth.ai/blog/deepseekr1-dynamic, Jan 2025: "MoE bits" and "down_proj" per
# file): the routed experts at 1.5-2.6 bits, their down projections a step higher in some
# layers (modeled as llama.cpp's low-bit rule does it: the first eighth of the MoE layers),
# everything else at 4/6 bits (modeled: llama.cpp's Q4_K_M rules) and the shared experts
# at 6 bits (Q6_K). recipe -> (routed gate / up, routed down, routed down in the first
# eighth of the MoE layers).
UD_MIXES = {
    "UD-IQ1_S": ("IQ1_S", "IQ1_S", "IQ2_XXS"),  # blog: 1.58-bit, down 2.06/1.56
    "UD-IQ1_M": ("IQ1_M", "IQ2_XXS", "IQ2_XXS"),  # 1.73-bit, down 2.06
    "UD-IQ2_XXS": ("IQ2_XXS", "Q2_K", "Q2_K"),  # 2.22-bit, down 2.5/2.06 (2.06 not modeled)
    "UD-Q2_K_XL": ("Q2_K", "Q2_K", "Q3_K"),  # 2.51-bit, down 3.5/2.5
}


R1_BLOG = "unsloth.ai/blog/deepseekr1-dynamic (DeepSeek-R1, V3's shapes)"


def _mix(recipe: str) -> str:
    gate_up, down, first = UD_MIXES[recipe]
    return (
        f"routed gate/up {gate_up}, down {down} ({first} in the first eighth of the MoE "
        "layers), shared experts Q6_K, the rest by llama.cpp's Q4_K_M rules"
    )


def _ud(base: str, recipe: str, published: str, notes: str) -> Spec:
    """`base`'s shapes in the dynamic mix `recipe` (UD_MIXES)."""
    b = SPECS[base]
    name = f"{b.name.rsplit(' ', 1)[0]} {recipe}"
    return replace(b, name=name, recipe=recipe, published=published, notes=notes)


_UD = [
    _ud("DeepSeek-V3 Q4_K_M", r, f"{size} GiB ({R1_BLOG})", _mix(r))
    for r, size in (("UD-IQ1_S", 131), ("UD-IQ1_M", 158), ("UD-IQ2_XXS", 183), ("UD-Q2_K_XL", 212))
] + [
    _ud(
        "Kimi-K2 Q4_K_M",
        r,
        size,
        _mix(r) + " (no per-tensor layout published for Kimi-K2 found: the R1 blog's mix "
        "on Kimi-K2's shapes)",
    )
    for r, size in (
        ("UD-IQ1_S", "Unsloth's Kimi-K2.5 page: 240 GB at 1.8 bits (UD-TQ1_0, a type psr lacks)"),
        ("UD-Q2_K_XL", "Unsloth's Kimi-K2.5 page: 375 GB (UD-Q2_K_XL)"),
    )
]
ORDER = [
    "DeepSeek-V3 Q4_K_M",
    *[s.name for s in _UD if s.name.startswith("DeepSeek")],
    "Kimi-K2 Q4_K_M",
    *[s.name for s in _UD if s.name.startswith("Kimi")],
]
SPECS = {n: ({s.name: s for s in _UD} | SPECS)[n] for n in ORDER} | SPECS


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _qtype(s: Spec, name: str, shape: tuple[int, ...], layer: int) -> str:
    """The type llama.cpp's quantizer gives tensor `name` (numpy shape) in `s.recipe`."""
    if len(shape) == 1 or "ffn_gate_inp" in name or "norm" in name or name.endswith(".bias"):
        return "F32"
    if "attn_sinks" in name:
        return "F32"
    if s.recipe == "MXFP4":
        return "MXFP4" if "_exps." in name else "Q8_0"
    if s.recipe in UD_MIXES:
        gate_up, down, down_first = UD_MIXES[s.recipe]
        if "_exps." in name:
            moe = layer - s.dense_layers
            first = moe < (s.layers - s.nextn - s.dense_layers) // 8
            return (down_first if first else down) if "ffn_down" in name else gate_up
        if "_shexp." in name:
            return Q["Q6_K"] if shape[-1] % 256 else "Q6_K"
    if name == "output.weight":
        t = "Q6_K"
    elif "attn_v." in name or "ffn_down" in name:
        t = "Q6_K" if _more_bits(layer, s.layers) else "Q4_K"
    else:
        t = "Q4_K"
    return Q[t] if shape[-1] % 256 else t


Add = Any  # add(name, *shape, layer=i): one tensor of the table


def _attention(s: Spec, b: str, i: int, add: Add) -> None:
    H = s.hidden
    if s.mla is not None:
        ql, kvl, nope, rope, v = s.mla
        add(b + "attn_q_a.weight", ql, H, layer=i)
        add(b + "attn_q_a_norm.weight", ql)
        add(b + "attn_q_b.weight", s.heads * (nope + rope), ql, layer=i)
        add(b + "attn_kv_a_mqa.weight", kvl + rope, H, layer=i)
        add(b + "attn_kv_a_norm.weight", kvl)
        add(b + "attn_k_b.weight", s.heads, kvl, nope, layer=i)
        add(b + "attn_v_b.weight", s.heads, v, kvl, layer=i)
        add(b + "attn_output.weight", H, s.heads * v, layer=i)
        return
    hd = s.head_dim
    for p, rows in (("q", s.heads * hd), ("k", s.kv_heads * hd), ("v", s.kv_heads * hd)):
        add(b + f"attn_{p}.weight", rows, H, layer=i)
        if s.arch in ("glm4moe", "gpt-oss"):
            add(b + f"attn_{p}.bias", rows)
    add(b + "attn_output.weight", H, s.heads * hd, layer=i)
    if s.arch == "gpt-oss":
        add(b + "attn_output.bias", H)
        add(b + "attn_sinks.weight", s.heads)
    if s.arch == "qwen3moe":
        add(b + "attn_q_norm.weight", hd)
        add(b + "attn_k_norm.weight", hd)


def _moe(s: Spec, b: str, i: int, add: Add) -> None:
    H, E, F = s.hidden, s.experts, s.expert_ffn
    add(b + "ffn_gate_inp.weight", E, H)
    if s.arch == "gpt-oss":
        add(b + "ffn_gate_inp.bias", E)
    if s.arch in ("deepseek2", "glm4moe"):
        add(b + "exp_probs_b.bias", E)
    for p in ("gate", "up"):
        add(b + f"ffn_{p}_exps.weight", E, F, H, layer=i)
    add(b + "ffn_down_exps.weight", E, H, F, layer=i)
    if s.arch == "gpt-oss":
        for p, n in (("gate", F), ("up", F), ("down", H)):
            add(b + f"ffn_{p}_exps.bias", E, n)
    if s.shared:
        for p in ("gate", "up"):
            add(b + f"ffn_{p}_shexp.weight", F * s.shared, H, layer=i)
        add(b + "ffn_down_shexp.weight", H, F * s.shared, layer=i)


def tensors(s: Spec) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [.., out, in], type) of every tensor the file holds."""
    H, out = s.hidden, []

    def add(name: str, *shape: int, layer: int = 0) -> None:
        out.append((name, shape, _qtype(s, name, shape, layer)))

    add("token_embd.weight", s.vocab, H)
    for i in range(s.layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", H)
        add(b + "ffn_norm.weight", H)
        _attention(s, b, i, add)
        if i < s.dense_layers:
            for p in ("gate", "up"):
                add(b + f"ffn_{p}.weight", s.ffn, H, layer=i)
            add(b + "ffn_down.weight", H, s.ffn, layer=i)
            continue
        _moe(s, b, i, add)
        if i >= s.layers - s.nextn:  # GLM's MTP layer
            add(b + "nextn.eh_proj.weight", H, 2 * H, layer=i)
            for n in ("enorm", "hnorm", "shared_head_norm"):
                add(b + f"nextn.{n}.weight", H)
    add("output_norm.weight", H)
    add("output.weight", s.vocab, H)
    return out


def nbytes(shape: tuple[int, ...], qtype: str) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return int(np.prod(shape, dtype=np.int64)) // block * size


def _metadata(w: Any, s: Spec) -> None:
    import gguf

    a = s.arch
    kv = gguf.GGUFValueType
    w.add_name(s.name.split()[0])
    w.add_block_count(s.layers)
    w.add_context_length(int(s.keys.get("context_length", 131072)))
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_head_count(s.heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    if s.mla is not None:
        ql, kvl, nope, rope, v = s.mla
        w.add_head_count_kv(1)  # llama.cpp's MLA files: one latent "head"
        w.add_key_length(kvl + rope)
        w.add_value_length(kvl)
        w.add_key_value(f"{a}.attention.key_length_mla", nope + rope, kv.UINT32)
        w.add_key_value(f"{a}.attention.value_length_mla", v, kv.UINT32)
        w.add_q_lora_rank(ql)
        w.add_kv_lora_rank(kvl)
        w.add_rope_dimension_count(rope)
    else:
        w.add_head_count_kv(s.kv_heads)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.dense_layers:
        w.add_leading_dense_block_count(s.dense_layers)
    if s.shared:
        w.add_expert_shared_count(s.shared)
        w.add_expert_shared_feed_forward_length(s.expert_ffn * s.shared)
    if s.nextn:
        w.add_nextn_predict_layers(s.nextn)
    for k, v in s.keys.items():
        if k == "context_length":
            continue
        if k == "yarn":
            factor, orig, mul = v
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(factor)
            w.add_rope_scaling_orig_ctx_len(orig)
            if mul is not None:
                w.add_key_value(f"{a}.rope.scaling.yarn_log_multiplier", mul, kv.FLOAT32)
        elif isinstance(v, bool):
            w.add_key_value(f"{a}.{k}", v, kv.BOOL)
        elif isinstance(v, float):
            w.add_key_value(f"{a}.{k}", v, kv.FLOAT32)
        else:
            w.add_key_value(f"{a}.{k}", v, kv.UINT32)
    # the tokenizer as llama.cpp's converter writes a byte-level BPE vocabulary
    rng = np.random.default_rng(0)
    lens = rng.integers(2, 12, size=s.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"\u0120t{i:x}" + "a" * int(n) for i, n in enumerate(lens)])
    w.add_token_types([1] * (s.vocab - 64) + [3] * 64)
    w.add_token_merges([f"\u0120t{i % s.vocab:x} a{i % 97}" for i in range(s.merges)])
    w.add_bos_token_id(s.vocab - 64)
    w.add_eos_token_id(s.vocab - 63)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}" * 60)


def write(s: Spec, path: Path, split_bytes: int = 0) -> list[Path]:
    """The header-faithful file(s) of `s` at `path` (split into parts of at most
    `split_bytes` of tensor data when > 0), data left as holes. Returns the files."""
    import gguf

    w = gguf.GGUFWriter(path, s.arch, split_max_size=split_bytes)
    _metadata(w, s)
    for name, shape, qt in tensors(s):
        w.add_tensor_info(
            name, shape, np.dtype(np.float32), nbytes(shape, qt), gguf.GGMLQuantizationType[qt]
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    files, ends = [], []
    for fout, infos in zip(w.fout, w.tensors, strict=True):
        fout.flush()
        start = w.ggml_pad(fout.tell(), w.data_alignment)
        files.append(Path(fout.name))
        ends.append(start + sum(w.ggml_pad(t.nbytes, w.data_alignment) for t in infos.values()))
    w.close()
    for f, end in zip(files, ends, strict=True):
        os.truncate(f, end)  # the data: holes
    return files


CONTEXTS = (8192, 32768)
GOAL_RESIDENCY = 0.1  # the goal's slab: 10% of the experts
GOAL_DENSE = 1.15  # dense bytes within this ratio of llama.cpp's
UNBOUNDED = 10**15  # a GPU no plan fills
PROFILE = "rtx4090"  # the rates (psr.eval.latency) the modeled decode times read
# GPU sizes (GB = 1e9 bytes, as the 24 GB of the goal) for "the smallest GPU that would"
GPUS = (
    (24, "RTX 4090"),
    (32, "RTX 5090"),
    (48, "RTX 6000 Ada"),
    (80, "H100 80GB"),
    (96, "RTX PRO 6000"),
    (141, "H200"),
)


def _plans(memory: Any, residency: float) -> dict[str, Any]:
    """Per context, the memory plans (psr.models.memory_plan) of one model on a 24 GB GPU:
    `before`, psr before the plan (the dense part dequantized to float32, the GGUF default;
    a slab of `residency` with experts_on 'gpu'); `bf16`, what psr.load(gpu_memory=...,
    dtype='bfloat16', experts_on='hybrid', dense_format='float') plans (dense dequantized
    to bf16); `native`, the same with the dense part in the file's own blocks (dense_format
    'native', the GGUF default)."""
    import math

    from psr.eval.latency import get_profile
    from psr.models.memory_plan import Budget, plan_memory

    RATES = get_profile(PROFILE)

    E = memory.num_experts
    slots = math.floor(residency * E + 0.5)
    asked = {
        "before": dict(dense_format="float", slots=slots),
        "bf16": dict(dense_format="float", dtype="bfloat16", experts_on="hybrid"),
        "native": dict(
            dense_format="native", dtype="bfloat16", experts_on="hybrid", rates=RATES.rates()
        ),
    }
    # the goal's slab (GOAL_RESIDENCY of the experts) on a GPU of unbounded memory: the
    # device_total is the memory that slab needs
    goal = math.ceil(GOAL_RESIDENCY * E)
    asked["goal"] = asked["native"] | dict(slots=goal)
    asked["native_int8"] = asked["native"] | dict(kv_format="int8")
    # llama.cpp's --cpu-moe placement priced alike: no slab, every expert on the CPU
    asked["cpu_moe"] = asked["native"] | dict(slots=0, experts_on="cpu")
    out: dict[str, Any] = {}
    for ctx in CONTEXTS:
        for name, kw in asked.items():
            gpu = UNBOUNDED if name == "goal" else GPU
            p = plan_memory(memory, Budget(gpu_memory=gpu, context=ctx, **kw))  # type: ignore[arg-type]
            out[f"{name}@{ctx}"] = {
                "slots": p.slots,
                "residency": p.residency,
                "dense": p.dense,
                "kv": sum(p.kv.values()),
                "workspace": p.workspace,
                "slab": p.slab,
                "device_total": p.device_total,
                "fits": p.fits,
                "message": p.message(),
                "modeled": p.modeled,
            }
    return out


def _inspect_child(path: str, residency: float) -> None:
    """In a fresh process: psr.inspect(path) with a plan (24 GB, 8k tokens), its wall time
    and peak RSS, and every plan of the table from the same header read, as JSON."""
    import psr
    from psr.models.memory_plan import Budget

    t0 = time.perf_counter()
    r = psr.inspect(path, Budget(gpu_memory=GPU, context=CONTEXTS[0]))
    dt = time.perf_counter() - t0
    # VmHWM: this process's peak RSS (ru_maxrss keeps the forking parent's across exec)
    hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    peak = int(hwm.split()[1]) * 1024
    assert r.memory is not None
    plans = _plans(r.memory, residency)
    d = r.to_dict()
    print(json.dumps({"seconds": dt, "peak_rss": peak, "inspect": d, "plans": plans}))


def inspect_fresh(path: Path, residency: float) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(path), "--residency", str(residency)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


# psr inspect's flags for the plan the goal table shows (24 GB, 8k tokens, bf16, hybrid)
INSPECT_PLAN = ["--gpu-memory", "24GB", "--context", "8k", "--dtype", "bfloat16"]
INSPECT_PLAN += ["--experts-on", "hybrid"]


def _elapsed(text: str) -> float:
    """GNU time's "h:mm:ss" or "m:ss.ss" as seconds."""
    out = 0.0
    for part in text.split(":"):
        out = out * 60 + float(part)
    return out


def inspect_timed(path: Path) -> dict[str, Any]:
    """`/usr/bin/time -v psr inspect --model PATH` with the goal table's plan (INSPECT_PLAN)
    in a fresh process: wall seconds, CPU seconds and maximum RSS as GNU time reports them."""
    cmd = [sys.executable, "-m", "psr.cli", "inspect", "--model", str(path), *INSPECT_PLAN]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        ["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode:
        said = out.stderr.split("\tCommand being timed")[0].strip().splitlines() or ["?"]
        return {"error": said[-1]}
    got = {}
    for ln in out.stderr.splitlines():
        k, _, v = ln.strip().rpartition(": ")
        got[k] = v
    wall = _elapsed(got["Elapsed (wall clock) time (h:mm:ss or m:ss)"])
    cpu = float(got["User time (seconds)"]) + float(got["System time (seconds)"])
    rss = int(got["Maximum resident set size (kbytes)"]) * 1024
    return {"wall_s": wall, "cpu_s": cpu, "max_rss": rss}


def row(s: Spec, files: list[Path], residency: float) -> dict[str, Any]:
    """The figures of one model: psr's plans (psr.models.memory_plan, in a fresh process
    running psr.inspect) beside llama.cpp's `--cpu-moe` plan from the same tensor table."""
    table = tensors(s)
    experts = sum(nbytes(sh, t) for n, sh, t in table if "_exps." in n)
    llama_dense = sum(nbytes(sh, t) for n, sh, t in table if "_exps." not in n)
    embd = next(nbytes(sh, t) for n, sh, t in table if n == "token_embd.weight")
    ins = inspect_fresh(files[0], residency)
    r: dict[str, Any] = {
        "model": s.name,
        "file_bytes": sum(f.stat().st_size for f in files),
        "parts": len(files),
        "experts_bytes": experts,
        "llama_dense": llama_dense,
        "llama_embd": embd,
        "notes": s.notes,
        "published": s.published,
        "inspect_cli": inspect_timed(files[0]),
    }
    if "error" in ins:
        r["error"] = ins["error"]
        return r
    i = ins["inspect"]
    r |= {
        "inspect_s": ins["seconds"],
        "inspect_peak_rss": ins["peak_rss"],
        "top_k": i["top_k"],
        "num_experts": i["num_experts"],
        "slot_bytes": i["plan"]["slot_bytes"],
        "plans": ins["plans"],
    }
    return r


def _g(n: int) -> str:
    return f"{n / GiB:.2f}"


def _llama(r: dict[str, Any], ctx: int) -> int:
    """llama.cpp on the device with every expert on the CPU: its non-expert tensors in
    their file types + an f16 KV cache of the values psr's accounting counts (half psr's
    float32 KV) at `ctx` tokens."""
    kv32 = r["plans"][f"before@{ctx}"]["kv"]
    return int(r["llama_dense"] + kv32 // 2)


def _cell(p: dict[str, Any], top_k: int) -> str:
    """A plan's slots per layer (residency), or by how much it misses 24 GB."""
    if not p["fits"]:
        return f"no: short {(p['device_total'] - GPU) / GiB:.2f}"
    low = " (< top_k: hybrid/cpu)" if p["slots"] < top_k else ""
    return f"{p['slots']} ({p['residency']:.1%}){low}"


def _fits(a: int, b: int) -> str:
    return f"{'yes' if a <= GPU else 'no'} / {'yes' if b <= GPU else 'no'}"


HEAD = [
    "| model | file | `psr inspect` | dense: float32 / bf16 / native | KV bf16 8k / 32k | "
    "before @8k / @32k (fits) | plan bf16: slots @8k | @32k | plan native: slots @8k | "
    "@32k | smallest slab | llama.cpp dense | llama.cpp @8k / @32k (fits) |",
    "|" + "---|" * 13,
]


KV_NOTE = (
    "KV formats: the table's KV is bf16 (llama.cpp's f16). `kv_format='int8'` / `'fp8'` "
    "(psr.runtime.kv_quant) keeps a byte a value and an fp32 scale per token and head: "
    "DeepSeek-V3 / Kimi-K2's 576 MLA values a layer and token take 584 bytes instead of "
    "1152 (0.51x), a GQA head of 128 keys or values 132 instead of 256 (0.52x); not "
    "tabulated (the plan counts it: `psr inspect --kv-format int8`)."
)


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        head = f"| {r['model']} | {r['file_bytes'] / 1e9:.1f} GB | fails: {r['error']} |"
        return head + " |" * 10
    p, k, (c8, c32) = r["plans"], r["top_k"], CONTEXTS
    b8, b32 = p[f"before@{c8}"]["device_total"], p[f"before@{c32}"]["device_total"]
    l8, l32 = _llama(r, c8), _llama(r, c32)
    dense = " / ".join(_g(p[f"{n}@{c8}"]["dense"]) for n in ("before", "bf16", "native"))
    smallest = f"0 (hybrid/cpu); {k}/layer with gpu: {_g(k * r['slot_bytes'])}"
    return (
        f"| {r['model']} | {_file_cell(r)} | {_inspect_cell(r)} | {dense} | "
        f"{_g(p[f'bf16@{c8}']['kv'])} / {_g(p[f'bf16@{c32}']['kv'])} | "
        f"{_g(b8)} / {_g(b32)} ({_fits(b8, b32)}) | "
        f"{_cell(p[f'bf16@{c8}'], k)} | {_cell(p[f'bf16@{c32}'], k)} | "
        f"{_cell(p[f'native@{c8}'], k)} | {_cell(p[f'native@{c32}'], k)} | {smallest} | "
        f"{_g(r['llama_dense'])} | {_g(l8)} / {_g(l32)} ({_fits(l8, l32)}) |"
    )


GOAL_HEAD = [
    "| file | routed experts (10%) | dense: psr native / llama.cpp (ratio) | psr @8k: dense + "
    "KV + workspace + slab = device (slots) | psr @32k: device (slots) | largest slab on 24 GB "
    "@8k | llama.cpp `--cpu-moe` @8k / @32k | goal on 24 GB | a 10% slab @8k needs | "
    "smallest GPU for it | modeled decode ms/token, RTX 4090 rates: psr @8k / no slab |",
    "|" + "---|" * 11,
]


def smallest_gpu(need: int) -> str:
    """The first of GPUS whose memory holds `need` bytes."""
    for gb, name in GPUS:
        if need <= gb * 10**9:
            return f"{gb} GB ({name})"
    return f"> {GPUS[-1][0]} GB"


def goal(r: dict[str, Any]) -> dict[str, Any]:
    """The goal's verdict for one row: on 24 GB at 8k tokens, the plan's slab >= 10% of the
    experts and the dense part within 1.15x llama.cpp's; else what is short."""
    c8 = CONTEXTS[0]
    p8, g8 = r["plans"][f"native@{c8}"], r["plans"][f"goal@{c8}"]
    ratio = p8["dense"] / r["llama_dense"]
    short = []
    if not p8["fits"]:
        short.append("even an empty slab does not fit")
    elif p8["residency"] < GOAL_RESIDENCY:
        short.append(f"slab {p8['residency']:.1%} < 10%")
    if ratio > GOAL_DENSE:
        short.append(f"dense {ratio:.2f}x llama.cpp's")
    return {"met": not short, "short": short, "ratio": ratio, "need": g8["device_total"]}


def _goal_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['model']} | fails: {r['error']} |" + " |" * 8
    c8, c32 = CONTEXTS
    p8, p32 = r["plans"][f"native@{c8}"], r["plans"][f"native@{c32}"]
    i8 = r["plans"][f"native_int8@{c8}"]
    g = goal(r)
    ex = r["experts_bytes"]
    parts = " + ".join(_g(p8[k]) for k in ("dense", "kv", "workspace", "slab"))
    verdict = "**yes**" if g["met"] else "no: " + "; ".join(g["short"])
    need = g["need"]
    return (
        f"| {r['model']} | {_g(ex)} ({_g(ex // 10)}) | {_g(p8['dense'])} / "
        f"{_g(r['llama_dense'])} ({g['ratio']:.2f}x) | {parts} = {_g(p8['device_total'])} "
        f"({p8['slots']}) | {_g(p32['device_total'])} ({p32['slots']}) | "
        f"{p8['residency']:.1%} (int8 KV: {i8['residency']:.1%}) | "
        f"{_g(_llama(r, c8))} / {_g(_llama(r, c32))} | {verdict} | "
        f"{_g(need)} GiB = {need / 1e9:.1f} GB | {smallest_gpu(need)} | {_modeled(r)} |"
    )


def _modeled(r: dict[str, Any]) -> str:
    """The modeled decode times of the plan at 8k and of no slab (every expert on the CPU)."""
    c8 = CONTEXTS[0]
    ms = [r["plans"][f"{n}@{c8}"].get("modeled") for n in ("native", "cpu_moe")]
    return " / ".join(f"{m['ms_per_token']:.1f}" if m else "-" for m in ms)


def _file_cell(r: dict[str, Any]) -> str:
    parts = f" in {r['parts']} parts" if r["parts"] > 1 else ""
    return f"{r['file_bytes'] / 1e9:.1f} GB{parts}"


def _inspect_cell(r: dict[str, Any]) -> str:
    t = r.get("inspect_cli", {})
    if "error" in t:
        return f"fails: {t['error']}"
    return f"{t['wall_s']:.2f} s, {t['cpu_s']:.2f} CPU-s, {t['max_rss'] / 2**20:.0f} MiB"


MODELED_NOTE = (
    "Modeled decode: `psr.models.memory_plan.modeled_decode` (what `psr inspect --gpu-memory "
    "... --profile rtx4090` prints), a batch-1 roofline on psr.eval.latency's rtx4090 rates "
    "(HBM 900 GB/s, PCIe 25 GB/s, CPU expert kernels 50 GB/s over host rows: a desktop "
    "with dual-channel DDR5, assumed, not measured): dense bytes and the 8k KV read once, "
    "per MoE layer k (1 - C/E) misses (routing independent of the cache, a pessimistic "
    "prior) computed on the CPU beside the slab's hits or copied, whichever is faster; no "
    "host launch cost or Python. `no slab`: the same plan with C = 0, every expert on the "
    "CPU (llama.cpp's `--cpu-moe` placement, priced with psr's rates, not llama.cpp's "
    "measured speed). A ratio between the two is the model's, not a measurement."
)


BEFORE_AFTER_HEAD = [
    "| file | before: dense float32 + KV float32 + workspace @8k | after: dense native + KV "
    "bf16 + workspace @8k | after, with the planned slab (slots) | llama.cpp `--cpu-moe` "
    "@8k |",
    "|" + "---|" * 5,
]


def _before_after(r: dict[str, Any]) -> str:
    """Device GiB at 8k tokens without a slab, before (psr's dense part dequantized to
    float32, the GGUF default before the plan) and after (the file's own blocks), beside the
    plan with its slab and llama.cpp's --cpu-moe."""
    if "error" in r:
        return f"| {r['model']} | fails |" + " |" * 3
    c8 = CONTEXTS[0]
    b, n = r["plans"][f"before@{c8}"], r["plans"][f"native@{c8}"]
    base = [p["dense"] + p["kv"] + p["workspace"] for p in (b, n)]
    return (
        f"| {r['model']} | {_g(base[0])} | {_g(base[1])} | {_g(n['device_total'])} "
        f"({n['slots']}) | {_g(_llama(r, c8))} |"
    )


def _assumed(r: dict[str, Any]) -> str:
    line = f"- {r['model']}: {r['notes']}"
    if r.get("published"):
        line += f"; modeled {r['file_bytes'] / GiB:.1f} GiB, published {r['published']}"
    return line


def markdown(rows: list[dict[str, Any]], residency: float, cmd: str, machine: str) -> str:
    out = [
        "# Fit table: what psr's memory plan puts on one 24 GB GPU",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {machine}.",
        "",
        "GiB; 24 GB = 24e9 bytes. Every psr figure is `psr.models.memory_plan` (what `psr "
        "inspect --gpu-memory 24GB` and `psr.load(gpu_memory=...)` compute): the dense part, "
        "the KV cache (psr.runtime.kv: what each attention kind caches; DeepSeek's MLA "
        "latent), a workspace (a 512-token prefill chunk's logits and activations + a "
        "512 MiB CUDA reserve) and the expert slab (the file's own blocks). **before**: psr "
        "before the plan, dense dequantized to float32 (then the GGUF default), float32 KV, a "
        f"slab of residency {residency:g} with experts_on 'gpu'. **plan bf16**: "
        "`psr.load(path, gpu_memory='24GB', dtype='bfloat16', experts_on='hybrid', "
        "dense_format='float')`: dense dequantized to bf16, bf16 KV, the slots that fit in "
        "the rest (a slab smaller than top_k, down to none, works with experts_on cpu / "
        "hybrid). **plan native**: the same with the dense part in the file's own blocks "
        "(dense_format 'native', now the GGUF default). A cell: slots per layer (residency), "
        "or `no: short X` "
        "GiB when even an empty slab does not fit. llama.cpp `--cpu-moe`: every non-expert "
        "tensor in its file type (token_embd included; llama.cpp itself keeps it in host "
        "memory) + an f16 KV cache of the same values (assumed); no workspace counted. "
        "`psr inspect`: `/usr/bin/time -v python -m psr.cli inspect --model FILE "
        f"{' '.join(INSPECT_PLAN)}` in a fresh process (wall clock, user + system CPU, "
        "maximum resident set size; interpreter and imports included), one run per file.",
        "",
        *HEAD,
    ]
    out += [_line(r) for r in rows]
    out += ["", KV_NOTE]
    out += [
        "",
        "## The goal, file by file",
        "",
        "Issue 39's goal: every model fits a 24 GB GPU with >= 8k tokens of context and a "
        "slab of >= 10% of the experts, the dense bytes within 1.15x llama.cpp's for the same "
        "file. Per file: psr's plan (`psr.load(path, gpu_memory='24GB', context=8192, "
        "experts_on='hybrid', dtype='bfloat16')`, dense in the file's blocks, bf16 KV) with "
        "its parts; the largest slab that fits at 8k (the plan's slots / experts); "
        "llama.cpp's `--cpu-moe` device bytes from the same tensor table (no slab, no "
        "workspace); the verdict; and the device memory a slab of 10% of the experts "
        "(ceil(0.1 x experts) slots per layer) needs at 8k with the same parts, with the "
        "smallest common GPU that holds it (GB = 1e9 bytes).",
        "",
        *GOAL_HEAD,
    ]
    out += [_goal_line(r) for r in rows]
    out += ["", MODELED_NOTE]
    out += ["", "## Before and after, per file (GiB at 8k tokens)", "", *BEFORE_AFTER_HEAD]
    out += [_before_after(r) for r in rows]
    out += ["", "Assumptions per model (beyond the published configs):", ""]
    out += [_assumed(r) for r in rows if r["notes"] or r.get("published")]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="/tmp/psr-fit")
    ap.add_argument("--models", default=",".join(SPECS))
    ap.add_argument("--residency", type=float, default=0.1)
    ap.add_argument("--split-gb", type=float, default=0.0, help="parts of at most this size")
    ap.add_argument("--out", default="")
    ap.add_argument("--render", help="write fit.md again from this fit.json (no files built)")
    a = ap.parse_args()
    if a.child:
        _inspect_child(a.child, a.residency)
        return
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        md = markdown(saved["rows"], saved["residency"], saved["command"], saved["machine"])
        Path(a.render).with_name("fit.md").write_text(md)
        print(md)
        return
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.models.split(","):
        s = SPECS[name]
        stem = d / (name.replace(" ", "-") + ".gguf")
        files = write(s, stem, int(a.split_gb * 1e9))
        try:
            rows.append(row(s, files, a.residency))
        finally:
            for f in files:
                f.unlink()
        print(json.dumps(rows[-1]), file=sys.stderr)
    from psr.models.tiers import meminfo

    cmd = "OMP_NUM_THREADS=1 PYTHONPATH=python:. python " + shlex.join(sys.argv)
    machine = f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, " + (
        f"MemTotal {meminfo().get('MemTotal', 0) / GiB:.1f} GiB, MemAvailable "
        f"{meminfo().get('MemAvailable', 0) / GiB:.1f} GiB"
    )
    md = markdown(rows, a.residency, cmd, machine)
    print(md)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fit.md").write_text(md)
        saved = {"command": cmd, "residency": a.residency, "machine": machine, "rows": rows}
        (out / "fit.json").write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()
