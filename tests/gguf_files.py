"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, each with
its float twin: the HF state dict whose tensors are gguf-py's own dequantization of the
bytes written, so transformers on the twin is the reference psr is compared against.

Independent of psr's reader: names come from gguf-py's tensor map (as the converter's),
metadata from GGUFWriter's llama.cpp keys, and llama's q/k permutation is undone for the
twin by inverting the permutation of row indices, not by psr's formula.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from ggml_blocks import F16_SCALES, scaled_blocks
from gguf import GGMLQuantizationType as QT
from tiny_models import tiny_config

ARCH_OF = {
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "olmoe": "olmoe",
    "mixtral": "llama",
    "glm4_moe": "glm4moe",
    "gpt_oss": "gpt-oss",
    "deepseek_v3": "deepseek2",
    "deepseek_v2": "deepseek2",
}
RANDOM_ONLY = ("TQ2_0",)  # random bytes, no valid scales
# a type per tensor kind: "gate" / "up" / "down" (routed experts; "experts" for all three),
# "dense" (2-D non-expert matrices); a str, or layer -> type
TypeSpec = str | Callable[[int], str]


def gguf_tiny_model(
    family: str,
    hidden: int = 256,
    ffn: int = 256,
    layers: int = 2,
    experts: int = 4,
    vocab: int = 2112,
    seed: int = 0,
    head_dim: int | None = None,
) -> Any:
    """A tiny random transformers model of `family` sized for GGUF blocks (rows of 256)."""
    import transformers

    cfg = tiny_config(family)
    over: dict[str, Any] = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim or hidden // 4,
        vocab_size=vocab,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    over |= _family_sizes(family, ffn, experts, layers)
    for k, v in over.items():
        setattr(cfg, k, v)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 5000.0}
    if family == "gpt_oss":  # yarn as gpt-oss has it
        cfg.rope_parameters = dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            rope_theta=5000.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        )
    if family == "glm4_moe":
        cfg.rope_parameters["partial_rotary_factor"] = 0.5
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # sigmoid routers (DeepSeek-V3, GLM) milder: a sharp one makes the picked experts'
    # probabilities so small that llama.cpp's clamp of their sum (6.1e-5, F16's smallest
    # normal) changes the normalised weights, which no real model reaches
    _randomize(model, 0.05 if family in ("deepseek_v3", "glm4_moe") else 0.5)
    return model


def _family_sizes(family: str, ffn: int, experts: int, layers: int) -> dict[str, Any]:
    qwen = dict(num_experts=experts, moe_intermediate_size=ffn, mlp_only_layers=[])
    qwen |= dict(intermediate_size=3 * ffn, shared_expert_intermediate_size=2 * ffn)
    mixtral = dict(num_local_experts=experts, intermediate_size=ffn)
    deepseek = dict(
        n_routed_experts=experts,
        moe_intermediate_size=ffn,
        intermediate_size=3 * ffn,
        first_k_dense_replace=1,
        num_hidden_layers=layers + 1,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        num_key_value_heads=4,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        head_dim=32,
    )
    return {
        "qwen3_moe": qwen | dict(norm_topk_prob=True),
        "qwen2_moe": qwen | dict(norm_topk_prob=False),
        # llama.cpp's olmoe sizes k_norm by n_embd: as many KV heads as heads (OLMoE's)
        "olmoe": dict(num_experts=experts, intermediate_size=ffn, num_key_value_heads=4),
        "mixtral": mixtral,
        # layer 0 dense, q/k/v biases, q/k norms, partial rotary
        "glm4_moe": dict(
            n_routed_experts=experts,
            moe_intermediate_size=ffn,
            intermediate_size=3 * ffn,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            num_hidden_layers=layers + 1,
            attention_bias=True,
            use_qk_norm=True,
            routed_scaling_factor=2.0,
        ),
        # MLA (no q LoRA), one dense layer, shared expert; V3: sigmoid + bias, groups
        "deepseek_v3": deepseek
        | dict(n_group=2, topk_group=1, rope_interleave=True, q_lora_rank=64),
        "deepseek_v2": deepseek | dict(n_group=2, topk_group=1, topk_method="group_limited_greedy"),
        # even layers sliding (window 4), experts with biases
        "gpt_oss": mixtral
        | dict(
            sliding_window=4,
            swiglu_limit=7.0,  # llama.cpp's graph hard-codes it
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        ),
    }[family]


def _randomize(model: Any, router_std: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "router.weight")):
                p.normal_(0, router_std)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.05)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)  # not ones: a norm mapped wrong must show
            elif "bias" in name:
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)


def _type(types: str | dict[str, TypeSpec], kind: str, layer: int) -> QT:
    if isinstance(types, str):
        spec: TypeSpec = types
    else:
        keys = (kind, "experts") if kind in ("gate", "up", "down") else (kind,)
        spec = next((types[k] for k in keys if k in types), "F32")
    name = spec(layer) if callable(spec) else spec
    return QT[name]


def _random_bytes(qt: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks of a type gguf-py cannot quantize (F16_SCALES); for RANDOM_ONLY
    types, random bytes (only for tests of refusals)."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n = rows * cols // block
    if qt.name in F16_SCALES:
        raw = scaled_blocks(qt.name, n, rng)
    else:
        raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    return raw.reshape(rows, cols // block * size)


def encode(w: torch.Tensor, qt: QT, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(bytes to write, their float32 dequantization) of float tensor `w` as type `qt`."""
    a = w.detach().float().numpy()
    if qt == QT.F32:
        data = a.astype(np.float32)
        return data, data.copy()
    if qt.name in F16_SCALES or qt.name in RANDOM_ONLY:
        rows = int(np.prod(a.shape[:-1]))
        data = _random_bytes(qt, rows, a.shape[-1], rng)
        data = data.reshape(*a.shape[:-1], -1)
        if qt.name in RANDOM_ONLY:  # no valid scales: a file only to be refused
            return data, np.full(a.shape, np.nan, np.float32)
    else:
        data = gguf.quants.quantize(a, qt)
    deq = gguf.quants.dequantize(data, qt).astype(np.float32).reshape(a.shape)
    return data, deq


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF q/k rows -> GGML rope order)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _row_order(rows: int, n_head: int) -> torch.Tensor:
    """Index of each written row in the HF tensor (the permutation applied to arange)."""
    return llama_permute(torch.arange(rows, dtype=torch.float64)[:, None], n_head)[:, 0].long()


class _Writer:
    def __init__(
        self,
        model: Any,
        types: str | dict[str, TypeSpec],
        seed: int,
        mla_split: bool = True,
        nextn: bool | None = None,
    ) -> None:
        self.model, self.cfg, self.types, self.mla_split = model, model.config, types, mla_split
        # an MTP (nextn) layer after the trunk: GLM-4.5's files carry one; DeepSeek-V3's on ask
        self.nextn = self.cfg.model_type == "glm4_moe" if nextn is None else nextn
        self.arch = ARCH_OF[self.cfg.model_type]
        enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch)
        self.tmap = gguf.get_tensor_name_map(enum, self.cfg.num_hidden_layers)
        self.rng = np.random.default_rng(seed)
        self.tensors: list[tuple[str, np.ndarray, QT]] = []
        self.twin: dict[str, torch.Tensor] = {}

    def put(self, gname: str, w: torch.Tensor, qt: QT) -> torch.Tensor:
        if w.dim() == 1:
            qt = QT.F32  # llama.cpp keeps 1-D tensors (norms, biases) in F32
        data, deq = encode(w, qt, self.rng)
        self.tensors.append((gname, data, qt))
        return torch.from_numpy(deq)

    def dense(self, name: str, w: torch.Tensor) -> None:
        gname = self.tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith("mlp.gate.e_score_correction_bias"):  # the converter's own rename
            gname = f"blk.{name.split('.')[2]}.exp_probs_b.bias"
        if name.endswith("self_attn.sinks"):  # the converter adds the suffix
            gname = f"{gname}.weight"
        if name.endswith("self_attn.kv_b_proj.weight") and self.mla_split:
            self.kv_b(name, w)
            return
        if gname is None:
            raise KeyError(f"no GGUF name for {name}")
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        qt = _type(self.types, "dense", layer)
        heads = 0
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            q = "q_proj" in name
            heads = self.cfg.num_attention_heads if q else self.cfg.num_key_value_heads
        hf_shape = w.shape
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is [n_embd]
        if heads:
            deq = self.put(gname, llama_permute(w, heads), qt)
            twin = torch.empty_like(deq)
            twin[_row_order(w.shape[0], heads)] = deq
        else:
            twin = self.put(gname, w, qt)
        self.twin[name] = twin.reshape(hf_shape)

    def gpt_oss_experts(self, layer: int, prefix: str, sd: dict[str, torch.Tensor]) -> None:
        """HF gate_up_proj [E, H, 2F] (gate/up columns interleaved), down_proj [E, F, H] and
        their biases -> llama.cpp's ffn_{gate,up,down}_exps weights and biases."""
        gu, gub = sd[prefix + "gate_up_proj"].transpose(1, 2), sd[prefix + "gate_up_proj_bias"]
        down = sd[prefix + "down_proj"].transpose(1, 2)
        parts = {"gate": (gu[:, 0::2], gub[..., 0::2]), "up": (gu[:, 1::2], gub[..., 1::2])}
        parts["down"] = (down, sd[prefix + "down_proj_bias"])
        deq = {}
        for part, (w, b) in parts.items():
            qt = _type(self.types, part, layer)
            name = f"blk.{layer}.ffn_{part}_exps"
            deq[part] = self.put(name + ".weight", w.contiguous(), qt)
            self.tensors.append((name + ".bias", b.detach().float().numpy().copy(), QT.F32))
        t = torch.empty(gu.shape)
        t[:, 0::2], t[:, 1::2] = deq["gate"], deq["up"]
        self.twin[prefix + "gate_up_proj"] = t.transpose(1, 2).contiguous()
        self.twin[prefix + "down_proj"] = deq["down"].transpose(1, 2).contiguous()
        for n in ("gate_up_proj_bias", "down_proj_bias"):
            self.twin[prefix + n] = sd[prefix + n].detach().float().clone()

    def kv_b(self, name: str, w: torch.Tensor) -> None:
        """DeepSeek's kv_b_proj as the MLA converter splits it: attn_k_b [heads, rank, nope]
        (transposed) and attn_v_b [heads, v, rank]."""
        c, layer = self.cfg, int(name.split(".")[2])
        nope, vd = c.qk_nope_head_dim, c.v_head_dim
        kv = w.reshape(c.num_attention_heads, nope + vd, w.shape[-1])
        k_b, v_b = kv[:, :nope].transpose(1, 2).contiguous(), kv[:, nope:].contiguous()
        qt = _type(self.types, "dense", layer)
        dk = self.put(f"blk.{layer}.attn_k_b.weight", k_b, qt)
        dv = self.put(f"blk.{layer}.attn_v_b.weight", v_b, qt)
        self.twin[name] = torch.cat([dk.transpose(1, 2), dv], dim=1).reshape(w.shape)

    def experts(self, layer: int, prefix: str, sd: dict[str, torch.Tensor]) -> None:
        if self.arch == "gpt-oss":
            self.gpt_oss_experts(layer, prefix, sd)
            return
        gate_up, down = sd[prefix + "gate_up_proj"], sd[prefix + "down_proj"]
        F = gate_up.shape[1] // 2
        deq = {}
        for part, w in (("gate", gate_up[:, :F]), ("up", gate_up[:, F:]), ("down", down)):
            qt = _type(self.types, part, layer)
            deq[part] = self.put(f"blk.{layer}.ffn_{part}_exps.weight", w.contiguous(), qt)
        self.twin[prefix + "gate_up_proj"] = torch.cat([deq["gate"], deq["up"]], dim=1)
        self.twin[prefix + "down_proj"] = deq["down"]

    def collect(self) -> None:
        sd = dict(self.model.state_dict())
        tied = bool(self.cfg.tie_word_embeddings)
        for layer in range(self.cfg.num_hidden_layers):
            prefix = f"model.layers.{layer}.mlp.experts."
            if prefix + "down_proj" in sd:
                self.experts(layer, prefix, sd)
        for name, w in sd.items():
            if ".mlp.experts." in name or (tied and name == "lm_head.weight"):
                continue
            self.dense(name, w)
        if tied:
            self.twin["lm_head.weight"] = self.twin["model.embed_tokens.weight"]
        if self.nextn:
            self.nextn_layer(sd)

    def nextn_layer(self, sd: dict[str, torch.Tensor]) -> None:
        """An MTP layer as llama.cpp writes it after the decoder layers: the last decoder
        layer's copy as its block (written as that layer's tensors are, renamed to blk.L),
        random nextn.* tensors (psr.models.mtp reads them; the twin holds the trunk's
        tensors only). DeepSeek-V3's also carries its own embedding and head."""
        L, H = self.cfg.num_hidden_layers, self.cfg.hidden_size
        last = f"model.layers.{L - 1}."
        for name, w in sd.items():
            if name.startswith(last) and ".mlp.experts." not in name:
                n, twin = len(self.tensors), self.twin.get(name)
                self.dense(name, w)
                for i in range(n, len(self.tensors)):
                    gname, data, qt = self.tensors[i]
                    self.tensors[i] = (gname.replace(f"blk.{L - 1}.", f"blk.{L}."), data, qt)
                if twin is not None:
                    self.twin[name] = twin
        gate_up, down = sd[last + "mlp.experts.gate_up_proj"], sd[last + "mlp.experts.down_proj"]
        F = gate_up.shape[1] // 2
        for part, w in (("gate", gate_up[:, :F]), ("up", gate_up[:, F:]), ("down", down)):
            self.put(f"blk.{L}.ffn_{part}_exps.weight", w.contiguous(), QT.F32)
        gen = torch.Generator().manual_seed(L)
        own = {
            "eh_proj": torch.randn(H, 2 * H, generator=gen) * 0.05,
            "enorm": 1 + 0.1 * torch.randn(H, generator=gen),
            "hnorm": 1 + 0.1 * torch.randn(H, generator=gen),
            "shared_head_norm": 1 + 0.1 * torch.randn(H, generator=gen),
        }
        if self.cfg.model_type.startswith("deepseek"):
            V = self.cfg.vocab_size
            own["embed_tokens"] = torch.randn(V, H, generator=gen) * 0.05
            own["shared_head_head"] = torch.randn(V, H, generator=gen) * 0.05
        for part, w in own.items():
            self.put(f"blk.{L}.nextn.{part}.weight", w, QT.F32)

    def metadata(self, w: gguf.GGUFWriter) -> None:
        c = self.cfg
        w.add_name("psr tiny " + c.model_type)
        w.add_block_count(c.num_hidden_layers + self.nextn)  # + MTP layer
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_head_count(c.num_attention_heads)
        w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
        w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
        w.add_expert_used_count(c.num_experts_per_tok)
        if c.model_type.startswith("deepseek"):
            self.deepseek2_metadata(w)
            return
        w.add_head_count_kv(c.num_key_value_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        w.add_key_length(head_dim)  # OLMoE's config has none: hidden / heads
        w.add_value_length(head_dim)
        if c.model_type == "glm4_moe":
            self.glm4moe_metadata(w)
        elif c.model_type == "gpt_oss":
            r = c.rope_parameters
            w.add_expert_count(c.num_local_experts)
            w.add_expert_feed_forward_length(c.intermediate_size)
            w.add_sliding_window(c.sliding_window)
            if r["rope_type"] == "yarn":
                w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
                w.add_rope_scaling_factor(float(r["factor"]))
                w.add_rope_scaling_orig_ctx_len(int(r["original_max_position_embeddings"]))
        elif c.model_type == "mixtral":
            w.add_expert_count(c.num_local_experts)
            w.add_feed_forward_length(c.intermediate_size)
            w.add_rope_dimension_count(c.head_dim)
        elif c.model_type == "olmoe":
            w.add_expert_count(c.num_experts)
            w.add_feed_forward_length(c.intermediate_size)
        else:
            w.add_expert_count(c.num_experts)
            w.add_feed_forward_length(c.intermediate_size)
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
            if c.model_type == "qwen2_moe":
                w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)

    def deepseek2_metadata(self, w: gguf.GGUFWriter) -> None:
        """As the MLA converter writes it: the cache's sizes in key/value_length, the
        heads' in the `_mla` keys, one KV head."""
        c = self.cfg
        if self.mla_split:
            w.add_head_count_kv(1)
            w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
            w.add_value_length(c.kv_lora_rank)
            w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
            w.add_value_length_mla(c.v_head_dim)
        else:
            w.add_head_count_kv(c.num_attention_heads)
            w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
            w.add_value_length(c.v_head_dim)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        w.add_kv_lora_rank(c.kv_lora_rank)
        if c.q_lora_rank is not None:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_expert_count(c.n_routed_experts)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_expert_weights_scale(float(c.routed_scaling_factor))
        v3 = c.model_type == "deepseek_v3"
        w.add_expert_weights_norm(bool(getattr(c, "norm_topk_prob", False)))
        gating = gguf.ExpertGatingFuncType
        w.add_expert_gating_func(gating.SIGMOID if v3 else gating.SOFTMAX)
        if v3 or c.topk_method == "group_limited_greedy":
            w.add_expert_group_count(c.n_group)
            w.add_expert_group_used_count(c.topk_group)
        if self.nextn:
            w.add_nextn_predict_layers(1)

    def glm4moe_metadata(self, w: gguf.GGUFWriter) -> None:
        c = self.cfg
        w.add_expert_count(c.n_routed_experts)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(float(c.routed_scaling_factor))
        w.add_expert_weights_norm(bool(c.norm_topk_prob))
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_nextn_predict_layers(1)
        w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))


def write_tokenizer(
    w: gguf.GGUFWriter, tok: Any, rows: int, chat_template: str | None, pre: str = "gpt-2"
) -> None:
    """A byte-level BPE HF tokenizer as llama.cpp's converter writes it ("gpt2")."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = tok.get_vocab()
    if len(vocab) > rows:
        raise ValueError(f"tokenizer has {len(vocab)} tokens, the embedding {rows} rows")
    by_id = {i: t for t, i in vocab.items()}
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    tokens, kinds = [], []
    for i in range(rows):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            kinds.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(t)
            kinds.append(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_add_bos_token(False)  # as the converter writes a byte-level BPE vocabulary
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    if tok.bos_token_id is not None:
        w.add_bos_token_id(tok.bos_token_id)
    if tok.eos_token_id is not None:
        w.add_eos_token_id(tok.eos_token_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def write_gguf(
    model: Any,
    path: Path,
    types: str | dict[str, TypeSpec] = "F32",
    split: int = 1,
    seed: int = 0,
    tokenizer: Any = None,
    chat_template: str | None = None,
    omit: tuple[str, ...] = (),
    override: dict[str, int] | None = None,
    mla_split: bool = True,
    tokenizer_pre: str = "gpt-2",
    nextn: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` (a transformers model, or a folder transformers loads) to `path` as
    llama.cpp would; `split` > 1: that many parts named `STEM-0000i-of-0000N.gguf` with
    llama.cpp's split.* keys; `omit`: metadata keys left out,
    `override`: uint32 keys set to other values; `mla_split=False`: DeepSeek's
    kv_b_proj whole and head sizes in key/value_length, as converters before llama.cpp's
    MLA cache wrote them; `nextn`: an MTP layer after the trunk (default: GLM-4.5 only).
    Returns the float twin: the
    model's state dict (its live names) with every written tensor replaced by gguf-py's
    dequantization of its bytes."""
    if isinstance(model, str | Path):
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    wr = _Writer(model, types, seed, mla_split, nextn)
    wr.collect()
    per_part = -(-len(wr.tensors) // split) if split > 1 else 0
    w = gguf.GGUFWriter(path, wr.arch, split_max_tensors=per_part)
    wr.metadata(w)
    if tokenizer is not None:
        write_tokenizer(w, tokenizer, model.config.vocab_size, chat_template, tokenizer_pre)
    for key in omit:
        del w.kv_data[0][key]
    for key, value in (override or {}).items():
        w.kv_data[0][key] = gguf.gguf_writer.GGUFValue(value, gguf.GGUFValueType.UINT32)
    for gname, data, qt in wr.tensors:
        if qt in (QT.F32, QT.F16):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return wr.twin


def twin_model(model: Any, twin: dict[str, torch.Tensor]) -> Any:
    """A copy of `model` holding the twin's tensors."""
    import copy

    out = copy.deepcopy(model).eval()
    out.load_state_dict(twin, strict=True)
    return out


def hf_tokenizer(chat_template: str | None = None) -> Any:
    """psr's embedded default model's byte-level BPE tokenizer (2048 tokens), with two
    added special tokens and an optional chat template."""
    from transformers import AutoTokenizer

    from psr.models.embedded import DEFAULT_MODEL

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def fit_table() -> Any:
    """bench/fit_table.py, the header-faithful files of published models (registered in
    sys.modules first: its dataclasses need it)."""
    import importlib.util
    import sys

    name = "bench_fit_table"
    if name not in sys.modules:
        root = Path(__file__).resolve().parents[1]
        spec = importlib.util.spec_from_file_location(name, root / "bench" / "fit_table.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]
