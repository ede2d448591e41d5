"""MTP heads (psr.models.mtp) against a reference written from DeepSeek-V3 §2.2's
equations in plain torch: the layer over a sequence, incrementally through its own KV
cache, and drafting k > 1 tokens by re-application."""

from __future__ import annotations

import math

import pytest
import torch

from psr.models.mtp import MTPDrafter, MTPHead, new_psr_head

D, HEADS, FFN, V, EPS, THETA = 32, 4, 48, 64, 1e-6, 10000.0


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x [heads, T, hd]` (halves rotated, as Llama's)."""
    hd = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos[:, None].float() * inv[None]  # [T, hd/2]
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_block(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """One pre-norm decoder block over `x [T, d]` (positions 0..T-1): causal
    multi-head attention with RoPE, then a SwiGLU FFN, each residual."""
    T, hd = x.shape[0], D // HEADS
    n = rms(x, w["block.input_layernorm.weight"])

    def heads(name: str) -> torch.Tensor:
        return (n @ w[f"block.self_attn.{name}.weight"].T).view(T, HEADS, hd).transpose(0, 1)

    pos = torch.arange(T)
    q, k, v = rope(heads("q_proj"), pos), rope(heads("k_proj"), pos), heads("v_proj")
    s = q @ k.transpose(1, 2) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    a = (s.softmax(-1) @ v).transpose(0, 1).reshape(T, D)
    x = x + a @ w["block.self_attn.o_proj.weight"].T
    n = rms(x, w["block.post_attention_layernorm.weight"])
    g = n @ w["block.mlp.gate_proj.weight"].T
    u = n @ w["block.mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(g) * u) @ w["block.mlp.down_proj.weight"].T


def ref_mtp(h: torch.Tensor, ids: list[int], w: dict[str, torch.Tensor]):
    """h'_i = M [RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)], one block, the shared head:
    returns (block outputs [T, d], logits [T, V])."""
    e = w["embed"][torch.tensor(ids)]
    x = torch.cat([rms(e, w["enorm.weight"]), rms(h, w["hnorm.weight"])], -1)
    y = ref_block(x @ w["proj.weight"].T, w)
    return y, rms(y, w["norm.weight"]) @ w["head"].T


def ref_drafts(h: torch.Tensor, ids: list[int], k: int, w: dict[str, torch.Tensor]) -> list[int]:
    """k drafts: depth 1 from the target's rows, each further depth from the layer's own
    output at the last position and the token it drafted, one position further."""
    rows, toks, out = h, list(ids), []
    for _ in range(k):
        y, logits = ref_mtp(rows, toks, w)
        out.append(int(logits[-1].argmax()))
        rows, toks = torch.cat([rows, y[-1:]]), [*toks, out[-1]]
    return out


@pytest.fixture(scope="module")
def head() -> MTPHead:
    torch.manual_seed(0)
    lm_head, embed = torch.randn(V, D), torch.randn(V, D)
    m = new_psr_head(D, HEADS, FFN, EPS, THETA, lm_head, embed)
    with torch.no_grad():  # away from the identity start: every weight matters
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m.eval()


def weights(m: MTPHead) -> dict[str, torch.Tensor]:
    return {**m.state_dict(), "head": m.head, "embed": m.embed}


@torch.no_grad()
def test_the_layer_over_a_sequence_is_the_papers_equation(head) -> None:
    torch.manual_seed(1)
    h, ids = torch.randn(1, 9, D), torch.randint(0, V, (1, 9))
    y, logits = head(h, ids, 0, None)
    ry, rlogits = ref_mtp(h[0], ids[0].tolist(), weights(head))
    torch.testing.assert_close(y[0], ry, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], rlogits, atol=1e-4, rtol=1e-5)


@torch.no_grad()
def test_feeding_through_its_kv_cache_equals_one_pass(head) -> None:
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(2)
    h, ids = torch.randn(1, 10, D), torch.randint(0, V, (1, 10))
    _, whole = head(h, ids, 0, None)
    cache, got = DynamicCache(), []
    for a, b in ((0, 4), (4, 5), (5, 10)):
        got.append(head(h[:, a:b], ids[:, a:b], a, cache)[1])
    torch.testing.assert_close(torch.cat(got, 1), whole, atol=1e-4, rtol=1e-5)


@torch.no_grad()
def test_drafts_by_reapplication_match_the_reference_across_verify_blocks(head) -> None:
    """The drafter's calls as speculative decoding makes them: the prompt's rows, then
    the accepted rows of each block; its cache cut back past the re-applied depths."""
    torch.manual_seed(3)
    w = weights(head)
    d = MTPDrafter(head, block=3, max_draft=4, device_bytes=True)
    rows = torch.randn(14, D)  # the target's hidden at positions 0..13
    tokens = torch.randint(0, V, (15,)).tolist()  # t_0..t_14
    for upto, n in ((7, 7), (9, 2), (10, 1), (14, 4)):  # rows given per call
        got = d.propose(tokens[: upto + 1], rows[upto - n : upto])
        assert got == ref_drafts(rows[:upto], tokens[1 : upto + 1], 3, w)


def test_drafting_beyond_the_heads_depth_is_refused(head) -> None:
    with pytest.raises(ValueError, match="drafts at most 2 tokens; block=3"):
        MTPDrafter(head, block=3, max_draft=2, device_bytes=True)
