"""llama.cpp on tests/gguf_files.py's tiny files against transformers on their float twin
and on the model psr's GGUFCheckpoint rebuilds: checks that the writer writes what llama.cpp
reads, for every architecture psr maps.

    PYTHONPATH=/path/to/llama_cpp_site .venv/bin/python bench/gguf_llamacpp.py

Needs llama-cpp-python (not a psr dependency; 0.3.36 builds from source in ~8 min, see
/work/shared/GGUF-NOTES.md). F32 tensors and an F32 KV cache, so llama.cpp and
transformers should agree to ~1e-5 (llama.cpp rounds nothing then).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# (label, family, config overrides): the tests' tiny models, and variants llama.cpp loads
FAMILIES: tuple[tuple[str, str, dict], ...] = (
    ("qwen3_moe", "qwen3_moe", {}),
    ("qwen2_moe", "qwen2_moe", {}),
    ("olmoe", "olmoe", {}),
    ("mixtral", "mixtral", {}),
    ("glm4_moe", "glm4_moe", {}),
    ("gpt_oss", "gpt_oss", {}),
    ("gpt_oss truncate", "gpt_oss", {"truncate": True}),
    ("deepseek_v3", "deepseek_v3", {}),
    ("deepseek_v2", "deepseek_v2", {}),  # no q LoRA: llama.cpp wants 27 layers then
    ("deepseek_v2 q_lora", "deepseek_v2", {"q_lora_rank": 64}),
    ("deepseek_v2 1 group", "deepseek_v2", {"q_lora_rank": 64, "n_group": 1, "topk_group": 1}),
    # quantized: llama.cpp rounds each matmul's input (Q8_0 / Q8_K), so ~1e-2 is expected
    ("qwen3_moe Q8_0", "qwen3_moe", {"types": "Q8_0"}),
    ("qwen3_moe Q4_K", "qwen3_moe", {"types": "Q4_K"}),
    ("qwen3_moe Q6_K", "qwen3_moe", {"types": "Q6_K"}),
    ("qwen3_moe Q4_K_M-like", "qwen3_moe", {"types": "mixed"}),
    ("gpt_oss MXFP4 truncate", "gpt_oss", {"types": "mxfp4", "truncate": True}),
)
TYPES = {
    "mixed": {
        "gate": "Q4_K",
        "up": "Q5_K",
        "down": lambda layer: "Q6_K" if layer == 0 else "Q8_0",
        "dense": "Q8_0",
    },
    "mxfp4": {"experts": "MXFP4", "dense": "F16"},
    "Q8_0": {"experts": "Q8_0"},
    "Q4_K": {"experts": "Q4_K"},
    "Q6_K": {"experts": "Q6_K"},
}
PROMPT = [1, 50, 7, 900, 33, 2000, 12, 5]


def llama_logits(path: Path) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(
        str(path),
        n_ctx=64,
        n_batch=64,
        logits_all=True,
        type_k=0,
        type_v=0,
        n_threads=2,
        verbose=False,
        swa_full=True,
    )
    llm.eval(PROMPT)
    out = np.array(llm.scores[: len(PROMPT)], dtype=np.float32)
    llm.close()
    return out


def _model(family: str, over: dict):  # type: ignore[no-untyped-def]
    """The tests' tiny model of `family` with `over` set in its config before it is built
    ("truncate": the twin's yarn truncation, as llama.cpp computes it)."""
    import gguf_files

    orig = gguf_files._family_sizes

    def sizes(fam: str, ffn: int, experts: int, layers: int) -> dict:
        out = orig(fam, ffn, experts, layers) | {
            k: v for k, v in over.items() if k not in ("truncate", "types")
        }
        if out.get("n_group") == 1 and fam == "deepseek_v2":
            out["topk_method"] = "greedy"
        return out

    gguf_files._family_sizes = sizes
    try:
        model = gguf_files.gguf_tiny_model(family)
    finally:
        gguf_files._family_sizes = orig
    return model


def main() -> None:
    import transformers
    from gguf_files import hf_tokenizer, twin_model, write_gguf

    from psr.models.gguf import GGUFCheckpoint

    tok = hf_tokenizer()
    x = torch.tensor([PROMPT])
    print(f"{'model':20s} {'llama.cpp vs twin':>18s} {'psr vs twin':>12s} {'|logits|':>9s}")
    with tempfile.TemporaryDirectory() as d:
        for label, fam, over in FAMILIES:
            model = _model(fam, over)
            path = Path(d) / f"{fam}.gguf"
            twin = write_gguf(model, path, TYPES.get(over.get("types", ""), "F32"), tokenizer=tok)
            ref_model = twin_model(model, twin)
            if "truncate" in over:
                cfg = model.config
                cfg.rope_parameters = dict(cfg.rope_parameters, truncate=over["truncate"])
                ref_model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
                ref_model.load_state_dict(twin)
            with torch.no_grad():
                ref = ref_model(input_ids=x).logits[0].numpy()
            ck = GGUFCheckpoint(path)
            m = transformers.AutoModelForCausalLM.from_config(ck.config).eval()
            sd = {n: ck.get(n) for n in ck.names()}
            sd |= {k: v for k, v in twin.items() if ".mlp.experts." in k and k not in sd}
            m.load_state_dict(sd, strict=True)
            with torch.no_grad():
                psr = m(input_ids=x).logits[0].numpy()
            try:
                got = llama_logits(path)
                diff = f"{np.abs(got - ref).max():18.2e}"
            except Exception as e:  # llama.cpp refused the file: say why
                diff = f"refused ({type(e).__name__})"
            print(
                f"{label:20s} {diff:>18s} {np.abs(psr - ref).max():12.2e} {np.abs(ref).max():9.3f}"
            )


if __name__ == "__main__":
    main()
