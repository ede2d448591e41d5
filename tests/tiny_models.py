"""Tiny random checkpoints of every supported family, written by transformers itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def tiny_config(family: str):
    import transformers

    if family == "olmoe":
        return transformers.OlmoeConfig(
            **COMMON,
            intermediate_size=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
        )
    if family == "qwen2_moe":  # layer 1 dense: "the next MoE layer" skips it
        return transformers.Qwen2MoeConfig(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=8,
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **COMMON,
            intermediate_size=16,
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
    if family == "deepseek_v3":  # layer 0 dense, group-limited sigmoid router, shared expert
        cfg = dict(COMMON, num_key_value_heads=4)
        return transformers.DeepseekV3Config(
            **cfg,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=4,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            routed_scaling_factor=2.0,
            norm_topk_prob=True,
            rope_interleave=False,
        )
    return _new_family_config(family)


def _new_family_config(family: str):
    """The families added with the family table (tests/runtime/test_families.py)."""
    import transformers

    mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8)
    groups = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)
    linear_attn = dict(
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )
    cfgs = {
        # hybrid attention, sigmoid-gated shared expert, one dense layer (mlp_only_layers)
        "qwen3_next": lambda: transformers.Qwen3NextConfig(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=8,
            mlp_only_layers=[1],
            **linear_attn,
        ),
        "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(
            **COMMON,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=8,
            **linear_attn,
        ),
        "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(
            **COMMON,
            intermediate_size=16,
            num_hidden_layers=3,
            num_experts=8,
            moe_topk=2,
            head_dim=8,
        ),
        "granitemoe": lambda: transformers.GraniteMoeConfig(
            **COMMON,
            intermediate_size=16,
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        "glm4_moe": lambda: transformers.Glm4MoeConfig(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=4,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.0,
            norm_topk_prob=True,
            head_dim=8,
            **groups,
        ),
        "dots1": lambda: transformers.Dots1Config(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            head_dim=8,
            **groups,
        ),
        "minimax_m2": lambda: transformers.MiniMaxM2Config(
            **COMMON,
            intermediate_size=16,
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=8,
        ),
        # softmax with DeepSeek-V2's group_limited_greedy (group score: the maximum)
        "deepseek_v2": lambda: transformers.DeepseekV2Config(
            **dict(COMMON, num_key_value_heads=4),
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            n_shared_experts=1,
            v_head_dim=8,
            **mla,
        ),
        # sliding-window + full attention with sinks; clamped SwiGLU experts with biases
        "gpt_oss": lambda: transformers.GptOssConfig(
            **COMMON,
            intermediate_size=16,
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=4,
            swiglu_limit=1.5,
        ),
        "phimoe": lambda: transformers.PhimoeConfig(
            **COMMON,
            intermediate_size=16,
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_jitter_noise=0.3,  # the threshold masks some experts at this scale
        ),
        # top-1 sigmoid router scaling the experts' input; shared expert; every 2nd layer MoE
        "llama4_text": lambda: transformers.Llama4TextConfig(
            **COMMON,
            intermediate_size=16,
            intermediate_size_mlp=48,
            num_hidden_layers=4,
            num_local_experts=8,
            num_experts_per_tok=1,
            head_dim=8,
            interleave_moe_layer_step=2,
        ),
        "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=2,
        ),
    }
    if family not in cfgs:
        raise KeyError(family)
    return cfgs[family]()


FAMILIES = ("olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
# The families added with the family table: tested in tests/runtime/test_families.py (the
# five above run through every runtime test).
NEW_FAMILIES = (
    "qwen3_next",
    "qwen3_5_moe_text",
    "hunyuan_v1_moe",
    "granitemoe",
    "glm4_moe",
    "dots1",
    "minimax_m2",
    "deepseek_v2",
    "ernie4_5_moe",
    "gpt_oss",
    "phimoe",
    "llama4_text",
)


def _kv_kwarg() -> str:
    """transformers >= 5.24 names the KV-cache argument `cache`, earlier `past_key_values`."""
    import inspect

    import transformers

    params = inspect.signature(transformers.OlmoeForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


KV_KWARG = _kv_kwarg()


# The router weights of the families (sharpened so routing is decisive).
ROUTER_WEIGHTS = ("mlp.gate.weight", "router.weight", "gate.wg.weight")


def tiny_model(family: str, seed: int = 0, **config: Any):
    """A random model whose routers are sharp enough for routing choices to matter
    (`config`: fields of tiny_config's changed, e.g. a longer max_position_embeddings)."""
    import transformers

    cfg = tiny_config(family)
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ROUTER_WEIGHTS):
                p.normal_(0, 0.5)
            elif name.endswith("e_score_correction_bias"):  # ERNIE's is a parameter
                p.normal_(0, 0.05)
            elif name.endswith("mlp.router.bias"):  # gpt-oss's router has a bias
                p.normal_(0, 0.3)
            elif "experts" in name or "embed" in name or "lm_head" in name:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model


def write_checkpoint(model, path: Path, layout: str = "per_expert", **save_kw) -> Path:
    """`per_expert`: transformers' save_pretrained (original per-expert names);
    `fused`: the live state dict (experts.gate_up_proj / down_proj) as one safetensors file."""
    path.mkdir(parents=True, exist_ok=True)
    if layout == "per_expert":
        model.save_pretrained(path, **save_kw)
    else:
        model.config.save_pretrained(path)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_layouts(families, root: Path) -> dict[tuple[str, str], Path]:
    """(family, layout) -> a checkpoint folder of each family's tiny model in both expert
    layouts (`write_checkpoint`'s per_expert and fused)."""
    out = {}
    for fam in families:
        model = tiny_model(fam)
        for layout in ("per_expert", "fused"):
            out[fam, layout] = write_checkpoint(model, root / f"{fam}-{layout}", layout)
    return out


def hf_references(ckpts, families, prompt, new_tokens: int):  # type: ignore[no-untyped-def]
    """transformers' own (logits of `prompt`, greedy tokens) per family, from its
    per-expert checkpoint in `ckpts` (`write_layouts`)."""
    import transformers

    refs = {}
    for fam in families:
        m = transformers.AutoModelForCausalLM.from_pretrained(ckpts[fam, "per_expert"]).eval()
        with torch.no_grad():
            logits = m(input_ids=prompt).logits
            toks = m.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        refs[fam] = (logits, toks)
    return refs


def write_tokenizer(path: Path, vocab_size: int = 64) -> None:
    """A character-level tokenizer (letters, digits, punctuation), saved beside the checkpoint."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(" " + string.ascii_lowercase + string.ascii_uppercase + ".,!?")[: vocab_size - 1]
    vocab = {"<unk>": 0} | {c: i + 1 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def bench_module(name: str):  # type: ignore[no-untyped-def]
    """A script of bench/ imported by path (bench is not a package): tests of the research
    variants and GPU stages use its classes."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[1] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))  # its own sibling imports
    spec = importlib.util.spec_from_file_location(f"bench_{name}", bench / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Stubborn:
    """A speculative drafter (psr.runtime.speculative.Drafter) that always drafts the last
    token and 1: mostly rejected, so verify blocks emit about one token each."""

    kind, block, memory_bytes = "stubborn", 2, 0

    def reset(self) -> None:
        pass

    def propose(self, tokens: list[int], hidden: Any) -> list[int]:
        return [tokens[-1], 1]
