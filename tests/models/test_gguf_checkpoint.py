"""psr.models.gguf.GGUFCheckpoint on tiny GGUF files written like llama.cpp's converter
(tests/gguf_files.py): config mapping, dense tensors and raw expert bytes against the float
twin and gguf-py, logits of the model rebuilt from the file, tokenizer, split sets, and the
one-line refusals of bad input."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_files import (
    gguf_tiny_model,
    hf_tokenizer,
    llama_permute,
    twin_model,
    write_gguf,
)
from procfs import rss_bytes

from psr.models.gguf import EXPERT_TYPES, GGUFCheckpoint, GGUFError

FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "deepseek_v3",
    "deepseek_v2",
)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Q4_K_M-like: K-quant experts, down projections Q6_K in layer 0 and Q8_0 in layer 1,
# dense matrices Q8_0
MIXED = {
    "gate": "Q4_K",
    "up": "Q5_K",
    "down": lambda layer: "Q6_K" if layer == 0 else "Q8_0",
    "dense": "Q8_0",
}
_DEEPSEEK = [
    "n_routed_experts",
    "moe_intermediate_size",
    "intermediate_size",
    "first_k_dense_replace",
    "n_shared_experts",
    "routed_scaling_factor",
    "norm_topk_prob",
    "n_group",
    "topk_group",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
]
PROMPT = torch.tensor([[1, 50, 7, 900, 33, 2000, 12, 5]])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object, dict]]:
    """family -> (mixed-type file, source model, twin)."""
    root = tmp_path_factory.mktemp("gguf")
    tok = hf_tokenizer(TEMPLATE)
    out = {}
    for fam in FAMILIES:
        model = gguf_tiny_model(fam, head_dim=32 if fam == "qwen3_moe" else None)
        path = root / f"{fam}.gguf"
        twin = write_gguf(model, path, MIXED, tokenizer=tok, chat_template=TEMPLATE)
        out[fam] = (path, model, twin)
    return out


def _deq(t: torch.Tensor, ggml_type: str, rows: int) -> torch.Tensor:
    """gguf-py's dequantization of one expert's bytes as [rows, in]."""
    arr = gguf.quants.dequantize(t.numpy().reshape(rows, -1), QT[ggml_type])
    return torch.from_numpy(np.array(arr, dtype=np.float32))


def _expert_state(ck: GGUFCheckpoint, d: int) -> dict[str, torch.Tensor]:
    """Layer `d`'s experts in the HF model's layout, from their dequantized bytes."""
    et = ck.expert_tensors(d)
    deq = {
        p: torch.stack([_deq(t.expert(e), t.ggml_type, t.shape[1]) for e in range(t.shape[0])])
        for p, t in et.items()
    }
    p = f"model.layers.{d}.mlp.experts."
    if ck.arch == "gpt-oss":  # gate_up_proj [E, H, 2F], columns interleaved; down [E, F, H]
        gu = torch.empty(deq["gate"].shape[0], 2 * deq["gate"].shape[1], deq["gate"].shape[2])
        gu[:, 0::2], gu[:, 1::2] = deq["gate"], deq["up"]
        return {
            p + "gate_up_proj": gu.transpose(1, 2),
            p + "down_proj": deq["down"].transpose(1, 2),
        }
    return {
        p + "gate_up_proj": torch.cat([deq["gate"], deq["up"]], 1),
        p + "down_proj": deq["down"],
    }


def _rebuilt(ck: GGUFCheckpoint, unpermute: bool = True):  # type: ignore[no-untyped-def]
    """transformers' model from psr's config + dense tensors + the experts' dequantized
    bytes (as the lead's kernels will see them)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(ck.config).eval()
    sd = {n: ck.get(n) for n in ck.names()}
    if not unpermute:  # the file's rows as they are: what a loader that forgot would read
        for n in sd:
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                q = "q_proj" in n
                heads = ck.config_dict["num_attention_heads" if q else "num_key_value_heads"]
                sd[n] = llama_permute(sd[n], heads)
    for d in ck.moe_layers():
        sd |= _expert_state(ck, d)
    model.load_state_dict(sd, strict=True)
    return model


# --- config ---------------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAMILIES)
def test_config_mapping(files: dict, fam: str) -> None:
    path, model, _ = files[fam]
    ck = GGUFCheckpoint(path)
    src, cfg = model.config, ck.config
    assert cfg.model_type == fam
    keys = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts_per_tok",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
    ]
    keys += {
        "qwen3_moe": ["num_experts", "moe_intermediate_size", "norm_topk_prob"],
        "qwen2_moe": [
            "num_experts",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
        ],
        "olmoe": ["num_experts", "intermediate_size", "norm_topk_prob"],
        "mixtral": ["num_local_experts", "intermediate_size"],
        "deepseek_v3": [*_DEEPSEEK, "rope_interleave"],
        "deepseek_v2": [*_DEEPSEEK, "topk_method"],
        "gpt_oss": [
            "num_local_experts",
            "intermediate_size",
            "sliding_window",
            "layer_types",
            "swiglu_limit",
            "swiglu_alpha",
            "attention_bias",
        ],
        "glm4_moe": [
            "n_routed_experts",
            "moe_intermediate_size",
            "intermediate_size",
            "first_k_dense_replace",
            "n_shared_experts",
            "routed_scaling_factor",
            "norm_topk_prob",
            "n_group",
            "topk_group",
            "attention_bias",
            "use_qk_norm",
        ],
    }[fam]
    for k in keys:
        assert getattr(cfg, k) == getattr(src, k), k
    assert cfg.rope_parameters == src.rope_parameters
    assert ck.config_dict["dtype"] == "float32"
    assert ck.unmapped == []  # GLM's MTP layer too (psr.models.mtp reads it)
    dense = getattr(src, "first_k_dense_replace", 0)  # GLM: leading dense layers
    assert ck.moe_layers() == list(range(dense, src.num_hidden_layers))  # GLM: MTP skipped


def test_qwen3moe_config_where_transformers_is_wrong(files: dict) -> None:
    """qwen3moe: the expert FFN size comes from expert_feed_forward_length (transformers'
    GGUF loader falls back to 768), head_dim from attention.key_length (here 32, not
    hidden / heads = 64), norm_topk_prob True (llama.cpp always renormalises)."""
    import transformers

    path, model, _ = files["qwen3_moe"]
    cfg = GGUFCheckpoint(path).config
    assert cfg.moe_intermediate_size == model.config.moe_intermediate_size == 256
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
    assert cfg.norm_topk_prob is True
    theirs = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert theirs.moe_intermediate_size != 256  # transformers 5.24: its default, 768


def test_unsupported_llama_without_experts_and_other_arch(tmp_path: Path) -> None:
    for arch in ("llama", "bert"):
        p = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(p, arch)
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(GGUFError, match=r"not supported by psr; supported: qwen3moe") as e:
            GGUFCheckpoint(p)
        assert str(p) in str(e.value) and "\n" not in str(e.value)


# --- tensors --------------------------------------------------------------------------


@pytest.mark.parametrize("dense", ["F32", "F16", "BF16", "Q8_0", "Q4_K"])
def test_dense_tensors_equal_twin(tmp_path: Path, dense: str) -> None:
    model = gguf_tiny_model("qwen2_moe", layers=1)
    twin = write_gguf(model, tmp_path / "m.gguf", {"dense": dense, "experts": "F16"})
    ck = GGUFCheckpoint(tmp_path / "m.gguf")
    expert_names = [n for n in twin if ".mlp.experts." in n]
    assert not set(expert_names) & set(ck.names())
    assert set(ck.names()) == set(twin) - set(expert_names)
    for n in ck.names():
        got = ck.get(n)
        assert got.dtype == torch.float32 and list(got.shape) == ck.shape(n) == list(twin[n].shape)
        assert torch.equal(got, twin[n]), n  # bitwise: twin = gguf-py's dequantization
        matrix = twin[n].dim() > 1 and not n.endswith("shared_expert_gate.weight")  # 1-D in GGUF
        assert ck.dtype(n) == (dense if matrix else "F32")
        ck.require_float(n)
        if twin[n].dim() > 1:
            i = twin[n].shape[0] - 1
            assert torch.equal(ck.get_row(n, i), twin[n][i])
    assert ck.first("nope", "model.norm.weight") == "model.norm.weight"


@pytest.mark.parametrize("qtype", EXPERT_TYPES)
def test_expert_bytes_and_dequantization(tmp_path: Path, qtype: str) -> None:
    model = gguf_tiny_model("qwen3_moe", layers=1)
    path = tmp_path / "m.gguf"
    twin = write_gguf(model, path, {"experts": qtype})
    ck = GGUFCheckpoint(path)
    ref = gguf.GGUFReader(path)  # an independent read of the same file
    by_name = {t.name: t for t in ref.tensors}
    et = ck.expert_tensors(0)
    gate_up = twin["model.layers.0.mlp.experts.gate_up_proj"]
    F = gate_up.shape[1] // 2
    want = {"gate": gate_up[:, :F], "up": gate_up[:, F:]}
    want["down"] = twin["model.layers.0.mlp.experts.down_proj"]
    for part, t in et.items():
        assert t.ggml_type == qtype and t.name == f"blk.0.ffn_{part}_exps.weight"
        assert t.shape == tuple(want[part].shape)
        file_bytes = np.asarray(by_name[t.name].data).view(np.uint8).reshape(t.shape[0], -1)
        assert t.row_bytes == file_bytes.shape[1]
        for e in range(t.shape[0]):
            b = t.expert(e)
            assert b.dtype == torch.uint8 and b.dim() == 1 and b.numel() == t.row_bytes
            assert np.array_equal(b.numpy(), file_bytes[e])
            assert torch.equal(_deq(b, qtype, t.shape[1]), want[part][e])
            assert torch.equal(t.dequantize(e), want[part][e])
        # zero-copy: two views of one expert share the mapped file's memory
        assert t.expert(1).data_ptr() == t.expert(1).data_ptr() != t.expert(0).data_ptr()
    assert "model.layers.0.mlp.experts.down_proj" not in ck
    with pytest.raises(IndexError):
        et["gate"].expert(4)


@pytest.mark.parametrize("fam", FAMILIES)
def test_rebuilt_model_matches_twin(files: dict, fam: str) -> None:
    """Names, shapes, the shared expert, tied/untied head and (llama) the q/k
    un-permutation: the model rebuilt from the file gives the twin's logits."""
    path, model, twin = files[fam]
    ck = GGUFCheckpoint(path)
    for n in ck.names():  # gpt-oss: the expert biases too (dense, under their HF names)
        assert torch.equal(ck.get(n), twin[n]), n
    if fam == "gpt_oss":
        assert "model.layers.1.mlp.experts.gate_up_proj_bias" in ck.names()
    with torch.no_grad():
        ref = twin_model(model, twin)(input_ids=PROMPT).logits
        got = _rebuilt(ck)(input_ids=PROMPT).logits
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        if fam == "mixtral":  # without un-permuting q/k the rotary pairs are wrong
            wrong = _rebuilt(ck, unpermute=False)(input_ids=PROMPT).logits
            assert (wrong - ref).abs().max() > 1e-2


def test_q4_k_m_like_with_ffn_not_a_multiple_of_256(tmp_path: Path) -> None:
    """Expert FFN 320: gate/up (rows of H=256) Q4_K, down (rows of 320) Q8_0, per tensor."""
    model = gguf_tiny_model("qwen3_moe", ffn=320)
    types = {"gate": "Q4_K", "up": "Q4_K", "down": "Q8_0", "dense": "Q6_K"}
    twin = write_gguf(model, tmp_path / "m.gguf", types)
    ck = GGUFCheckpoint(tmp_path / "m.gguf")
    et = ck.expert_tensors(1)
    assert {p: t.ggml_type for p, t in et.items()} == {"gate": "Q4_K", "up": "Q4_K", "down": "Q8_0"}
    assert et["down"].shape == (4, 256, 320) and et["down"].row_bytes == 256 * 320 // 32 * 34
    assert ck.dtype("model.layers.0.self_attn.q_proj.weight") == "Q6_K"
    with torch.no_grad():
        ref = twin_model(model, twin)(input_ids=PROMPT).logits
        torch.testing.assert_close(_rebuilt(ck)(input_ids=PROMPT).logits, ref, rtol=1e-5, atol=1e-5)


def test_deepseek_file_without_mla_split(tmp_path: Path) -> None:
    """Older converters: kv_b_proj whole (attn_kv_b), head sizes in key/value_length."""
    model = gguf_tiny_model("deepseek_v3")
    twin = write_gguf(model, tmp_path / "d.gguf", MIXED, mla_split=False)
    ck = GGUFCheckpoint(tmp_path / "d.gguf")
    assert ck.gguf_name("model.layers.1.self_attn.kv_b_proj.weight") == "blk.1.attn_kv_b.weight"
    assert ck.config.qk_nope_head_dim == 32 and ck.config.v_head_dim == 32
    with torch.no_grad():
        ref = twin_model(model, twin)(input_ids=PROMPT).logits
        torch.testing.assert_close(_rebuilt(ck)(input_ids=PROMPT).logits, ref, rtol=1e-5, atol=1e-5)


def test_tied_embeddings(tmp_path: Path) -> None:
    model = gguf_tiny_model("olmoe", layers=1)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    twin = write_gguf(model, tmp_path / "t.gguf", {"experts": "Q8_0"})
    ck = GGUFCheckpoint(tmp_path / "t.gguf")
    assert ck.config.tie_word_embeddings is True and "lm_head.weight" not in ck
    m = _rebuilt_tied(ck)
    with torch.no_grad():
        ref = twin_model(model, twin)(input_ids=PROMPT).logits
        torch.testing.assert_close(m(input_ids=PROMPT).logits, ref, rtol=1e-5, atol=1e-5)


def _rebuilt_tied(ck: GGUFCheckpoint):  # type: ignore[no-untyped-def]
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(ck.config).eval()
    sd = {n: ck.get(n) for n in ck.names()}
    for d in ck.moe_layers():
        sd |= _expert_state(ck, d)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    model.tie_weights()
    return model


# --- tokenizer ------------------------------------------------------------------------


def test_tokenizer_round_trip(files: dict) -> None:
    path, _, _ = files["qwen3_moe"]
    src = hf_tokenizer(TEMPLATE)
    ck = GGUFCheckpoint(path)
    tok = ck.tokenizer()
    texts = [
        "To be, or not to be: that is the question.",
        "  leading spaces\tand\ttabs\nnew lines 12345 ünïcödé 日本",
        "<|im_start|>user\nhello<|im_end|>",
    ]
    for s in texts:
        ids = src(s)["input_ids"]
        assert tok(s)["input_ids"] == ids
        assert tok.decode(ids) == src.decode(ids)
    assert ck.chat_template == TEMPLATE == tok.chat_template
    msgs = [{"role": "user", "content": "Hi there"}]
    a = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert a == src.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.eos_token == src.eos_token and tok.bos_token == src.bos_token


def test_tokenizer_unknown_pre_warns(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    model = gguf_tiny_model("qwen3_moe", layers=1)
    write_gguf(model, p, "F32", tokenizer=hf_tokenizer(), tokenizer_pre="no-such-pre")
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre='no-such-pre' is not known"):
        GGUFCheckpoint(p).tokenizer()


# --- split files ----------------------------------------------------------------------


def test_split_files_load_like_one(tmp_path: Path) -> None:
    model = gguf_tiny_model("qwen3_moe", layers=2)
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    write_gguf(model, tmp_path / "one" / "m.gguf", MIXED)
    write_gguf(model, tmp_path / "split" / "m.gguf", MIXED, split=3)
    parts = sorted(p.name for p in (tmp_path / "split").iterdir())
    assert parts == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    one = GGUFCheckpoint(tmp_path / "one" / "m.gguf")
    for where in (tmp_path / "split", tmp_path / "split" / parts[0], tmp_path / "split" / parts[2]):
        ck = GGUFCheckpoint(where)
        assert ck.files == parts and ck.config_dict == one.config_dict
        assert ck.names() == one.names()
        for n in ck.names():
            assert torch.equal(ck.get(n), one.get(n))
        for d in ck.moe_layers():
            for p, t in ck.expert_tensors(d).items():
                assert torch.equal(t.expert(2), one.expert_tensors(d)[p].expert(2))
    (tmp_path / "split" / parts[1]).unlink()
    with pytest.raises(GGUFError, match=r"part 2 of 3 \(m-00002-of-00003.gguf\) is missing"):
        GGUFCheckpoint(tmp_path / "split")


# --- bad input ------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    write_gguf(gguf_tiny_model("qwen3_moe", layers=1), path, {"experts": "Q8_0"})
    return path


def _one_line(exc: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, (p, msg)


def test_bad_magic_and_truncated(small: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + small.read_bytes()[4:])
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(bad)
    _one_line(e, str(bad), "not a GGUF file")
    data = small.read_bytes()
    last = gguf.GGUFReader(small).tensors[-1].name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(cut)
    _one_line(e, str(cut), "truncated", repr(last))
    cut.write_bytes(data[:100])  # inside the metadata
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(cut)
    _one_line(e, str(cut), "truncated or corrupt", "header")


def _patch_type(path: Path, tensor: str, new_type: int) -> None:
    """Overwrite one tensor's GGML type id in the tensor table (after its name, n_dims, dims)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, new_type)
    path.write_bytes(bytes(data))


def test_unknown_and_unsupported_types(small: Path, tmp_path: Path) -> None:
    _patch_type(small, "blk.0.attn_q.weight", 99)
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(small)
    _one_line(e, str(small), "'blk.0.attn_q.weight'", "GGML type 99", "does not know")
    p = tmp_path / "tq2_0.gguf"
    write_gguf(gguf_tiny_model("qwen3_moe", layers=1), p, {"experts": "TQ2_0"})
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(p)
    _one_line(e, str(p), "'blk.0.ffn_gate_exps.weight'", "type TQ2_0", "MXFP4")


def test_byte_size_disagrees_with_shape(tmp_path: Path) -> None:
    """A tensor whose header shape needs more bytes than the file gives it before the next."""
    p = tmp_path / "size.gguf"
    w = gguf.GGUFWriter(p, "qwen3moe")
    q = gguf.quants.quantize(np.ones((2, 64), np.float32), QT.Q8_0)  # 2 rows of bytes
    w.add_tensor("blk.0.attn_q.weight", q, raw_shape=[8, 68], raw_dtype=QT.Q8_0)  # says 8
    w.add_tensor("blk.0.attn_k.weight", np.ones((4, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(p)
    _one_line(e, str(p), "'blk.0.attn_q.weight'", "Q8_0", "disagrees with its type and shape")


def test_missing_metadata_key(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    key = "qwen3moe.expert_feed_forward_length"
    write_gguf(gguf_tiny_model("qwen3_moe", layers=1), p, "F32", omit=(key,))
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(p)
    _one_line(e, str(p), f"lacks metadata key '{key}'")


def test_expert_ffn_size_disagrees_with_metadata(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    key = "qwen3moe.expert_feed_forward_length"
    write_gguf(gguf_tiny_model("qwen3_moe", layers=1), p, "F32", override={key: 768})
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(p)
    _one_line(e, str(p), "'blk.0.ffn_gate_exps.weight'", "moe_intermediate_size=768")


def test_split_count_mismatch(tmp_path: Path) -> None:
    write_gguf(gguf_tiny_model("qwen3_moe", layers=1), tmp_path / "m.gguf", "F32", split=2)
    first, second = sorted(tmp_path.iterdir())
    renamed = tmp_path / "m-00001-of-00001.gguf"
    first.rename(renamed)
    second.unlink()
    with pytest.raises(GGUFError) as e:
        GGUFCheckpoint(renamed)
    _one_line(e, str(renamed), "split.count says 2 parts")


def test_folder_with_two_models(small: Path, tmp_path: Path) -> None:
    (tmp_path / "other.gguf").write_bytes(small.read_bytes())
    with pytest.raises(GGUFError, match="more than one GGUF model"):
        GGUFCheckpoint(tmp_path)
    with pytest.raises(GGUFError, match="does not exist"):
        GGUFCheckpoint(tmp_path / "nope.gguf")


# --- memory ---------------------------------------------------------------------------


def test_open_maps_never_reads_whole(tmp_path: Path) -> None:
    """Opening a ~100 MB file (F32 experts) and taking an expert's view leaves RSS far
    below the file size: the reader maps, it does not read."""
    model = gguf_tiny_model("qwen3_moe", hidden=512, ffn=1024, layers=2, experts=8)
    path = tmp_path / "big.gguf"
    write_gguf(model, path, {"experts": "F32", "dense": "F16"})
    del model  # (building it imported transformers' qwen3_moe modules: not counted below)
    size = path.stat().st_size
    assert size > 90 * 2**20
    before = rss_bytes()
    ck = GGUFCheckpoint(path)
    b = ck.expert_tensors(1)["down"].expert(3)
    grown = rss_bytes() - before
    assert b.numel() == 512 * 1024 * 4
    assert grown < size // 8, (grown, size)
