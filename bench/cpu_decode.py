"""CPU-only decoding, psr side by side with llama.cpp on one Qwen3-30B-A3B-shaped model.

    .venv/bin/python bench/cpu_decode.py [--layers 2] [--threads 1,2] [--formats bf16,int8,int4]
        [--tokens 32] [--rounds 3] [--work /tmp/psr-cpu-decode] [--out FILE.json]

The model: Qwen3-MoE with hidden 2048, 128 experts of FFN 768, top-8, 32 query / 4 KV heads
of 128, `--layers` decoder layers, a small vocabulary; random weights (std 0.02, norms 1),
written once as a bf16 safetensors checkpoint and, from the same tensors, as a GGUF file
(qwen3moe, llama.cpp's tensor names: Q8_0 experts, dense matrices F32 or BF16 by `--dense`,
written with the `gguf` package). psr: `psr.load(..., device="cpu", dtype=float32 (or
bfloat16 with --dense bf16), policy="exact",
residency=1.0)` with bf16 / int8 / int4 experts (every expert has a slot: no copies once
they are loaded); llama.cpp through `llama-cpp-python` (bench-only: `pip install -e .[bench]`).
Both decode greedily from the same prompt ids with 1 and 2 threads (psr:
torch.set_num_threads, which the CPU expert kernels follow; llama.cpp: n_threads).

Decode tok/s = N / (time from the first new token to the (N+1)-th), per run (psr: a
streamer's timestamps; llama.cpp: after each token's eval); rounds interleave every
configuration (A B A B ...) and the table shows medians. psr's MoE share is the time in
its expert calls over that same span. psr also loads the GGUF file itself ("psr Q8_0 (same
GGUF file)": the very bytes llama.cpp reads, through psr's GGML CPU kernels). `--torch-experts`
adds psr with PSR_CPU_EXPERTS=torch (the old reference path) for A/B. On a shared
machine the figures are noisy: the machine's load (`uptime`) is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

SHAPE = dict(
    hidden_size=2048,
    moe_intermediate_size=768,
    intermediate_size=6144,
    num_experts=128,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=4096,
)


def _config(layers: int, vocab: int) -> dict[str, Any]:
    return dict(
        SHAPE,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_hidden_layers=layers,
        vocab_size=vocab,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        attention_bias=False,
    )


def _layer_tensors(i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer's HF tensors (bf16), per-expert names."""
    H, F, E = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    nq, nkv, hd = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    p = f"model.layers.{i}."

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).bfloat16()

    t = {
        p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        p + "self_attn.q_proj.weight": rnd(nq * hd, H),
        p + "self_attn.k_proj.weight": rnd(nkv * hd, H),
        p + "self_attn.v_proj.weight": rnd(nkv * hd, H),
        p + "self_attn.o_proj.weight": rnd(H, nq * hd),
        p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
        p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
        p + "mlp.gate.weight": rnd(E, H),
    }
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        t[q + "gate_proj.weight"] = rnd(F, H)
        t[q + "up_proj.weight"] = rnd(F, H)
        t[q + "down_proj.weight"] = rnd(H, F)
    return t


def write_checkpoint(path: Path, layers: int, vocab: int) -> None:
    """A sharded bf16 safetensors checkpoint (one shard per layer) + config.json."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    H = SHAPE["hidden_size"]
    shards = [(f"model-{i:05d}.safetensors", _layer_tensors(i, gen)) for i in range(layers)]
    top = {
        "model.embed_tokens.weight": (torch.randn(vocab, H, generator=gen) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(vocab, H, generator=gen) * 0.02).bfloat16(),
    }
    shards.append(("model-top.safetensors", top))
    index: dict[str, str] = {}
    for name, tensors in shards:
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        index |= {k: name for k in tensors}
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1)
    )
    (path / "config.json").write_text(json.dumps(_config(layers, vocab), indent=1))


# Expert types gguf-py cannot quantize (K-quants): random valid blocks instead, their
# super-block scales small enough that the weights stay near the checkpoint's magnitude.
K_QUANTS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def _expert_parts(gguf_type: str) -> tuple[str, str, str]:
    """The gate / up / down types of an expert type name (Q4_K_M: Q4_K, Q4_K, Q6_K)."""
    return ("Q4_K", "Q4_K", "Q6_K") if gguf_type == "Q4_K_M" else (gguf_type,) * 3


def _experts_bytes(stack: Any, t: str, seed: int) -> Any:
    """`stack` [E, rows, cols] fp32 as GGML blocks of type t: gguf-py's quantizer, or for a
    K-quant random valid blocks of the same shape (random weights either way)."""
    import gguf
    import numpy as np

    qt = gguf.GGMLQuantizationType[t]
    if t not in K_QUANTS:
        return gguf.quants.quantize(stack, qt)
    bs, scales = K_QUANTS[t]
    E, R, C = stack.shape
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(E, R, C // 256, bs), dtype=np.uint8)
    for at in scales:
        d = (rng.random((E, R, C // 256)) * 4e-5 + 1e-5).astype(np.float16)
        b[..., at : at + 2] = d.view(np.uint8).reshape(E, R, C // 256, 2)
    return b.reshape(E, R, -1)


def write_gguf(
    ckpt: Path, out: Path, layers: int, vocab: int, dense: str, experts: str = "Q8_0"
) -> None:
    """The checkpoint's tensors as a llama.cpp qwen3moe GGUF: experts of type `experts`
    (Q8_0 and the other 32-blocks quantized from the checkpoint; K-quants random, see
    _experts_bytes), the dense matrices F32 or BF16 (`dense`; norms F32)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    files = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]

    def get(name: str) -> np.ndarray:
        with safe_open(str(ckpt / files[name]), "pt") as f:
            return f.get_tensor(name).float().numpy()

    def add_dense(name: str, src: str) -> None:
        if dense == "f32" or src.endswith("norm.weight"):
            w.add_tensor(name, get(src))
        else:  # bf16 bits as uint16 (the checkpoint's values exactly)
            with safe_open(str(ckpt / files[src]), "pt") as f:
                bits = f.get_tensor(src).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)

    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_context_length(SHAPE["max_position_embeddings"])
    w.add_embedding_length(SHAPE["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(SHAPE["intermediate_size"])
    w.add_head_count(SHAPE["num_attention_heads"])
    w.add_head_count_kv(SHAPE["num_key_value_heads"])
    w.add_key_length(SHAPE["head_dim"])
    w.add_value_length(SHAPE["head_dim"])
    w.add_rope_freq_base(SHAPE["rope_theta"])
    w.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    w.add_expert_count(SHAPE["num_experts"])
    w.add_expert_used_count(SHAPE["num_experts_per_tok"])
    w.add_expert_feed_forward_length(SHAPE["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)  # the experts' (the bulk of the bytes)
    # An SPM vocabulary: specials, the 256 byte tokens llama.cpp looks up, fillers.
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    toks += [f"t{i}" for i in range(vocab - len(toks))]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    add_dense("token_embd.weight", "model.embed_tokens.weight")
    add_dense("output_norm.weight", "model.norm.weight")
    add_dense("output.weight", "lm_head.weight")
    names = dict(
        attn_norm="input_layernorm", ffn_norm="post_attention_layernorm",
        attn_q="self_attn.q_proj", attn_k="self_attn.k_proj", attn_v="self_attn.v_proj",
        attn_output="self_attn.o_proj", attn_q_norm="self_attn.q_norm",
        attn_k_norm="self_attn.k_norm", ffn_gate_inp="mlp.gate",
    )  # fmt: skip
    E = SHAPE["num_experts"]
    for i in range(layers):
        for g, h in names.items():
            add_dense(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight")
        parts = zip(("gate", "up", "down"), ("gate_proj", "up_proj", "down_proj"), strict=True)
        for (g, h), t in zip(parts, _expert_parts(experts), strict=True):
            key = f"model.layers.{i}.mlp.experts.{{}}.{h}.weight"
            stack = np.stack([get(key.format(e)) for e in range(E)])
            w.add_tensor(
                f"blk.{i}.ffn_{g}_exps.weight",
                _experts_bytes(stack, t, seed=1000 * i + len(g)),  # bytes [E, rows, blocks]
                raw_dtype=gguf.GGMLQuantizationType[t],
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class _Timed:
    """Wraps the runtime's expert call: its total time (the MoE share)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0


class PsrRun:
    def __init__(
        self,
        ckpt: Path,
        fmt: str | None,
        torch_experts: bool,
        dtype: torch.dtype,
        graphs: bool = False,
    ) -> None:
        import psr

        os.environ["PSR_CPU_EXPERTS"] = "torch" if torch_experts else "auto"
        self.model = psr.load(
            str(ckpt),
            "exact",
            residency=1.0,
            device="cpu",
            dtype=dtype,
            expert_format=fmt,
            progress=False,
            graphs=graphs,
        )  # fmt: skip  (fmt None for a GGUF file: its own blocks)
        os.environ.pop("PSR_CPU_EXPERTS")
        # The MoE share: the experts' calls timed (eager only: a timer in a compiled
        # forward would break the graph).
        self.timer: _Timed | None = None
        if not graphs:
            comp = self.model.runtime.compute
            self.timer = _Timed(comp.slab)
            comp.slab = self.timer
        self.warm: set[int] = set()

    def decode(self, prompt: list[int], n: int, threads: int) -> tuple[float, float, list[int]]:
        """(tok/s, MoE share, tokens) of n decode tokens after the prompt and first token,
        timed between the streamer's first and last new token."""
        torch.set_num_threads(threads)
        ids = torch.tensor([prompt])
        if threads not in self.warm:  # the first run loads every expert it routes to
            self.model.generate(ids, max_new_tokens=n + 1)
            self.warm.add(threads)
        clock = _Clock(self.timer)
        out = self.model.generate(ids, max_new_tokens=n + 1, streamer=clock)
        dec, moe = clock.span()
        share = moe / dec if self.timer else float("nan")
        return n / dec, share, out[0, len(prompt) :].tolist()


class _Clock:
    """A transformers-style streamer: (wall, MoE) time at each new token (the first put is
    the prompt)."""

    def __init__(self, timer: _Timed | None = None) -> None:
        self.timer, self.marks = timer, []

    def put(self, value: Any) -> None:
        self.marks.append((time.perf_counter(), self.timer.seconds if self.timer else 0.0))

    def end(self) -> None:
        pass

    def span(self) -> tuple[float, float]:
        """Wall and MoE seconds from the first new token to the last."""
        (t0, m0), (t1, m1) = self.marks[1], self.marks[-1]
        return t1 - t0, m1 - m0


class LlamaRun:
    def __init__(self, gguf_path: Path, threads: list[int]) -> None:
        from llama_cpp import Llama

        kw = dict(model_path=str(gguf_path), n_ctx=512, n_batch=64, verbose=False)
        self.llm = {t: Llama(n_threads=t, n_threads_batch=t, **kw) for t in threads}
        self.warm: set[int] = set()

    def _gen(self, llm: Any, prompt: list[int], n: int, clock: _Clock) -> list[int]:
        """n greedy tokens; the clock marks the prompt and each new token's logits."""
        import numpy as np

        llm.reset()
        llm.eval(prompt)
        clock.put(None)
        out = []
        for i in range(n):
            tok = int(np.argmax(llm.eval_logits[-1]))
            out.append(tok)
            clock.put(tok)
            if i + 1 < n:
                llm.eval([tok])
        return out

    def decode(self, prompt: list[int], n: int, threads: int) -> tuple[float, float, list[int]]:
        llm = self.llm[threads]
        if threads not in self.warm:
            self._gen(llm, prompt, n + 1, _Clock())
            self.warm.add(threads)
        clock = _Clock()
        out = self._gen(llm, prompt, n + 1, clock)
        return n / clock.span()[0], float("nan"), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--torch-experts", default="", help="formats also run on psr's torch reference path"
    )
    ap.add_argument("--dense", choices=["f32", "bf16"], default="f32", help="dense weights")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-gguf-psr", action="store_true", help="skip psr on the GGUF file")
    ap.add_argument(
        "--gguf-experts",
        default="Q8_0",
        help="expert types of the GGUF files (one file each): Q8_0, Q4_0, MXFP4, ... from the "
        "checkpoint; Q4_K, Q5_K, Q6_K, Q4_K_M random valid blocks",
    )
    ap.add_argument(
        "--graphs", action="store_true", help="each psr run also with graphs=True (compiled)"
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/psr-cpu-decode"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    ckpt = a.work / f"qwen3moe-{a.layers}l"
    if not (ckpt / "config.json").exists():
        print(f"writing {ckpt}", flush=True)
        write_checkpoint(ckpt, a.layers, a.vocab)
    runs: dict[str, Any] = {}
    for et in a.gguf_experts.split(",") if not a.no_llama else []:
        gg = a.work / f"qwen3moe-{a.layers}l-{a.dense}-{et.lower()}.gguf"
        if not gg.exists():
            print(f"writing {gg}", flush=True)
            write_gguf(ckpt, gg, a.layers, a.vocab, a.dense, et)
        runs[f"llama.cpp {et}"] = LlamaRun(gg, threads)
        if not a.no_gguf_psr:  # psr on the very same file: the same expert bytes
            dt = torch.float32 if a.dense == "f32" else torch.bfloat16
            runs[f"psr {et} (same GGUF file)"] = PsrRun(gg, None, False, dt)
            if a.graphs:
                runs[f"psr {et} (same GGUF file) graphs"] = PsrRun(gg, None, False, dt, True)
    dtype = torch.float32 if a.dense == "f32" else torch.bfloat16
    for fmt in a.formats.split(",") if a.formats else []:
        runs[f"psr {fmt}"] = PsrRun(ckpt, fmt, False, dtype)
        if a.graphs:
            runs[f"psr {fmt} graphs"] = PsrRun(ckpt, fmt, False, dtype, True)
        if fmt in a.torch_experts.split(","):
            runs[f"psr {fmt} (torch experts)"] = PsrRun(ckpt, fmt, True, dtype)
    prompt = list(range(300, 308))
    res: dict[tuple[str, int], list[tuple[float, float]]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(a.rounds):
        for t in threads:
            for name, run in runs.items():
                tps, share, toks = run.decode(prompt, a.tokens, t)
                res.setdefault((name, t), []).append((tps, share))
                if tokens.setdefault((name, t), toks) != toks:
                    raise SystemExit(f"{name} at {t} threads: tokens differ between rounds")
    _report(a, res, threads)


def _report(a: argparse.Namespace, res: dict, threads: list[int]) -> None:
    load = os.getloadavg()
    print(
        f"# Qwen3-30B-A3B-shaped, {a.layers} layers, random weights; {a.tokens} decode tokens; "
        f"medians of {a.rounds} interleaved rounds; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print("| runtime | threads | tok/s | vs llama.cpp | MoE share |")
    print("|---|---|---|---|---|")
    rows = []
    for (name, t), v in res.items():
        tps = statistics.median(x[0] for x in v)
        share = statistics.median(x[1] for x in v)
        # A GGUF run against llama.cpp on its file; the checkpoint's formats against the
        # first file's (Q8_0 by default: the same weights).
        same = name.removeprefix("psr ").removesuffix(" graphs").removesuffix(" (same GGUF file)")
        first = a.gguf_experts.split(",")[0]
        ref = res.get((f"llama.cpp {same if 'GGUF' in name else first}", t))
        ratio = tps / statistics.median(x[0] for x in ref) if ref else float("nan")
        rows.append(dict(runtime=name, threads=t, tok_s=tps, vs_llama=ratio, moe_share=share))
        sh = "" if share != share else f"{share:.0%}"
        print(f"| {name} | {t} | {tps:.1f} | {ratio:.2f}x | {sh} |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(load=load, args={k: str(v) for k, v in vars(a).items()})
        a.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
