"""Multi-token-prediction (MTP) heads as speculative drafters.

DeepSeek-V3 §2.2: with h the target's hidden state at position i and t_{i+1} the next
token, the MTP layer computes

    h'  = M [RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h)]      (M: eh_proj, [d, 2d])
    h'' = Block(h')                                       (one decoder layer, own KV)
    logits(t_{i+2}) = Head(RMSNorm_f(h''))                (the shared head)

and drafts k > 1 tokens by applying the layer again on its own output h'' and the
token it just drafted (one position further), as the models were trained. Families
differ only in names, the concatenation order (MiMo: hidden first) and which hidden
the next depth reads (DeepSeek/GLM: h'' before the final norm; Qwen3-Next/MiMo: after):
one `MTPScheme` row each in `MTP_SCHEMES`.

The decoder block is the family's own transformers decoder layer (attention with its
own KV cache; its FFN an MoE layer for DeepSeek-V3 / GLM-4.5 / Qwen3-Next), built with
the target's config and filled from the checkpoint. An MTP block with routed experts
is held resident in host memory and computed on the CPU by transformers' own expert
forward: simplest correct first (its experts never enter the slab, so it costs no
device memory and leaves the target's logical caches untouched); a dense one (the
embedded model's trained head) sits on the target's device.

The embedded model's head (`drafter_mtp/mtp.safetensors`, scripts/train_drafters.py mtp) is psr's
own format: a Llama decoder block over the target's hidden size, the target's input
embedding and LM head shared.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from psr.models.checkpoint import CheckpointError
from psr.models.families import MTP_SCHEMES, MTPScheme
from psr.runtime.speculative import crop_to

PSR_FORMAT = "psr-mtp-v1"
# Draft tokens one checkpoint layer may propose by re-application (llama.cpp drafts up
# to 3 from one nextn layer; beyond 4 the acceptance of a re-applied depth-1 layer is
# negligible). psr's own head says how deep it was trained in its metadata.
CHECKPOINT_MAX_DRAFT = 4


def causal_mask(past: int, q: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask `[1, 1, q, past + q]`: query i (at position past + i) sees keys
    0..past + i."""
    neg = torch.finfo(dtype).min
    m = torch.full((q, past + q), neg, dtype=dtype, device=device).triu(past + 1)
    return m[None, None]


class MTPHead(nn.Module):
    """One MTP layer: norms, projection, decoder block (own KV), shared head."""

    def __init__(
        self,
        enorm: nn.Module,
        hnorm: nn.Module,
        proj: nn.Linear,
        block: nn.Module,
        rotary: nn.Module,
        norm: nn.Module,
        head: torch.Tensor,
        embed: torch.Tensor,
        hidden_first: bool = False,
        feeds_normed: bool = False,
    ) -> None:
        super().__init__()
        self.enorm, self.hnorm, self.proj, self.norm = enorm, hnorm, proj, norm
        self.block, self.rotary = block, rotary
        # The shared head and embedding: plain tensors (not this module's parameters),
        # the target's own unless the layer carries its own.
        self.head, self.embed = head.detach(), embed.detach()
        self.hidden_first, self.feeds_normed = hidden_first, feeds_normed
        params = inspect.signature(block.forward).parameters
        self._kv = "cache" if "cache" in params else "past_key_values"

    def forward(
        self, h: torch.Tensor, ids: torch.Tensor, past: int, cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`h [b, q, d]` the hidden states at positions past..past+q-1, `ids [b, q]` the
        tokens after them -> (the hidden the next depth reads `[b, q, d]`, logits
        `[b, q, V]` of the tokens two after). `cache`: the block's KV (None: no cache,
        `past` must be 0)."""
        e, hn = self.enorm(F.embedding(ids, self.embed)), self.hnorm(h)
        x = self.proj(torch.cat([hn, e] if self.hidden_first else [e, hn], dim=-1))
        q = x.shape[1]
        pos = torch.arange(past, past + q, device=x.device)[None].expand(x.shape[0], -1)
        out = self.block(
            hidden_states=x,
            attention_mask=causal_mask(past, q, x.dtype, x.device),
            position_ids=pos,
            position_embeddings=self.rotary(x, pos),
            use_cache=cache is not None,
            **{self._kv: cache},
        )
        y = out[0] if isinstance(out, tuple) else out
        normed = self.norm(y)
        return (normed if self.feeds_normed else y), F.linear(normed, self.head)


def check_block(block: int, max_draft: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    if block > max_draft:
        raise ValueError(
            f"the MTP head drafts at most {max_draft} tokens; block={block} asks for more"
        )


class MTPDrafter:
    """Drafts `block` tokens by applying an MTP head to the target's hidden states and
    then to its own (psr.runtime.speculative.Drafter). Its KV cache holds one entry per
    committed position (the target's hidden rows it was given); the re-applied depths'
    entries are cut away at the next call."""

    kind = "mtp"

    def __init__(self, head: MTPHead, block: int, max_draft: int, device_bytes: bool) -> None:
        check_block(block, max_draft)
        self.head = head.eval()
        self.block, self.max_draft = block, max_draft
        self._device_bytes = device_bytes
        p = next(head.proj.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.reset()

    @property
    def memory_bytes(self) -> int:
        # Device bytes only: a head held in host memory (routed experts) costs no slots.
        # The shared LM head and embedding are the target's (resident anyway).
        if not self._device_bytes:
            return 0
        return sum(p.numel() * p.element_size() for p in self.head.parameters())

    @property
    def pass_cost(self) -> tuple[int, int]:
        """(weights read per pass, passes per block): one pass over the accepted rows, then
        B - 1 re-applications, each reading the layer and the shared LM head."""
        return sum(p.numel() for p in self.head.parameters()) + self.head.head.numel(), self.block

    def reset(self) -> None:
        from transformers.cache_utils import DynamicCache

        self.cache: Any = DynamicCache()
        self.committed = 0

    @torch.no_grad()
    def propose(self, tokens: list[int], hidden: torch.Tensor | None) -> list[int]:
        """`hidden [n, d]`: the target's hidden states at the n positions not yet given
        (the prompt after the prefill, the accepted block's after a verify), whose next
        tokens are `tokens[-n:]`."""
        if hidden is None:
            raise ValueError("the MTP drafter needs the target's hidden states")
        h = hidden.reshape(-1, hidden.shape[-1]).to(self.device, self.dtype)
        n = h.shape[0]
        start = len(tokens) - 1 - n  # the first row's position
        if start != self.committed:
            raise ValueError(
                f"MTP drafter: hidden rows start at position {start}, its cache holds "
                f"{self.committed}"
            )
        crop_to(self.cache, start)  # the previous call's re-applied depths
        ids = torch.tensor([tokens[start + 1 :]], device=self.device)
        x, logits = self.head(h[None], ids, start, self.cache)
        self.committed = start + n
        drafts = [int(logits[0, -1].float().argmax())]
        pos = start + n
        while len(drafts) < self.block:
            x, logits = self.head(
                x[:, -1:], torch.tensor([[drafts[-1]]], device=self.device), pos, self.cache
            )
            drafts.append(int(logits[0, -1].float().argmax()))
            pos += 1
        return drafts


# --- psr's own head (the embedded model) --------------------------------------------------


def llama_block_config(d: int, heads: int, ffn: int, eps: float, theta: float) -> Any:
    import transformers

    return transformers.LlamaConfig(  # type: ignore[call-arg]
        hidden_size=d,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_hidden_layers=1,
        rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        max_position_embeddings=4096,
        vocab_size=1,
        attn_implementation="sdpa",
    )


def new_psr_head(
    d: int,
    heads: int,
    ffn: int,
    eps: float,
    theta: float,
    lm_head: torch.Tensor,
    embed: torch.Tensor,
) -> MTPHead:
    """A fresh psr MTP head (random block, unit norms, M = [0, I]: it starts as the
    target's own next-token head applied to h)."""
    from transformers.models.llama import modeling_llama as ml

    cfg = llama_block_config(d, heads, ffn, eps, theta)
    proj = nn.Linear(2 * d, d, bias=False)
    with torch.no_grad():
        proj.weight.zero_()
        proj.weight[:, d:] = torch.eye(d)
    return MTPHead(
        ml.LlamaRMSNorm(d, eps),
        ml.LlamaRMSNorm(d, eps),
        proj,
        ml.LlamaDecoderLayer(cfg, layer_idx=0),
        ml.LlamaRotaryEmbedding(cfg),
        ml.LlamaRMSNorm(d, eps),
        lm_head,
        embed,
    )


def psr_head_meta(head: MTPHead, depth: int) -> dict[str, str]:
    block: Any = head.block  # transformers' layer (untyped)
    cfg = block.self_attn.config
    return {
        "format": PSR_FORMAT,
        "hidden_size": str(cfg.hidden_size),
        "heads": str(cfg.num_attention_heads),
        "ffn": str(cfg.intermediate_size),
        "eps": str(cfg.rms_norm_eps),
        "rope_theta": str(cfg.rope_parameters["rope_theta"]),
        "depth": str(depth),
    }


def psr_head_depth(path: str | Path) -> int:
    """The draft depth psr's head file was trained for (its metadata; no tensor read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != PSR_FORMAT:
        raise CheckpointError(f"{path} is not a psr MTP head (format {meta.get('format')})")
    return int(meta["depth"])


def load_psr_head(
    path: str | Path, lm_head: torch.Tensor, embed: torch.Tensor
) -> tuple[MTPHead, int]:
    """psr's MTP head file and the draft depth it was trained for, on the LM head's
    device and dtype."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != PSR_FORMAT:
        raise CheckpointError(f"{path} is not a psr MTP head (format {meta.get('format')})")
    d = int(meta["hidden_size"])
    if d != lm_head.shape[1]:
        raise CheckpointError(
            f"{path}: an MTP head of hidden size {d}, target has {lm_head.shape[1]}"
        )
    head = new_psr_head(
        d,
        int(meta["heads"]),
        int(meta["ffn"]),
        float(meta["eps"]),
        float(meta["rope_theta"]),
        lm_head,
        embed,
    )
    missing = sorted(set(head.state_dict()) - set(state))
    if missing:
        raise CheckpointError(f"{path}: MTP head tensors missing: {', '.join(missing)}")
    head.load_state_dict(state)
    return head.to(device=lm_head.device, dtype=lm_head.dtype), int(meta["depth"])


# --- MTP layers in checkpoints ------------------------------------------------------------


class _Renamed:
    """A checkpoint read under the trunk's names `model.layers.{L}.*` where the family keeps
    its MTP block elsewhere (`mtp.layers.0.*`, `model.mtp_layers.0.*`): psr's expert reader
    and the family table's disk names then apply unchanged."""

    def __init__(self, ckpt: Any, trunk: str, block: str) -> None:
        self.ckpt, self.trunk, self.block, self.path = ckpt, trunk, block, ckpt.path

    def _n(self, name: str) -> str:
        return self.block + name[len(self.trunk) :] if name.startswith(self.trunk) else name

    def __contains__(self, name: str) -> bool:
        return self._n(name) in self.ckpt

    def __getattr__(self, attr: str) -> Any:  # get / get_row / shape / dtype / require_float
        fn = getattr(self.ckpt, attr)
        return lambda name, *a: fn(self._n(name), *a)


@dataclass
class MTPPlan:
    """A checkpoint's MTP layer, checked (every tensor present) before any weight is read."""

    scheme: MTPScheme
    layer: int  # the block's layer index (num_hidden_layers)
    names: dict[str, str]  # the layer's own tensors: role -> name on disk
    block: nn.Module  # the decoder block, built on the meta device
    config: Any  # the target's config as the block sees it
    view: Any  # the checkpoint under trunk names

    @property
    def has_experts(self) -> bool:
        return any(".experts." in n for n, _ in self.block.named_parameters())


def _block_config(config: Any) -> Any:
    """The target's config for its MTP block: one more (full-attention) layer."""
    import copy

    cfg = copy.copy(config)
    types = getattr(cfg, "layer_types", None)
    if types:
        cfg.layer_types = [*types, "full_attention"]
    return cfg


def plan_mtp(ckpt: Any, target: Any) -> MTPPlan:
    """The checkpoint's first MTP layer for the (meta-built) transformers `target`; a
    one-line CheckpointError when it has none or some of its tensors are missing."""
    from psr.models.families import FAMILIES, disk_names
    from psr.models.hf import decoder_layers

    config = target.config
    mt = str(getattr(config, "model_type", ""))
    scheme = MTP_SCHEMES.get(mt)
    L = int(config.num_hidden_layers)
    if scheme is None:
        known = ", ".join(MTP_SCHEMES)
        raise CheckpointError(
            f"speculative='mtp': {ckpt.path} has no MTP head ({mt} checkpoints carry none; "
            f"MTP layers are read from {known}, psr's own from {PSR_FILE} beside it)"
        )
    names = scheme.names(L)
    if names["proj"] not in ckpt:  # many conversions drop the MTP layer, config or not
        key = next((k for k in scheme.count_keys if hasattr(config, k)), scheme.count_keys[0])
        raise CheckpointError(
            f"speculative='mtp': {ckpt.path} has no MTP head (no tensor {names['proj']!r}; "
            f"config {key}={getattr(config, key, None)})"
        )
    trunk = f"model.layers.{L}."
    view = _Renamed(ckpt, trunk, scheme.block.format(L=L))
    cfg = _block_config(config)
    with torch.device("meta"):
        block = type(decoder_layers(target)[0])(cfg, L)
    fam = FAMILIES.get(mt)  # None: a dense target (MiMo), its block's names as they are
    missing = [n for r, n in names.items() if r not in ("head", "embed") and n not in ckpt]
    experts = False
    for pname, _ in block.state_dict().items():
        if ".experts." in pname and fam is not None:
            experts = True
            continue
        full = trunk + pname
        cands = disk_names(mt, full) if fam is not None else [full]
        if not any(c in view for c in cands):
            missing.append(view._n(full))
    if experts:
        missing += _missing_experts(view, cfg, L)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(
            f"speculative='mtp': the MTP layer of {ckpt.path} is incomplete: missing "
            f"{', '.join(missing[:3])}{more}"
        )
    return MTPPlan(scheme, L, names, block, cfg, view)


def _missing_experts(view: Any, cfg: Any, L: int) -> list[str]:
    """Names of the MTP layer's routed-expert tensors absent from the checkpoint."""
    from psr.models.families import expert_tensor_names, fused_expert_names, moe_spec

    spec = moe_spec(cfg)
    if any(g in view and d in view for g, d in fused_expert_names(spec.family, L)):
        return []
    out = []
    for e in range(spec.num_experts):
        cands = expert_tensor_names(spec.family, L, e)
        if not any(all(n in view for n in c) for c in cands):
            out += [view._n(n) for n in cands[0] if n not in view]
    return out


def _fill_block(plan: MTPPlan, dev: torch.device, dtype: torch.dtype) -> nn.Module:
    """The planned block with every tensor read from the checkpoint (its routed experts
    packed as transformers' module keeps them: gate_up [E, 2F, H], down [E, H, F])."""
    from psr.models.families import FAMILIES, disk_names, fused_expert_names, moe_spec
    from psr.models.hf import set_tensor
    from psr.models.safetensors_experts import expert_reader

    block: Any = plan.block
    view, mt = plan.view, str(plan.config.model_type)
    trunk = f"model.layers.{plan.layer}."
    packed: dict[str, list[str]] = {}
    for pname in block.state_dict():
        if ".experts." in pname and mt in FAMILIES:
            owner, _, attr = pname.rpartition(".")
            packed.setdefault(owner, []).append(attr)
            continue
        full = trunk + pname
        src = next(c for c in (disk_names(mt, full) if mt in FAMILIES else [full]) if c in view)
        t = view.get(src)
        set_tensor(block, pname, t.to(dev, dtype if t.is_floating_point() else t.dtype))
    for owner, attrs in packed.items():
        if sorted(attrs) != ["down_proj", "gate_up_proj"]:
            raise CheckpointError(f"MTP block experts {owner}: unsupported layout {attrs}")
        spec = moe_spec(plan.config)
        fused = [(g, d) for g, d in fused_expert_names(mt, plan.layer) if g in view and d in view]
        if fused:  # whole tensors, read once (a GGUF file's, dequantized)
            gate_up, down = view.get(fused[0][0]).float(), view.get(fused[0][1]).float()
        else:
            read = expert_reader(view, spec, plan.layer)
            rows = [read(e) for e in range(spec.num_experts)]
            gate_up = torch.stack([torch.cat([p.float() for p in r[:-1]]) for r in rows])
            down = torch.stack([r[-1].float() for r in rows])
        set_tensor(block, f"{owner}.gate_up_proj", gate_up.to(dev, dtype))
        set_tensor(block, f"{owner}.down_proj", down.to(dev, dtype))
    block.self_attn.layer_idx = 0  # its own one-layer KV cache
    out: nn.Module = block.eval()
    return out


def checkpoint_head(plan: MTPPlan, target: Any, dtype: torch.dtype) -> MTPHead:
    """The planned MTP layer as an MTPHead: on the target's device when its block is
    dense, in host memory (computed on the CPU) when it has routed experts."""
    lm_head = target.get_output_embeddings().weight
    dev = torch.device("cpu") if plan.has_experts else lm_head.device
    v, names, cfg = plan.view, plan.names, plan.config
    d, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
    norm_cls = type(target.model.norm)

    def norm(role: str) -> nn.Module:
        m: nn.Module = norm_cls(d, eps=eps)
        m.weight.data = v.get(names[role]).to(dev, dtype)
        return m

    proj = nn.Linear(2 * d, d, bias=False, device=dev, dtype=dtype)
    proj.weight.data = v.get(names["proj"]).to(dev, dtype)
    own = {r: names[r] in v for r in ("head", "embed") if r in names}
    head = v.get(names["head"]) if own.get("head") else lm_head
    embed = v.get(names["embed"]) if own.get("embed") else target.get_input_embeddings().weight
    rotary = type(target.model.rotary_emb)(config=cfg).to(dev)
    return MTPHead(
        norm("enorm"),
        norm("hnorm"),
        proj,
        _fill_block(plan, dev, dtype),
        rotary,
        norm("norm"),
        head.detach().to(dev, dtype),
        embed.detach().to(dev, dtype),
        hidden_first=plan.scheme.hidden_first,
        feeds_normed=plan.scheme.feeds_normed,
    )


# In a folder of its own: the model's key (psr.points.model_key) hashes the top folder's
# safetensors headers, and the tuned points must survive adding a drafter.
PSR_FILE = "drafter_mtp/mtp.safetensors"


def load_mtp_drafter(
    model_dir: str | Path, plan: MTPPlan | None, target: Any, block: int, dtype: torch.dtype
) -> MTPDrafter:
    """psr's head beside the checkpoint (`PSR_FILE`), else the checkpoint's own MTP layer
    (`plan`, from `plan_mtp`)."""
    own = Path(model_dir) / PSR_FILE
    if own.is_file():
        head, depth = load_psr_head(
            own, target.get_output_embeddings().weight, target.get_input_embeddings().weight
        )
        return MTPDrafter(head, block, depth, device_bytes=True)
    if plan is None:
        raise CheckpointError(f"speculative='mtp': {model_dir} has no MTP head")
    head = checkpoint_head(plan, target, dtype)
    return MTPDrafter(head, block, CHECKPOINT_MAX_DRAFT, device_bytes=not plan.has_experts)
