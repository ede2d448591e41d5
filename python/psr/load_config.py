"""`LoadConfig`: every option of `psr.load` / `psr.offload`, its default and its checks, in
one place. `psr.load(path, policy, residency, **options)` builds one from its keywords
(`psr.load(path, **cfg.options())` takes a config), the CLI's load flags are a table keyed
by its fields (tests/cli/test_load_config.py holds them equal), and `psr inspect` reads its
defaults. Adding an option is a field here (`metadata=BOTH` if `psr.offload` takes it too)
and its use in `psr.models.loader`.

Torch-free: the CLI builds and checks one before torch is imported. What depends on the
checkpoint (slots against its experts, the dtype it defaults to, the device) is resolved
when it loads (`psr.models.loader`).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psr.vocab as vocab
from psr.machine import resolve_threads
from psr.policy import DEFAULT_POLICY, DEFAULT_RESIDENCY, DEFAULT_VERIFY, Policy, make_policy

# Each field's metadata: whether `psr.offload` takes it too (`psr.load` takes every one).
BOTH: dict[str, bool] = {"offload": True}
LOAD: dict[str, bool] = {"offload": False}


@dataclass(frozen=True)
class LoadConfig:
    """How a checkpoint loads (`psr.load`) or a built model is offloaded (`psr.offload`).

    policy: 'exact', 'exact-prefetch', 'cache-prior', 'psr' or 'cache-prior-async' (or a
        psr.policy.Policy).
    residency: fraction of each layer's experts with a device slot (or `slots`); None
        (default): psr.policy.DEFAULT_RESIDENCY, or with `gpu_memory` the memory plan's.
    batch_slots: the physical slab's slots per MoE layer, for batched decode
        (psr.runtime.batch.BatchDecoder, `model.generate_batch`): the store gets
        max(slots, batch_slots) while each sequence's logical cache keeps the solo `slots`
        (so its routing and tokens stay its solo run's); a batch of b uses up to
        b x slots of them (the union of what its sequences hold). None (default): the solo
        slots, no more memory (a batch's union then spills them: more copies). More
        than the experts per layer, or fewer than `slots`, is an error; with `gpu_memory`
        it needs `slots` or `residency` (the plan then checks the larger slab fits).
        Solo decoding uses the first `slots` only.
    batch: the sequences decoded at once (`psr serve --parallel N` sets it). With
        `batch_slots` None, on a CUDA device (where a batch reads its experts through the
        slab) the store gets min(experts per layer, batch x slots) slots per layer, the
        union a batch of that many holds; the CPU backend's batch reads the held host rows
        (no more slots). With `gpu_memory` and `slots` or `residency` the plan checks them
        (psr serve falls back to the solo slots when they do not fit); when the plan
        chooses the slots, it sizes the solo slab only. None or 1: the solo slots.
    lam, n: bias strength and predicted experts per layer and token (per policy; defaults
        in psr.policy).
    device: compute device (default: cuda if available); the store's backend follows.
    dtype: float32 / bfloat16 / float16 (default: the checkpoint's).
    compute: 'auto' (Triton on CUDA, torch otherwise), 'triton' or 'torch'.
    decode: 'device' (default): decode steps run on device-resident caches with no host
        read, wherever the policy allows (not cache-prior-async, steering variants or trace
        recording); 'host': the host-driven step throughout (the store's copies, with their
        retries). Both give the same tokens and counts.
    experts_on: where decode steps compute misses: 'gpu' (default: every miss copied into
        the slab), 'cpu' (no miss copied: computed on the CPU from the host rows, with psr's
        CPU expert kernels) or 'hybrid' (at most m misses per MoE layer copied, the rest on
        the CPU; 'hybrid:M' or 'hybrid:M1,M2,...' gives m, one for every MoE layer or one
        per layer; plain 'hybrid' chooses it from this machine's profile, `psr bench
        machine`). CPU and GPU arithmetic round differently: the modes may give different
        tokens, each reproducible. `model.set_experts_on` switches later.
    graphs: 'auto' (default: on for CUDA, off elsewhere), True or False: `generate` decodes
        each token as one replay of a captured forward over a static KV cache (CUDA: a CUDA
        graph; CPU: torch.compile fullgraph), where the device decode step runs;
        `model.graph_status` says whether it did, and why not.
    expert_format: how the host store keeps experts and copies move them: None or 'native'
        (the model's dtype), 'bf16', or quantized while loading: 'int8' (per output
        channel), 'fp8' (e4m3, per channel), 'int4' (group 128); the kernels dequantize on
        the fly.
    dense_format: how the dense weights (attention, shared experts, dense FFN layers, the
        embeddings and output head) are kept on the device: 'native' (default: as the file
        stores them; a GGUF file's Q8_0 / Q4_K / Q6_K ... stay in their blocks and run
        through psr's dense kernels, F32 tensors and routers become `dtype`; a float
        checkpoint's weights in `dtype`), 'float' (every dense weight dequantized to
        `dtype`: more memory, the arithmetic of the dequantized twin), or for a float
        checkpoint 'int8' / 'fp8' (weight-only, per output channel, quantized at load).
    kv_format: how the KV cache keeps keys and values (psr.runtime.kv_quant): 'auto'
        (default: transformers' own cache in `dtype`), 'bf16', or 'int8' / 'fp8' (e4m3),
        one fp32 scale per token and head, dequantized to `dtype` when attention reads
        them: about half (bf16: of float32) or a quarter of float32's bytes. Every
        attention kind that caches keys and values takes it (MHA/GQA, sliding windows,
        DeepSeek's MLA latent); a model with linear-attention layers is refused, and so is
        `graphs=True` (decode graphs capture a static cache, which has no packed form;
        graphs='auto' decodes eagerly). 'fit' (needs `gpu_memory`): the memory plan picks
        the first of 'auto', 'int8', 'fp8' whose plan fits ('auto' only with graphs=True).
    quant_cache: with a quantized `expert_format`, keep the quantized rows on disk and read
        them on later loads of the same checkpoint: True (the user cache folder, or
        $PSR_CACHE/quantized) or a folder, never inside the model folder
        (psr.models.quant_cache). False (default): quantize on every load.
    host_memory: the host-memory budget ('48GB', '48GiB', bytes, or 'unlimited'; default:
        every expert when the model fits 80% of MemAvailable, else that): experts beyond it
        stay in the memory-mapped checkpoint and are read from it (page cache or disk) when
        copied (psr.models.tiers). CPU backend: the dense weights and the slab count against
        it. On CUDA a model with such experts decodes with decode='host' (the device step's
        gather kernel reads pinned rows).
    gpu_memory: the device memory the model may take ('24GiB', '24GB', bytes; default:
        no plan): before any weight is copied, the memory plan (psr.models.memory_plan:
        dense part, the KV cache of `context` tokens, a workspace, the slab) chooses the
        slots when neither `residency` nor `slots` is given, and a load that cannot fit
        (nor `host_memory` hold) is a ValueError naming the part and the shortfall.
    host_profile: which experts to hold: per MoE layer, per expert, how often it is routed
        to (nested lists or a JSON file); default layer-balanced.
    speculative: None, 'block' (the checkpoint's drafter_block.safetensors: heads on the
        target's hidden state), 'ar' (its drafter_ar/ dense model) or 'mtp' (psr's
        drafter_mtp/mtp.safetensors beside it, else the checkpoint's own MTP layer: DeepSeek-V3,
        GLM-4.5, Qwen3-Next; psr.models.mtp; one with routed experts is held in host
        memory and costs no slots): greedy speculative
        decoding with `block` drafted tokens per verify block and one set of `block_k`
        experts per layer and block (default min(2 top_k, slots)). The drafter is resident:
        its memory comes out of the expert slots (equal device memory), so the store gets
        fewer slots than `residency` alone gives.
    verify: how a verify block bounds the experts its tokens need: 'budget' (default: one set
        of `block_k` experts per layer and block, each token's top-k inside it) or 'cpu' /
        'cpu:M' (each token keeps its own top-k; the union's members outside the slab are
        computed on the CPU from the host rows, at most M misses copied per layer and block;
        default M: top-k, or experts_on's cap under cpu / hybrid).
    quality_budget: nats/token (95% upper bound) the policy may cost: 'cache-prior' / 'psr'
        then require the model's operating point tuned by `psr tune` for this budget or a
        tighter one (the embedded model ships points for 0.01); without it, such a policy
        without lam / n still takes the tuned point when one exists.
    copy_retries: re-issues of a failed expert copy before CopyError (default 2, or
        $PSR_COPY_RETRIES).
    threads: CPU threads for torch's intra-op pool and psr's CPU expert kernels (set
        process-wide with torch.set_num_threads); default $PSR_THREADS, else
        $OMP_NUM_THREADS, else the physical cores of the process's affinity mask
        (psr.machine.resolve_threads). More than the CPUs available is an error.
    context: the context in tokens (llama.cpp's --ctx-size): prompt + new tokens beyond it
        are refused, decode graphs' static KV caches are capped at it, `psr serve` reports
        it as max_model_len. Default: the checkpoint's max_position_embeddings; more than
        that is an error.
    prefill_chunk: tokens per prefill chunk, at fixed absolute boundaries (default 512, at
        most the context; `model.set_prefill_chunk` changes it): unless the forward is
        row-invariant (`model.set_row_invariant`), attention and the expert grouping round
        per chunk, so the chunk is part of the configuration (the prompt
        cache keys it).
    cpu_dot: how the CPU kernels dot GGUF block rows with their activations
        (psr.vocab.CPU_DOTS, set process-wide at load): 'auto' (default: integer dots on
        activations quantized to Q8_K / Q8_0, as llama.cpp, for the block types where that
        is measured faster on this CPU; fp32 for the rest), 'f32' (fp32 activations
        throughout) or 'q8'. Outputs differ by the activations' rounding; any choice keeps
        rows bit-identical for any batch, chunk and thread count.
    progress: progress bars while the experts load (None, the default: only when stderr is
        a terminal).
    """

    policy: str | Policy = field(default=DEFAULT_POLICY, metadata=BOTH)
    residency: float | None = field(default=None, metadata=BOTH)
    slots: int | None = field(default=None, metadata=BOTH)
    batch_slots: int | None = field(default=None, metadata=BOTH)
    batch: int | None = field(default=None, metadata=BOTH)
    lam: float | None = field(default=None, metadata=BOTH)
    n: int | None = field(default=None, metadata=BOTH)
    quality_budget: float | None = field(default=None, metadata=LOAD)
    device: Any = field(default=None, metadata=LOAD)  # str | torch.device | None
    dtype: Any = field(default=None, metadata=LOAD)  # str | torch.dtype | None
    compute: str = field(default="auto", metadata=BOTH)
    decode: str = field(default="device", metadata=BOTH)
    experts_on: str = field(default="gpu", metadata=BOTH)
    graphs: bool | str = field(default="auto", metadata=BOTH)
    expert_format: str | None = field(default=None, metadata=BOTH)
    dense_format: str = field(default="native", metadata=LOAD)
    kv_format: str = field(default="auto", metadata=BOTH)
    quant_cache: bool | str | Path | None = field(default=False, metadata=LOAD)
    host_memory: str | int | None = field(default=None, metadata=LOAD)
    gpu_memory: str | int | None = field(default=None, metadata=LOAD)
    host_profile: Any = field(default=None, metadata=LOAD)  # str | Path | nested counts | None
    speculative: str | None = field(default=None, metadata=LOAD)
    block: int = field(default=4, metadata=LOAD)
    block_k: int | None = field(default=None, metadata=LOAD)
    verify: str = field(default=DEFAULT_VERIFY, metadata=LOAD)
    copy_retries: int | None = field(default=None, metadata=BOTH)
    prefill_chunk: int | None = field(default=None, metadata=BOTH)
    threads: int | None = field(default=None, metadata=LOAD)
    context: int | None = field(default=None, metadata=LOAD)
    cpu_dot: str = field(default="auto", metadata=LOAD)
    progress: bool | None = field(default=None, metadata=BOTH)

    def __post_init__(self) -> None:
        """The checks that need no checkpoint, each a one-line ValueError / TypeError."""
        vocab.graphs_choice(self.graphs)
        vocab.parse_experts_on(self.experts_on)
        vocab.parse_verify(self.verify)
        if self.host_memory is not None:
            vocab.host_memory(self.host_memory)
        if self.gpu_memory is not None:
            vocab.parse_bytes(self.gpu_memory, "gpu_memory")
        make_policy(self.policy, self.lam, self.n)
        if isinstance(self.dtype, str):
            vocab.canonical_dtype(self.dtype)
        vocab.compute_choice(self.compute)
        vocab.decode_mode(self.decode)
        vocab.cpu_dot_choice(self.cpu_dot)
        vocab.expert_format(self.expert_format)
        vocab.dense_format(self.dense_format)
        if vocab.kv_choice(self.kv_format) == "fit" and self.gpu_memory is None:
            raise ValueError("kv_format='fit' needs gpu_memory (the memory plan picks the format)")
        if self.kv_format not in ("auto", "fit") and self.graphs is True:
            raise ValueError(
                f"kv_format={self.kv_format!r} cannot run with graphs=True: decode graphs "
                "capture a static KV cache, which has no packed form (use graphs='auto' or False)"
            )
        resolve_threads(self.threads)
        for name in ("context", "prefill_chunk"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 (tokens), got {v!r}")
        b = self.batch_slots
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"batch_slots must be an int >= 1 (slots per layer), got {b!r}")
        n = self.batch
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"batch must be an int >= 1 (sequences), got {n!r}")
        if b is not None and self.plans_slots:
            raise ValueError(
                "batch_slots with gpu_memory needs slots or residency (the plan would "
                "choose the solo slots the batch's slab is sized against)"
            )
        # speculative / block: checked with the drafter files (psr.models.drafters).

    @classmethod
    def of(cls, caller: str, **options: Any) -> LoadConfig:
        """The config of a call's keywords; one `caller` does not take is a TypeError, as
        for any function (`offload` takes the fields marked offload)."""
        names = cls.option_names(offload_only=caller == "offload")
        extra = sorted(set(options) - set(names))
        if extra:
            raise TypeError(f"{caller}() got an unexpected keyword argument {extra[0]!r}")
        return cls(**options)

    @classmethod
    def option_names(cls, offload_only: bool = False) -> list[str]:
        return [
            f.name for f in dataclasses.fields(cls) if f.metadata["offload"] or not offload_only
        ]

    def options(self) -> dict[str, Any]:
        """The keywords `psr.load` takes for this config: `psr.load(path, **cfg.options())`."""
        return {name: getattr(self, name) for name in self.option_names()}

    def replace(self, **changes: Any) -> LoadConfig:
        return dataclasses.replace(self, **changes)

    @property
    def store_format(self) -> str | None:
        """The store's expert format: None (the model's dtype), 'bf16' or a quantized one."""
        return vocab.expert_format(self.expert_format)

    @property
    def slot_residency(self) -> float | None:
        """The residency slots come from (None with `slots`): as given, else the default
        (with `gpu_memory`, psr.load replaces it by the plan's slots)."""
        if self.residency is None and self.slots is None:
            return DEFAULT_RESIDENCY
        return self.residency

    def batch_slab(self, capacity: int, num_experts: int, cuda: bool) -> int | None:
        """The `batch_slots` in effect for solo slots `capacity`: as given, else on CUDA a
        `batch`'s union, min(num_experts, batch x capacity) (None: the solo slots)."""
        n = self.batch or 1
        if self.batch_slots is not None or not cuda or n == 1 or self.plans_slots:
            return self.batch_slots
        return min(num_experts, n * capacity)

    @property
    def plans_slots(self) -> bool:
        """The memory plan chooses the slots: `gpu_memory` without `residency` or `slots`."""
        return self.gpu_memory is not None and self.residency is None and self.slots is None

    @property
    def placement(self) -> tuple[str, int | list[int] | None]:
        """(where misses are computed, the hybrid cap) of `experts_on`."""
        return vocab.parse_experts_on(self.experts_on)

    @property
    def show_progress(self) -> bool:
        """Progress bars: as asked, or (None) only when stderr is a terminal."""
        return sys.stderr.isatty() if self.progress is None else bool(self.progress)

    def make_policy(self) -> Policy:
        return make_policy(self.policy, self.lam, self.n)
