"""MTP layers read from checkpoints (DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo names, written
by hand beside tiny transformers models) against the paper's equation in plain torch
around the family's own decoder block; psr's own head beside the embedded-style model;
`psr.load(..., speculative="mtp")` decoding exactly as greedy; the one-line refusals."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import tiny_config, tiny_model, write_checkpoint

import psr
from psr.models.checkpoint import Checkpoint, CheckpointError
from psr.models.drafters import load_drafter
from psr.models.families import FAMILIES
from psr.models.families import MTP_SCHEMES as SCHEMES
from psr.models.mtp import (
    PSR_FILE,
    MTPDrafter,
    _block_config,
    checkpoint_head,
    new_psr_head,
    plan_mtp,
    psr_head_meta,
)
from psr.runtime.speculative import generate_speculative
from psr.runtime.verify import BudgetSet

PROMPT = [5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]


def rms(x: torch.Tensor, w: torch.Tensor, eps: float, centered: bool) -> torch.Tensor:
    """RMSNorm; `centered`: Qwen3-Next's zero-centred weight (scale 1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if centered else w)


def target_of(family: str, groups: bool = True):
    if family == "deepseek_v3" and not groups:  # block mode takes no group-limited router
        import transformers

        torch.manual_seed(0)
        cfg = tiny_config(family)
        cfg.n_group = cfg.topk_group = 1
        m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.normal_(0, 0.5 if name.endswith("gate.weight") else 0.2)
        return m
    if family != "mimo":
        return tiny_model(family)
    import transformers  # MiMo is a dense Qwen2 with MTP layers (model_type "mimo")

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    m.config.model_type = "mimo"
    return m


def mtp_tensors(target, family: str, seed: int = 1) -> tuple[dict[str, torch.Tensor], dict]:
    """A random MTP layer for `target` under the family's names on disk (routed experts
    per expert, as the released checkpoints keep them), and its parts for the reference."""
    torch.manual_seed(seed)
    scheme, L, d = SCHEMES[family], target.config.num_hidden_layers, target.config.hidden_size
    block = type(target.model.layers[0])(_block_config(target.config), L).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 0.5 if name.endswith("gate.weight") else 0.2)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    bp, out = scheme.block.format(L=L), {}
    fam = FAMILIES.get(family)
    for name, t in block.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            F = t.shape[1] // 2
            owner = name[: -len("gate_up_proj")]
            assert fam is not None and fam.per_expert is not None
            down = block.state_dict()[owner + "down_proj"]
            for e in range(t.shape[0]):
                for part, w in zip(fam.per_expert, (t[e, :F], t[e, F:], down[e]), strict=True):
                    out[f"{bp}{owner}{e}.{part}.weight"] = w.clone()
        elif not name.endswith("experts.down_proj"):
            out[bp + name] = t.clone()
    own = {
        "enorm": torch.randn(d) * 0.1 + 1,
        "hnorm": torch.randn(d) * 0.1 + 1,
        "proj": torch.randn(d, 2 * d) * 0.2,
        "norm": torch.randn(d) * 0.1 + 1,
    }
    if scheme.head is not None:
        own["head"] = torch.randn(target.config.vocab_size, d) * 0.2
        own["embed"] = torch.randn(target.config.vocab_size, d) * 0.2
    pre = scheme.prefix.format(L=L)
    for role, t in own.items():
        out[pre + getattr(scheme, role)] = t
    return out, {"block": block, **own}


def write_mtp_checkpoint(
    family: str, path: Path, drop: str | None = None, groups: bool = True
) -> Path:
    target = target_of(family, groups)
    write_checkpoint(target, path)
    tensors, _ = mtp_tensors(target, family)
    if drop is not None:
        tensors = {k: v for k, v in tensors.items() if drop not in k}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model-mtp.safetensors"))
    cfg = path / "config.json"
    import json

    c = json.loads(cfg.read_text())
    c[SCHEMES[family].count_keys[0]] = 1
    cfg.write_text(json.dumps(c))
    return path


def ref_mtp(target, family: str, parts: dict, h: torch.Tensor, ids: torch.Tensor):
    """The MTP equation over `h [1, T, d]`, `ids [1, T]`: the family's concatenation order,
    its norms, the family's decoder block (transformers' own, no cache, causal), the
    shared head. Returns (the hidden the next depth reads, logits)."""
    scheme, cfg = SCHEMES[family], target.config
    eps, centered = cfg.rms_norm_eps, family.startswith("qwen3")
    embed = parts.get("embed", target.get_input_embeddings().weight)
    head = parts.get("head", target.get_output_embeddings().weight)
    e = rms(embed[ids], parts["enorm"], eps, centered)
    hn = rms(h, parts["hnorm"], eps, centered)
    x = torch.cat([hn, e] if scheme.hidden_first else [e, hn], -1) @ parts["proj"].T
    T = x.shape[1]
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), torch.finfo(x.dtype).min).triu(1)[None, None]
    rot = type(target.model.rotary_emb)(config=_block_config(cfg))
    y = parts["block"](x, attention_mask=mask, position_ids=pos, position_embeddings=rot(x, pos))
    y = y[0] if isinstance(y, tuple) else y
    normed = rms(y, parts["norm"], eps, centered)
    return (normed if scheme.feeds_normed else y), normed @ head.T


FAMILIES_MTP = ["deepseek_v3", "glm4_moe", "qwen3_next", "mimo"]


def assert_drafts_by_reapplication(head, target, family: str, parts: dict, h, ids) -> None:
    """Three drafts by re-application, through the drafter's cache, against the equation
    re-run from scratch on [the target's rows; the layer's own last row]."""
    d = MTPDrafter(head, block=3, max_draft=4, device_bytes=False)
    got = d.propose([0, *ids[0].tolist()], h[0])
    rows, toks, want = h, ids, []
    for _ in range(3):
        ry, rlogits = ref_mtp(target, family, parts, rows, toks)
        want.append(int(rlogits[0, -1].argmax()))
        rows = torch.cat([rows, ry[:, -1:]], 1)
        toks = torch.cat([toks, torch.tensor([[want[-1]]])], 1)
    assert got == want


@contextlib.contextmanager
def no_weight_read():
    """psr.load fails the test if it gets as far as reading a weight."""
    import psr.models.loader as loader

    def refuse(*a, **k):
        raise AssertionError("a weight was read")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "_build_model", refuse)
        yield


@pytest.mark.parametrize("family", FAMILIES_MTP)
@torch.no_grad()
def test_checkpoint_mtp_layer_is_the_equation_and_drafts_by_reapplication(family, tmp_path) -> None:
    target = target_of(family)
    path = tmp_path / family
    write_checkpoint(target, path)
    tensors, parts = mtp_tensors(target, family)
    save_file(tensors, str(path / "model-mtp.safetensors"))
    ckpt = Checkpoint(path)
    plan = plan_mtp(ckpt, target)
    assert plan.has_experts == (family != "mimo")
    head = checkpoint_head(plan, target, torch.float32)
    torch.manual_seed(4)
    h, ids = torch.randn(1, 7, target.config.hidden_size), torch.randint(0, 64, (1, 7))
    _, logits = head(h, ids, 0, None)
    _, rlogits = ref_mtp(target, family, parts, h, ids)
    torch.testing.assert_close(logits, rlogits, atol=1e-4, rtol=1e-4)
    assert_drafts_by_reapplication(head, target, family, parts, h, ids)


@pytest.mark.parametrize(("verify", "block_k"), [("budget", 8), ("cpu", None)])
def test_load_with_the_checkpoints_mtp_layer_decodes_exactly_as_greedy(
    verify, block_k, tmp_path
) -> None:
    """DeepSeek-V3 with its group-limited router (n_group 2, topk_group 1): with every
    expert allowed (K_b = E) or each token's own top-k (cpu), the verify blocks decode as
    greedy. (Qwen3-Next's linear-attention caches cannot be cut back: refused below.)"""
    path = write_mtp_checkpoint("deepseek_v3", tmp_path / "ds")
    want = psr.load(path, "exact", residency=1.0, progress=False).generate(PROMPT, 12)
    m = psr.load(
        path, "exact", residency=1.0, progress=False, speculative="mtp", block=2,
        block_k=block_k, verify=verify,
    )  # fmt: skip
    assert m.runtime.spec.n_group == 2
    assert isinstance(m.drafter, MTPDrafter) and m.drafter.memory_bytes == 0  # host-held
    assert m.generate(PROMPT, 12).tolist() == want.tolist()
    assert m.spec_stats.blocks > 0


def test_a_prompt_longer_than_the_prefill_chunk_prefills_in_its_chunks(tmp_path) -> None:
    """Speculative decoding prefills in generate's chunks (so the same KV cache and first
    logits; one forward over the prompt had other bits and held every layer's activations
    for all of it), the MTP drafter takes every chunk's rows, and the tokens are greedy's."""
    path = write_mtp_checkpoint("deepseek_v3", tmp_path / "ds")
    kw = dict(residency=1.0, progress=False, prefill_chunk=5)
    want = psr.load(path, "exact", **kw).generate(PROMPT, 12)
    m = psr.load(path, "exact", speculative="mtp", block=2, block_k=8, verify="budget", **kw)
    seen: list[int] = []
    hook = m.hf.register_forward_pre_hook(
        lambda _m, _a, k: seen.append(k["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        assert m.generate(PROMPT, 12).tolist() == want.tolist()
    finally:
        hook.remove()
    assert seen[:3] == [5, 5, 2] and len(PROMPT) == 12  # boundaries 5, 10, then the end
    assert m.spec_stats.blocks > 0


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize(("verify", "block_k"), [("budget", 4), ("cpu:1", None)])
def test_group_limited_verify_blocks_are_deterministic_under_copy_delays(
    verify, block_k, chunk, tmp_path, monkeypatch
) -> None:
    """DeepSeek-V3's group-limited router, half the experts resident, PSR steering, the
    MTP drafter: random copy delays change neither the tokens nor the logical caches'
    traffic (misses, copies, CPU experts), under both verify rules, with the prompt in one
    prefill chunk or in chunks of 5."""
    path = write_mtp_checkpoint("deepseek_v3", tmp_path / "ds")
    runs = []
    for delay, seed in ((0, 0), (3000, 1), (3000, 2)):
        monkeypatch.setenv("PSR_COPY_DELAY_US", str(delay))
        monkeypatch.setenv("PSR_COPY_DELAY_SEED", str(seed))
        m = psr.load(
            path, "psr", residency=0.5, lam=0.3, n=1, progress=False, speculative="mtp",
            block=2, block_k=block_k, verify=verify, prefill_chunk=chunk,
        )  # fmt: skip
        try:
            tokens = m.generate(PROMPT, 12).tolist()
            s = m.stats
            runs.append((tokens, s["misses"], s["copies"], s["cpu_experts"], m.spec_stats.blocks))
        finally:
            m.close()
    assert runs[0][1] > 0 and runs[0][4] > 0  # misses happened, blocks were verified
    assert runs[1] == runs[0] and runs[2] == runs[0]


def write_psr_head(path: Path, depth: int) -> None:
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    c = target.config
    torch.manual_seed(5)
    head = new_psr_head(
        c.hidden_size, c.num_attention_heads, 48, c.rms_norm_eps, 10000.0,
        target.get_output_embeddings().weight, target.get_input_embeddings().weight,
    )  # fmt: skip
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    (path / PSR_FILE).parent.mkdir(exist_ok=True)
    save_file(head.state_dict(), str(path / PSR_FILE), metadata=psr_head_meta(head, depth))


def test_psr_head_beside_the_model_decodes_exactly_as_greedy(tmp_path) -> None:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    want = psr.load(path, "exact", residency=1.0, progress=False).generate(PROMPT, 12)
    write_psr_head(path, depth=3)
    m = psr.load(path, "exact", residency=1.0, progress=False, speculative="mtp", block=3)
    assert m.drafter.memory_bytes > 0  # dense, on the device: out of the slots
    assert m.runtime.capacity < 8
    m.generate(PROMPT, 12)
    assert m.spec_stats.blocks > 0
    # Verify blocks of all 8 experts (its slots given back): exactly greedy.
    e = psr.load(path, "exact", residency=1.0, progress=False)
    drafter = load_drafter(path, "mtp", 3, e.hf, torch.device("cpu"), torch.float32)
    got, _ = generate_speculative(
        e.hf, e.runtime, drafter, torch.tensor([PROMPT]), 12, BudgetSet(8)
    )
    assert got.tolist() == want.tolist()
    with pytest.raises(ValueError, match="drafts at most 3 tokens; block=4"):
        psr.load(path, "exact", residency=1.0, progress=False, speculative="mtp", block=4)


def test_mtp_on_a_checkpoint_without_one_is_refused(tmp_path) -> None:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    with pytest.raises(CheckpointError, match=r"has no MTP head \(olmoe checkpoints carry none"):
        psr.load(path, "exact", residency=1.0, progress=False, speculative="mtp")
    path = write_checkpoint(tiny_model("deepseek_v3"), tmp_path / "ds")
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.layers\.4\.eh_proj\.weight'"):
        psr.load(path, "exact", residency=1.0, progress=False, speculative="mtp")


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        ("hnorm", "model.layers.4.hnorm.weight"),
        ("experts.3.", "model.layers.4.mlp.experts.3.gate_proj.weight"),
        ("self_attn.o_proj", "model.layers.4.self_attn.o_proj.weight"),
    ],
)
def test_incomplete_mtp_layer_names_what_is_missing_before_reading(drop, named, tmp_path) -> None:
    path = write_mtp_checkpoint("deepseek_v3", tmp_path / "ds", drop=drop)
    with no_weight_read(), pytest.raises(CheckpointError, match=f"incomplete: missing {named}"):
        psr.load(path, "exact", residency=1.0, progress=False, speculative="mtp")


def test_inspect_says_whether_a_checkpoint_has_an_mtp_head(tmp_path) -> None:
    from psr.models.inspect import inspect

    with_mtp = write_mtp_checkpoint("deepseek_v3", tmp_path / "ds")
    assert inspect(with_mtp).mtp == "model.layers.4.* (speculative='mtp')"
    assert "MTP head   model.layers.4.*" in inspect(with_mtp).table()
    plain = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    assert inspect(plain).mtp == "none"
    write_psr_head(plain, depth=2)
    assert inspect(plain).mtp == f"psr's {PSR_FILE} (speculative='mtp')"


def test_a_psr_head_leaves_the_models_key_and_its_tuned_points_alone(tmp_path) -> None:
    from psr.points import model_key

    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    key = model_key(path)
    write_psr_head(path, depth=2)
    assert model_key(path) == key


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
@torch.no_grad()
def test_gguf_nextn_layer_is_the_equation(family, tmp_path) -> None:
    """GLM-4.5's and DeepSeek-V3's MTP layer as llama.cpp's converter writes it
    (`blk.L.nextn.*`, the block as `blk.L.*`; DeepSeek's with its own embedding and head,
    its MLA attention split as the converter splits it), F32: psr's head from the GGUF
    file against the equation around the same block, one depth and three by
    re-application."""
    import gguf
    from gguf_files import gguf_tiny_model, write_gguf

    from psr.models.gguf import GGUFCheckpoint

    model = gguf_tiny_model(family, hidden=64, ffn=32, vocab=256)
    write_gguf(model, tmp_path / "m.gguf", nextn=True)  # the block: a copy of the last layer
    L = model.config.num_hidden_layers
    ck = GGUFCheckpoint(tmp_path / "m.gguf")
    head = checkpoint_head(plan_mtp(ck, model), model, torch.float32)
    raw = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}  # by GGUF name

    def nextn(part: str) -> torch.Tensor:
        return torch.from_numpy(raw[f"blk.{L}.nextn.{part}.weight"].data.copy())

    parts = {"block": model.model.layers[L - 1], "proj": nextn("eh_proj")}
    parts |= {"enorm": nextn("enorm"), "hnorm": nextn("hnorm"), "norm": nextn("shared_head_norm")}
    if family == "deepseek_v3":
        parts |= {"embed": nextn("embed_tokens"), "head": nextn("shared_head_head")}
    torch.manual_seed(6)
    h, ids = torch.randn(1, 6, 64), torch.randint(0, 256, (1, 6))
    _, logits = head(h, ids, 0, None)
    _, want = ref_mtp(model, family, parts, h, ids)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    assert_drafts_by_reapplication(head, model, family, parts, h, ids)
    ck.close()
    from psr.models.inspect import inspect

    assert inspect(tmp_path / "m.gguf").mtp == f"blk.{L}.* (speculative='mtp')"


def test_psr_generate_with_the_embedded_models_mtp_head(capsys) -> None:
    """The shipped head (drafter_mtp/): `psr generate --speculative mtp` decodes with it;
    it was trained for 4 drafts and refuses a fifth before any weight is read."""
    from psr.cli import main

    argv = ["generate", "--prompt-ids", "1870,620,52,14,2009,305", "--max-new-tokens", "8"]
    assert main([*argv, "--quiet", "--device", "cpu", "--speculative", "mtp", "--block", "3"]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("speculative"))
    assert line.startswith("speculative (mtp, B=3, budget(K_b=")
    with no_weight_read(), pytest.raises(ValueError, match="at most 4 tokens"):
        psr.load(psr.DEFAULT_MODEL, device="cpu", progress=False, speculative="mtp", block=5)


def test_speculative_on_linear_attention_layers_is_refused(tmp_path) -> None:
    """Qwen3-Next's MTP layer loads (above), but its Gated DeltaNet layers' state cannot
    be cut back to the accepted tokens: one line at load, not a crash while decoding."""
    path = write_mtp_checkpoint("qwen3_next", tmp_path / "qn")
    with pytest.raises(ValueError, match="linear-attention layers keep a recurrent state"):
        psr.load(path, "exact", residency=1.0, progress=False, speculative="mtp")
