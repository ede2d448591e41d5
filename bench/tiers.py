"""Memory tiers on a checkpoint larger than RAM: decode with `host_memory=` on the CPU backend.

    python bench/tiers.py --dir /work/tiers-data --layers 24 --new 6 [--keep]

Writes (once; reused if present) a synthetic Qwen3-30B-A3B-shaped safetensors checkpoint,
sharded (experts of 4 layers a shard, 4.8 GB; dense weights apart: safetensors maps each
file privately, which the kernel refuses for a file larger than RAM without swap):
`--layers` MoE layers of 128 experts, hidden 2048, expert FFN 768, bf16 experts with random
weights (fused gate_up / down tensors, the layout transformers 5 saves), a small vocabulary.
24 layers hold 29 GB of experts: more than this machine's RAM. Then, with the file's pages
dropped from the page cache before each run (POSIX_FADV_DONTNEED), it decodes the same
prompt under `exact` and `psr` with a budget holding a few percent of the experts, and
prints tok/s, per token the bytes read from the file (page cache / disk, by mincore before
each read) beside what the copy counts predict (pageable copies x row bytes), and the
anonymous RSS peak. Then a smaller copy (`--small-layers` of the same layers, written
the same way) decodes with the budget and unlimited: the same tokens. `--keep` keeps the
files; otherwise they are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

H, F, E, TOP_K, VOCAB = 2048, 768, 128, 8, 1024
POOL = 1 << 27  # bf16 values of random weights; experts are windows into it


def _config(layers: int) -> Any:
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=6144,
        moe_intermediate_size=F,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def _shard_of(name: str, layers_per_shard: int) -> str:
    """Experts in shards of `layers_per_shard` layers, the rest in one dense shard (a file
    larger than RAM cannot be opened: safetensors maps each file privately, and without
    swap the kernel refuses a private mapping larger than RAM)."""
    if ".experts." not in name:
        return "dense.safetensors"
    return f"experts-{int(name.split('.')[2]) // layers_per_shard:03d}.safetensors"


def _tensor(name: str, n: int, i: int, pool: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if name.endswith(("layernorm.weight", "norm.weight")):
        return torch.ones(n, dtype=torch.bfloat16)
    if name.endswith("mlp.gate.weight"):  # routers: sharp enough to spread experts
        return (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)
    c = min(n, POOL // 2)  # windows of the pool at varying offsets: experts differ
    return torch.cat([pool[(i * 7919 + j * 104729) % (POOL - c) :][:c] for j in range(-(-n // c))])[
        :n
    ]


def write_checkpoint(path: Path, layers: int, seed: int = 0, per_shard: int = 4) -> Path:
    """The checkpoint, streamed to disk shard by shard: a safetensors header, then each
    tensor's bytes; the shard index last (its presence marks a finished checkpoint)."""
    import transformers

    if (path / "model.safetensors.index.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(layers)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = {k: list(v.shape) for k, v in meta.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=g) * 0.02).to(torch.bfloat16)
    shards: dict[str, list[str]] = {}
    for k in shapes:
        shards.setdefault(_shard_of(k, per_shard), []).append(k)
    order = {k: i for i, k in enumerate(shapes)}
    for shard, names in shards.items():
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        at = 0
        for k in names:
            n = 2 * int(torch.tensor(shapes[k]).prod())
            header[k] = {"dtype": "BF16", "shape": shapes[k], "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with (path / shard).open("wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for k in names:
                n = int(torch.tensor(shapes[k]).prod())
                f.write(_tensor(k, n, order[k], pool, g).view(torch.uint8).numpy().tobytes())
    cfg.save_pretrained(path)
    index = {"weight_map": {k: s for s, names in shards.items() for k in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def dense_bytes(layers: int) -> int:
    """Bytes of every non-expert tensor (bf16), from the model built on the meta device."""
    import transformers

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(_config(layers))
    return sum(2 * v.numel() for k, v in meta.state_dict().items() if ".experts." not in k)


def drop_cache(path: Path) -> None:
    """The files' clean pages out of the page cache (reads after this come from disk)."""
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def run(path: Path, policy: str, budget: int | str, args: argparse.Namespace) -> dict[str, Any]:
    import psr

    drop_cache(path)
    base, peak, stop = _anon(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _anon())
            time.sleep(0.01)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    kw: dict[str, Any] = {"lam": args.lam, "n": 1} if policy == "psr" else {}
    m = psr.load(path, policy, slots=args.slots, device="cpu", progress=False,
                 host_memory=budget, decode="host", **kw)  # fmt: skip
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = m.generate(args.prompt, args.new).tolist()[0]
    gen_s = time.perf_counter() - t0
    stop.set()
    th.join()
    s, mem = m.stats, m.memory(context=len(args.prompt) + args.new)
    row = m.runtime.expert_bytes
    n = max(s["tokens"], 1)
    pageable_copies = s["bytes_pageable"] / row
    res = {
        "policy": policy,
        "budget": budget,
        "tokens": out,
        "load_s": round(load_s, 1),
        "generate_s": round(gen_s, 1),
        "decode_tok_per_s": round(s["tokens_per_s"], 3),
        "misses_per_token": round(s["misses_per_token"], 2),
        "copies_per_token": round(s["copies"] / n, 2),
        "pageable_copies_per_token": round(pageable_copies / n, 2),
        # what the logical copy count predicts the store reads (copies x row), beside what
        # it measured reading (pinned + pageable)
        "predicted_read_MB_per_token": round(s["copies"] * row / n / 1e6, 1),
        "read_pageable_MB_per_token": round(s["bytes_pageable"] / n / 1e6, 1),
        "read_disk_MB_per_token": round(s["bytes_disk"] / n / 1e6, 1),
        "read_page_cache_MB_per_token": round(s["bytes_page_cache"] / n / 1e6, 1),
        "read_pinned_MB_per_token": round(s["bytes_pinned"] / n / 1e6, 1),
        "stall_pageable_s": round(s["stall_pageable_s"], 2),
        "rss_anon_peak_growth_GiB": round((peak[0] - base) / 2**30, 2),
        "held_GiB": round(mem["host_experts"] / 2**30, 2),
        "pageable_GiB": round(mem["pageable_experts"] / 2**30, 2),
        "slab_GiB": round(mem["device_slab"] / 2**30, 2),
        "dense_GiB": round(mem["device_dense"] / 2**30, 2),
    }
    m.close()
    print(json.dumps(res), flush=True)
    return res


def ring(backend: str, rows: int, row_bytes: int, repeats: int, folder: Path) -> dict[str, Any]:
    """Copy throughput by tier: the same rows held (pinned on CUDA) or pageable (read from a
    file through the staging ring on CUDA, by the copy worker on the CPU), the file's pages
    cached (warm) or dropped (cold). GB/s of enqueue + acquire of `rows` copies."""
    import numpy as np

    import psr
    from psr.store import LayerSpec

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ring.bin"
    data = np.random.default_rng(0).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    path.write_bytes(data.tobytes())
    out: dict[str, Any] = {"backend": backend, "rows": rows, "row_MB": row_bytes / 1e6}
    for tier in ("held", "pageable-warm", "pageable-cold"):
        held = rows if tier == "held" else 0
        st = psr.ExpertStore([LayerSpec(rows, 4, row_bytes, held)], torch.uint8, backend=backend)
        for e in range(rows):
            if held:
                st.register(0, e, torch.from_numpy(data[e]))
            else:
                st.register_pageable(0, e, [(str(path), e * row_bytes, row_bytes, f"row{e}")])
        best = 0.0
        for _ in range(repeats):
            if tier == "pageable-cold":  # dirty pages cannot be dropped: fsync first
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            t0 = time.perf_counter()
            for e in range(rows):
                st.enqueue_copies(0, [e % 4], [e])
                st.acquire(0, [e % 4], [e])
                st.release(0, [e % 4])
            st.synchronize()
            best = max(best, rows * row_bytes / (time.perf_counter() - t0) / 1e9)
        ok = all(st.verify(0, s) for s in range(4))
        out[tier] = {"GB_per_s": round(best, 2), "verified": ok, **st.counters()}
        st.close()
    path.unlink()
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/work/tiers-data"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--small-layers", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--held", type=float, default=0.05, help="fraction of experts held")
    p.add_argument("--new", type=int, default=6)
    p.add_argument("--lam", type=float, default=0.1)
    p.add_argument("--prompt", type=lambda s: [int(x) for x in s.split(",")], default=[3, 141])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument(
        "--ring",
        choices=["cpu", "cuda"],
        default=None,
        help="only the copy throughput by tier on this backend (the GPU script)",
    )
    args = p.parse_args()
    if args.ring is not None:
        res = ring(args.ring, 32, 3 * H * F * 2, 3, args.dir)
        if args.out is not None:
            args.out.write_text(json.dumps(res, indent=1) + "\n")
        return 0
    row = 3 * H * F * 2
    results: dict[str, Any] = {"command": " ".join(sys.argv), "uptime": os.getloadavg()}
    try:
        for name, layers in (("small", args.small_layers), ("big", args.layers)):
            t0 = time.perf_counter()
            path = write_checkpoint(args.dir / f"{name}-{layers}", layers)
            size = checkpoint_bytes(path)
            print(f"{name}: {size / 1e9:.1f} GB written/found in {time.perf_counter() - t0:.0f} s",
                  flush=True)  # fmt: skip
            dense = dense_bytes(layers)
            budget = int(dense + layers * row * (args.slots + args.held * E)) + (64 << 20)
            runs = [run(path, pol, budget, args) for pol in ("exact", "psr")]
            if name == "small":
                runs.append(run(path, "psr", "unlimited", args))
                assert runs[1]["tokens"] == runs[2]["tokens"], "tiers changed the tokens"
            results[name] = {"layers": layers, "file_GB": round(size / 1e9, 2),
                             "budget_GiB": round(budget / 2**30, 2), "runs": runs}  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
