"""Opening a large synthetic GGUF file: time, and resident memory before and after touching
the experts (the reader maps the file; pages come in only when an expert is read).

    .venv/bin/python bench/gguf_open.py [--layers 4] [--experts 64] [--out /tmp/psr-big.gguf]

Writes a qwen3moe file (hidden 1024, expert FFN 768, Q4_K experts as random blocks with
small valid scales, F16 dense tensors), then, in a fresh process, opens it with
GGUFCheckpoint and reads every expert's bytes once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

H, F, HEADS, KV, HD, VOCAB = 1024, 768, 8, 4, 128, 4096


def _kquant(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K blocks (144 bytes per 256 values) with small positive f16 d / dmin."""
    raw = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    raw[:, 0:2] = np.full(raw.shape[0], 2e-4, np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = np.full(raw.shape[0], 1e-4, np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // 256 * 144)


def write(path: Path, layers: int, experts: int) -> None:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(3 * F)
    w.add_expert_feed_forward_length(F)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(experts)
    w.add_expert_used_count(8)

    def f16(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", f16(VOCAB, H))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("output.weight", f16(VOCAB, H))
    q = gguf.GGMLQuantizationType.Q4_K
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(b + "attn_q.weight", f16(HEADS * HD, H))
        w.add_tensor(b + "attn_k.weight", f16(KV * HD, H))
        w.add_tensor(b + "attn_v.weight", f16(KV * HD, H))
        w.add_tensor(b + "attn_output.weight", f16(H, HEADS * HD))
        w.add_tensor(b + "attn_q_norm.weight", np.ones(HD, np.float32))
        w.add_tensor(b + "attn_k_norm.weight", np.ones(HD, np.float32))
        w.add_tensor(b + "ffn_gate_inp.weight", np.zeros((experts, H), np.float32))
        for part, (rows, cols) in (("gate", (F, H)), ("up", (F, H)), ("down", (H, F))):
            data = _kquant(rng, experts * rows, cols).reshape(experts, rows, -1)
            w.add_tensor(b + f"ffn_{part}_exps.weight", data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(path: Path) -> dict[str, float]:
    """In this (fresh) process: open, then read every expert's bytes once."""
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401

    from psr.models.gguf import GGUFCheckpoint

    # imports first: the figures are the file's, not transformers' modules'
    transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=1, vocab_size=64)
    )
    r0 = rss()
    t0 = time.perf_counter()
    ck = GGUFCheckpoint(path)
    t_open = time.perf_counter() - t0
    r1 = rss()
    t0 = time.perf_counter()
    total = 0
    for d in ck.moe_layers():
        for t in ck.expert_tensors(d).values():
            for e in range(t.shape[0]):
                total += int(t.expert(e)[::4096].sum())  # touches every page
    t_touch = time.perf_counter() - t0
    r2 = rss()
    expert_bytes = sum(
        t.row_bytes * t.shape[0] for d in ck.moe_layers() for t in ck.expert_tensors(d).values()
    )
    return {
        "file_mib": path.stat().st_size / 2**20,
        "expert_mib": expert_bytes / 2**20,
        "open_s": t_open,
        "rss_growth_open_mib": (r1 - r0) / 2**20,
        "touch_all_experts_s": t_touch,
        "rss_growth_after_touch_mib": (r2 - r0) / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("/tmp/psr-big.gguf"))
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.out)))
        return
    t0 = time.perf_counter()
    write(a.out, a.layers, a.experts)
    mib = a.out.stat().st_size / 2**20
    print(f"wrote {a.out} ({mib:.0f} MiB) in {time.perf_counter() - t0:.1f} s")
    out = subprocess.run(
        [sys.executable, __file__, "--measure", "--out", str(a.out)],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for k, v in res.items():
        print(f"{k:28s} {v:10.2f}")
    a.out.unlink()


if __name__ == "__main__":
    main()
