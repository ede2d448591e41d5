"""OffloadedModel: a transformers causal LM whose MoE experts live in a psr store.

model = psr.load("path/to/checkpoint", policy="psr", residency=0.5)
ids = model.generate(input_ids, max_new_tokens=64)
ids = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=64)
print(model.stats.table())
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from numbers import Integral
from typing import Any, ParamSpec, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from psr.machine import MachineProfile, PrefillSplit
from psr.policy import Policy, make_policy
from psr.runtime import chunked
from psr.runtime import generate as gen
from psr.runtime.engine import OffloadRuntime
from psr.runtime.graphs import MAX_GRAPHS, SPECULATIVE, DecodeGraph, bucket, graphs_unavailable
from psr.runtime.stats import Stats
from psr.runtime.trace import TraceRecorder
from psr.runtime.verify import VerifyRule, make_verify
from psr.store import StoreError, cpu_dot

_UIDS = itertools.count()  # one per OffloadedModel: prompt-cache keys never cross models
_P = ParamSpec("_P")
_R = TypeVar("_R")


ROWS_FROM = "psr_rows_from"  # on a row-invariant model: the attention implementation it replaced


def rows_forward(hf: nn.Module, on: bool) -> None:
    """The transformers side of the row-invariant forward on (`on`) or off: the attention
    implementation of every config in `hf` (`psr_rows`, or back to the one it replaced),
    its float linears (RowLinear, or back) and its audited attention modules' fused
    forward (attention.fuse). `psr.restore` turns it off."""
    from psr.runtime import attention
    from psr.runtime.dense import to_row_linears

    was = getattr(hf, ROWS_FROM, None)
    if on == (was is not None):
        return
    configs: dict[int, Any] = {id(m.config): m.config for m in hf.modules() if hasattr(m, "config")}
    impl: Any = was
    if on:
        attention.register()
        config: Any = hf.config
        setattr(hf, ROWS_FROM, config._attn_implementation)
        impl = attention.ATTENTION
    else:
        delattr(hf, ROWS_FROM)
    for c in configs.values():
        c._attn_implementation = impl
    to_row_linears(hf, on)
    attention.fuse(hf, on)  # the audited attention forwards in one kernel call


@runtime_checkable
class _SavesPretrained(Protocol):
    """A transformers model's saving method (what `OffloadedModel.save_pretrained` calls)."""

    def save_pretrained(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> None: ...


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


class OffloadedModel(nn.Module):
    """A transformers causal LM whose MoE experts are offloaded under a routing policy.

    One sequence at a time: its methods hold the runtime's lock for their whole call, so
    calls from several threads wait for each other. `close()` (or `with ... as model`)
    frees the expert store at once; dropping the last reference frees it too.
    `restorer` (given by psr.load / psr.offload) undoes the offloading: `restore()`.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        runtime: OffloadRuntime,
        tokenizer: Any = None,
        path: str | None = None,
        *,
        restorer: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.hf = hf_model
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.path = path
        self._restorer = restorer
        # Where the policy's lam / n came from (psr.points.resolve_policy): "tuned (<file>)",
        # "untuned default" or "given"; psr.load sets it.
        self.policy_source = "given"
        self.host_budget: int | None = None  # host_memory= (None: unlimited)
        # psr.load's threads= (the CPU threads it set; None: not set by psr) and context=
        # (None: the config's max_position_embeddings): `context` reads both.
        self.threads: int | None = None
        self.context_limit: int | None = None
        # Graphs: a decode token as one captured forward (runtime/graphs.py): True, False or
        # "auto" (on for CUDA); `graph_status` says whether the last generate used them.
        self.graphs: bool | str = "auto"
        self.graph_status = "not used yet"
        self._graphs: OrderedDict[int, DecodeGraph] = OrderedDict()  # by length, LRU last
        # Speculative decoding (set_speculative): the drafter, the verify rule's word and
        # budget's set size (the rule is built per call, against the placement then).
        self.drafter: Any = None
        self.verify: str | None = None
        self._block_k: int | None = None
        self.spec_stats: Any = None
        self._uid = next(_UIDS)
        # Tokens per prefill chunk (set_prefill_chunk): the default, at most the context.
        limit = getattr(self.config, "max_position_embeddings", None)
        chunk = chunked.DEFAULT_PREFILL_CHUNK
        self.prefill_chunk = min(chunk, int(limit)) if limit else chunk
        # Layer-major prefill (set_layer_major, runtime/streamed.py) and what it issued last.
        self.layer_major = False
        self.prefill_schedules: list[Any] = []

    def set_prefill_chunk(self, chunk: int) -> None:
        """Prefill prompts in chunks of `chunk` tokens at fixed boundaries (psr.runtime.
        chunked), in [1, the model's context]. Unless the forward is row-invariant
        (`row_invariant`), attention and the grouped experts round by chunk: the chunk is
        then part of the configuration (a configuration reproduces its tokens)."""
        with self.runtime.lock:
            self.prefill_chunk = chunked.check_chunk(chunk, self.context)

    def set_layer_major(self, on: bool = True) -> None:
        """Prefill layer by layer across the prompt's chunks (psr.runtime.streamed: each
        layer's used experts copied once per prompt; outputs bit-identical to chunk by
        chunk); not with a prompt cache or decode graphs (those stay chunk by chunk)."""
        if not isinstance(on, bool):
            raise ValueError(f"set_layer_major: on must be a bool, got {on!r}")
        with self.runtime.lock:
            self.layer_major = on

    def decodes_on_kernels(self) -> bool:
        """Whether a decode step's work runs on psr's CPU kernels: the CPU backend, experts
        on the kernels and no float linear left to torch (a GGUF model's dense blocks, or
        the row-invariant forward's RowLinears). `generate` then decodes with torch's own
        ops on one thread and the kernels on `threads` (cpu_kernels.torch_ops_threads)."""
        from psr.runtime.dense import row_invariant

        rt = self.runtime
        if rt.store.backend != "cpu" or self.device.type != "cpu":
            return False
        if not all(c.cpu_kernels for c in rt.computes):
            return False
        return not any(isinstance(m, nn.Linear) and not row_invariant(m) for m in self.hf.modules())

    @property
    def row_invariant(self) -> bool:
        """Whether the forward computes every token's hidden states, KV, routed ids and
        logits bit-identically whatever the other tokens of the forward (any prefill
        chunking; a decode step as that row of a prefill): then a prompt-cache hit
        resumes at any cached prefix length (psr.runtime.chunked)."""
        return getattr(self.hf, ROWS_FROM, None) is not None

    def row_invariant_blocker(self) -> str | None:
        """Why this model's forward cannot be made row-invariant (None: it can): the CPU
        backend only, attention rows_attention computes, experts the CPU kernels compute."""
        from psr.runtime.attention import why_not_rows

        rt = self.runtime
        if rt.store.backend != "cpu" or self.device.type != "cpu":
            return "the CPU backend only"
        why = why_not_rows(self.config)
        if why is not None:
            return why
        hosts = [rt.store.host(i) for i in range(len(rt.layers))]
        if not all(
            c.cpu_kernels and c.host_layout(h) is not None
            for c, h in zip(rt.computes, hosts, strict=True)
        ):
            return "experts the CPU kernels do not compute (biases, scaled inputs, the format)"
        return None

    def set_row_invariant(self, on: bool = True) -> None:
        """Make the CPU forward row-invariant (`on`) or not: float linears through
        `cpu_linear` (runtime/dense.py: RowLinear), attention by the `cpu_attention` kernel
        (runtime/attention.py), prefill's experts through the CPU kernels at any count
        (runtime/compute.py). Decode graphs stay off while it is on (a static cache).
        A model that cannot be (`row_invariant_blocker`): a one-line ValueError."""
        with self.runtime.lock:
            if bool(on) == self.row_invariant:
                return
            if on and (why := self.row_invariant_blocker()) is not None:
                raise ValueError(f"row-invariant forward unavailable: {why}")
            rows_forward(self.hf, bool(on))
            for c in self.runtime.computes:
                c.row_invariant = bool(on)

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def context(self) -> int | None:
        """The context in tokens: psr.load's `context`, else the config's
        max_position_embeddings (None when the config has none)."""
        if self.context_limit is not None:
            return self.context_limit
        cfg = self.config
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit is None:  # a wrapper's: its text model's
            limit = getattr(getattr(cfg, "text_config", None), "max_position_embeddings", None)
        return None if limit is None else int(limit)

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def stats(self) -> Stats:
        """Decode statistics (reading them reads the device step's counts: one sync)."""
        with self.runtime.lock:
            stats = self.runtime.stats
            stats.threads = self.threads or torch.get_num_threads()
            return stats

    @property
    def policy(self) -> Policy:
        return self.runtime.policy

    def reset_stats(self) -> None:
        with self.runtime.lock:
            self.runtime.reset_stats()

    def close(self) -> None:
        """Free the expert store (host memory, device slab, copy thread); idempotent.
        The model cannot decode afterwards."""
        with self.runtime.lock:
            self.runtime.store.close()

    @property
    def closed(self) -> bool:
        return bool(self.runtime.store.closed)

    def memory(self, context: int | None = None) -> dict[str, int]:
        """Bytes by place: `host_experts` (the routed experts' rows held in host memory, as
        copies move them; pinned on CUDA), `pageable_experts` (rows beyond `host_memory`,
        left in the memory-mapped checkpoint), `device_slab` (the expert slots),
        `device_dense` (every other weight and buffer on the compute device: attention,
        norms, embeddings, routers, shared experts) and `device_kv` (a KV cache of
        `context` tokens, default the model's `context`, in its KV format)."""
        store = self.runtime.store
        rows = store.expert_bytes
        held = [L.num_experts if L.num_held is None else L.num_held for L in store.layers]
        host = sum(h * b for h, b in zip(held, rows, strict=True))
        total = sum(L.num_experts * b for L, b in zip(store.layers, rows, strict=True))
        slab = sum(L.num_slots * b for L, b in zip(store.layers, rows, strict=True))
        seen: set[int] = set()
        dense = 0
        for t in [*self.hf.parameters(), *self.hf.buffers()]:
            if t.is_meta or t.data_ptr() in seen:  # meta: replaced experts; shared: tied
                continue
            seen.add(t.data_ptr())
            dense += t.numel() * t.element_size()
        n = context if context is not None else int(self.context or 0)
        return {
            "host_experts": host,
            "pageable_experts": total - host,
            "device_slab": slab,
            "device_dense": dense,
            "device_kv": self._kv_bytes(n),
        }

    def _kv_bytes(self, tokens: int) -> int:
        """Bytes of this model's KV cache holding `tokens` tokens, in its KV format (a
        packed one's values and scales: runtime/kv_quant.py), as the memory plan counts."""
        from psr.runtime.kv import kv_bytes

        itemsize = next(p for p in self.hf.parameters() if not p.is_meta).element_size()
        return kv_bytes(self.config, itemsize, tokens, getattr(self.hf, "psr_kv_format", "auto"))

    def restore(self) -> nn.Module:
        """`psr.restore(model)`: the transformers model with its own router and experts
        modules back (weights from the host store, on its device, in its dtype), psr's hooks
        removed and the store closed. Returns it; this wrapper cannot decode afterwards."""
        if self._restorer is None:
            raise RuntimeError("this OffloadedModel was built without a restorer")
        return self._restorer(self.hf)

    def save_pretrained(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
        """transformers' `save_pretrained` of the model (`kwargs` passed on), and of the
        tokenizer if any: a checkpoint that `psr.load` and `from_pretrained` read back,
        experts under their original names. The experts are read from the host store with
        no copy of it; transformers makes one shard at a time contiguous while writing."""
        with self.runtime.lock:
            hf = self.hf
            if not isinstance(hf, _SavesPretrained):
                raise TypeError(f"save_pretrained: {type(hf).__name__} is not a transformers model")
            hf.save_pretrained(save_directory, **kwargs)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(save_directory)

    def __enter__(self) -> OffloadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def configure(
        self,
        policy: str | Policy = "psr",
        residency: float | None = 0.5,
        *,
        slots: int | None = None,
        lam: float | None = None,
        n: int | None = None,
    ) -> None:
        """Switch policy and residency without reloading: slots per layer may not exceed
        what the store was built with. Stats are kept (call reset_stats())."""
        with self.runtime.lock:
            self.runtime.configure(make_policy(policy, lam, n), residency, slots)

    def set_experts_on(
        self, experts_on: str = "gpu", hybrid_m: int | Sequence[int] | None = None
    ) -> list[int | None]:
        """Where decode steps compute misses: 'gpu' (every miss copied: the default), 'cpu'
        (none copied: computed on the CPU from the host rows) or 'hybrid' (at most
        `hybrid_m` per MoE layer copied, one int or one per layer; default: chosen from
        this machine's profile, `psr bench machine`). Returns the per-layer caps (None:
        all copied); the next forward starts a new sequence."""
        from psr.runtime.placement import set_experts_on

        with self.runtime.lock:
            return set_experts_on(self.runtime, experts_on, hybrid_m)

    def set_prefill_split(
        self, split: PrefillSplit | None = None, profile: MachineProfile | None = None
    ) -> PrefillSplit:
        """Which experts a prefill chunk staged through the slab (CUDA) computes on the CPU
        from their host rows instead of copying: those used by fewer of the chunk's tokens
        than their layer's threshold (psr.machine.PrefillSplit). Default: chosen from this
        machine's profile (`psr bench machine`), every expert copied without one. Part of
        the configuration (the CPU kernels round differently); never changes routing or
        the caches' seed."""
        from psr.runtime.placement import set_prefill_split

        with self.runtime.lock:
            return set_prefill_split(self.runtime, split, profile)

    @property
    def experts_on(self) -> str:
        return self.runtime.experts_on

    def record_trace(self) -> TraceRecorder:
        """Start recording decode steps; the recorder's `.trace` feeds psr.eval.latency."""
        return self.runtime.new_recorder()

    def _ids(self, input_ids: torch.Tensor | Iterable[int], extra: int = 0) -> torch.Tensor:
        if isinstance(input_ids, torch.Tensor):
            if (
                input_ids.dtype.is_floating_point
                or input_ids.dtype.is_complex
                or (input_ids.dtype == torch.bool)
            ):
                raise TypeError(f"token ids must be an integer tensor, got {input_ids.dtype}")
            ids = input_ids.to(torch.long)
        else:
            items = list(input_ids)
            flat = items[0] if len(items) == 1 and isinstance(items[0], (list, tuple)) else items
            bad = [x for x in flat if isinstance(x, bool) or not isinstance(x, Integral)]
            if bad:
                raise TypeError(f"token ids must be ints, got {bad[0]!r}")
            ids = torch.tensor(items, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(
                f"psr decodes one sequence (batch 1); input_ids has shape {list(ids.shape)}"
            )
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        self._check_context(ids.shape[1], extra)
        vocab = self.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids.to(self.device)

    def _check_open(self) -> None:
        # After restore() the transformers model runs without psr: refuse, as after close().
        if self.runtime.store.closed:
            raise StoreError("OffloadedModel: the expert store is closed (close() or restore())")

    def _check_context(self, prompt_len: int, extra: int) -> None:
        limit = self.context
        if limit is not None and prompt_len + extra > limit:
            raise ValueError(
                f"prompt of {prompt_len} tokens + {extra} new exceeds the model's "
                f"context of {limit} tokens"
            )

    def _call(self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """A decoding call: afterwards the device step's counts are read and router inputs
        that were not finite raise (`OffloadRuntime.end_call`)."""
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            self.runtime.end_call(check=False)
            raise
        self.runtime.end_call()
        return out

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[1, T, V]` of one prefill over `input_ids` (exact routing: all prefill)."""
        with self.runtime.lock:
            self._check_open()
            logits: torch.Tensor = self.hf(input_ids=self._ids(input_ids), use_cache=False).logits
            return logits

    def check_prompt_cache(self, cache: chunked.PromptCache) -> None:
        """Refuse (one line) a prompt cache whose budget is below one prefill chunk's KV."""
        chunk = self.prefill_chunk
        cache.check_budget(self._kv_bytes(chunk), chunk)

    def _prefill_key(self, graphs: bool) -> tuple[Any, ...]:
        """What a prompt-cache entry is keyed by besides the tokens: this model and its
        whole configuration (never shared between models, policies or configurations),
        the CPU kernels' dot path included (process-wide: a later load may change it)."""
        rt = self.runtime
        return (
            self._uid, rt.policy, rt.capacity, rt.experts_on, tuple(rt.inserts),
            rt.decode_mode, rt.block_k, "rows" if self.row_invariant else self.prefill_chunk,
            graphs, rt.prefill_split, cpu_dot(),
        )  # fmt: skip

    def _prefill(self, graph: DecodeGraph | None, cache: chunked.PromptCache | None) -> Any:
        """The prompt's prefill for `gen.generate` / `gen.decode_logits`: in chunks of
        `prefill_chunk`, through `graph`'s static cache if any, resumed from and kept in
        the prompt `cache` if any."""
        chunk = self.prefill_chunk
        if cache is not None:
            self.check_prompt_cache(cache)
        key = self._prefill_key(graph is not None)
        if self.layer_major and graph is None and cache is None:
            from psr.runtime.streamed import layer_major_prefill

            return layer_major_prefill(self, chunk)
        if graph is not None:

            def forward(part: torch.Tensor, pos: int, kv: Any) -> tuple[torch.Tensor, Any]:
                return graph.prefill(part, pos)[:, None], graph.cache

            def forward_for(keep_all: bool) -> chunked.Forward:
                return forward

        else:
            from psr.runtime.kv import cache_kwarg, output_cache

            name = cache_kwarg(self.hf)

            def forward_for(keep_all: bool) -> chunked.Forward:
                # Only the last position's logits are used unless keep_all: the LM head over
                # every prompt row was most of a CPU prefill's dense work (issue 36).
                keep = {} if keep_all else {"logits_to_keep": 1}

                def forward(part: torch.Tensor, pos: int, kv: Any) -> tuple[torch.Tensor, Any]:
                    past = {} if kv is None else {name: kv}
                    out = self.hf(input_ids=part, use_cache=True, **past, **keep)
                    return out.logits, output_cache(out)

                return forward

        into = None if graph is None else graph.cache
        any_length = self.row_invariant and graph is None
        return lambda ids, keep_all: chunked.prefill(
            self.runtime, forward_for(keep_all), ids, chunk, cache, key, into, keep_all, any_length
        )

    @torch.no_grad()
    def decode_logits(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Logits `[1, T, V]`: prefill the first `prompt_len` tokens (in chunks of
        `prefill_chunk`), then feed the rest one decode step at a time (teacher forcing)
        under the policy."""
        ids = self._ids(input_ids)
        prompt_len = _check_count("prompt_len", prompt_len)
        if not 1 <= prompt_len <= ids.shape[1]:
            raise ValueError(f"prompt_len must be in [1, {ids.shape[1]}], got {prompt_len}")
        with self.runtime.lock:
            self._check_open()
            prefill = self._prefill(None, None)
            return self._call(gen.decode_logits, self.hf, ids, prompt_len, prefill)

    @torch.no_grad()
    def score(
        self, input_ids: torch.Tensor | Iterable[int], prompt_len: int, *, block: int = 1
    ) -> torch.Tensor:
        """`decode_logits` in one forward: the same routing, counts and trace (each token
        after `prompt_len` routed as a decode step under the policy, its prefetches
        applied in decoding's order), with batched attention and experts read from the
        host copies, so logits agree with `decode_logits` to floating-point rounding.
        No copies are issued: stall time is not measured. Logical-cache policies only.

        With a speculative drafter attached, `block` > 1 scores the tokens after the
        prompt in verify blocks of `block` tokens (one expert set per layer and block),
        as speculative decoding would verify them if every draft were accepted."""
        ids = self._ids(input_ids)
        prompt_len = _check_count("prompt_len", prompt_len)
        with self.runtime.lock:
            self._check_open()
            blocks = block > 1
            if blocks:
                if self.drafter is None:
                    raise ValueError("score(block=...) needs a speculative model (a drafter)")
                self.runtime.set_block_mode(self.verify_rule())
            self.runtime.begin_scoring(prompt_len, ids.shape[1], block)
            try:
                logits: torch.Tensor = self.hf(input_ids=ids, use_cache=False).logits
                return logits
            finally:
                self.runtime.end_scoring()
                if blocks:
                    self.runtime.set_block_mode(None)

    def set_speculative(
        self, drafter: Any, block_k: int | None = None, verify: str | None = None
    ) -> None:
        """Decode speculatively with `drafter` (psr.runtime.speculative.Drafter), each
        verify block routed as `verify` says (runtime/verify.py): 'budget', one set of
        `block_k` experts per layer and block (default psr.policy.default_block_k), or
        'cpu' / 'cpu:M', each token's own top-k with the experts outside the slab on the
        CPU (None: psr.policy.DEFAULT_VERIFY). `drafter=None` switches it off."""
        with self.runtime.lock:
            if drafter is None:
                self.drafter, self.verify, self._block_k = None, None, None
                return
            rt = self.runtime
            old = (self.drafter, self.verify, self._block_k)
            self.drafter, self.verify, self._block_k = drafter, verify, block_k
            try:
                rt.set_block_mode(self.verify_rule())  # the checks, now
            except ValueError:
                self.drafter, self.verify, self._block_k = old
                raise
            finally:
                rt.set_block_mode(None)

    @property
    def block_k(self) -> int | None:
        """Experts per layer and verify block under verify='budget' (None otherwise)."""
        return None if self.drafter is None else self.verify_rule().block_k

    def verify_rule(self) -> VerifyRule:
        """The speculative drafter's verify rule against the current slots and placement."""
        if self.drafter is None:
            raise ValueError("no speculative drafter attached (set_speculative)")
        rt = self.runtime
        return make_verify(self.verify, self._block_k, rt.spec.top_k, rt.capacity, rt.placement)

    def _generate_speculative(
        self, ids: torch.Tensor, settings: Any, streamer: Any
    ) -> torch.Tensor:
        from psr.runtime.speculative import generate_speculative

        if settings.do_sample:
            raise ValueError("speculative decoding is greedy: do_sample must be False")
        if len(settings.eos_token_ids) > 1:
            raise ValueError("speculative decoding takes one eos_token_id")
        eos = settings.eos_token_ids[0] if settings.eos_token_ids else None
        rule = self.verify_rule()
        rec = self.runtime.recorder
        out, st = generate_speculative(
            self.hf,
            self.runtime,
            self.drafter,
            ids,
            settings.max_new_tokens,
            rule,
            eos_token_id=eos,
            on_block=None if rec is None else lambda _n, emitted: rec.trace.emitted.append(emitted),
            prefill_chunk=self.prefill_chunk,
            torch_threads=1 if self.decodes_on_kernels() else None,
        )
        self.spec_stats = st
        if streamer is not None:
            streamer.put(ids[0].cpu())
            streamer.put(out[0, ids.shape[1] :].cpu())
            streamer.end()
        return out

    def _decode_graph(self, length: int) -> DecodeGraph | None:
        """The decode graph for a sequence of `length` tokens, or None (and why, in
        `graph_status`) when decode tokens run eagerly."""
        auto = self.graphs == "auto"
        on = self.runtime.store.backend == "cuda" if auto else bool(self.graphs)
        if not on:
            self.graph_status = (
                "off (graphs='auto': on for CUDA only)" if auto else "off (graphs=False)"
            )
            return None
        reason = graphs_unavailable(self.runtime)
        if reason is None and self.row_invariant:
            reason = "the row-invariant forward (its attention reads a dynamic cache)"
        if reason is not None:
            self.graph_status = f"off: {reason}"
            return None
        size = bucket(length, self.context)
        try:
            graph = self._graphs.pop(size, None) or DecodeGraph(self.hf, self.runtime, size)
        except (ValueError, TypeError, NotImplementedError) as e:
            # A model whose cache transformers cannot make static (a hybrid attention it
            # lacks a static layer for): the eager device step, and the reason said.
            self.graph_status = f"off: no static KV cache for this model ({e})"
            return None
        self._graphs[size] = graph  # most recently used last
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        self.graph_status = f"on (static cache of {size} tokens)"
        return graph

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | Iterable[int],
        max_new_tokens: int | None = None,
        *,
        attention_mask: torch.Tensor | Iterable[int] | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: Any = None,
        generation_config: Any = None,
        seed: int = 0,
        progress: bool = False,
        logits_processor: Any = None,
        logprobs: Any = None,
        prompt_cache: chunked.PromptCache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Greedy (default) or sampled decoding with a KV cache; returns `[1, T + new]` ids.

        Called as transformers' `generate` is, for one unpadded sequence:
        `model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=20)`.
        Unset arguments come from `generation_config` (a transformers GenerationConfig),
        then psr's defaults: 32 new tokens, greedy (the model's own generation_config is
        not applied). Other GenerationConfig fields may be given as keywords; those psr
        does not implement (beams, penalties, ...) are refused. Sampling applies
        transformers' temperature / top-k / top-p / min-p warpers and draws with a
        generator seeded by `seed` (reproducible; `torch.manual_seed` is not touched).
        `eos_token_id`: an id or a list; `streamer`: transformers' TextStreamer protocol
        (put the prompt, then each new token; end). `logits_processor` and `logprobs`: see
        `psr.runtime.generate.generate` (not with a speculative drafter). The prompt is
        prefilled in chunks of `prefill_chunk`; `prompt_cache` (a
        psr.runtime.chunked.PromptCache the caller keeps): resume from the longest cached
        prefix of this prompt (any length while `row_invariant`, else a chunk boundary) and
        keep the new states; a hit changes nothing (tokens and logits as without it)."""
        ids = self._ids(input_ids)
        _check_unpadded(ids, attention_mask)
        settings = gen.resolve_settings(
            ids.shape[1],
            _explicit(max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id),
            generation_config,
            kwargs,
        )
        self._check_context(ids.shape[1], settings.max_new_tokens)
        with self.runtime.lock:
            self._check_open()
            if prompt_cache is not None and not isinstance(prompt_cache, chunked.PromptCache):
                raise TypeError(
                    f"prompt_cache must be a psr PromptCache, got {type(prompt_cache).__name__}"
                )
            if self.drafter is not None:
                if prompt_cache is not None:
                    raise ValueError("speculative decoding takes no prompt_cache")
                if logits_processor is not None or logprobs is not None:
                    raise ValueError(
                        "speculative decoding takes no logits_processor and reports no logprobs"
                    )
                self.graph_status = f"off: {SPECULATIVE}"
                return self._call(self._generate_speculative, ids, settings, streamer)
            return self._generate_plain(
                ids, settings, seed, streamer, progress, logits_processor, logprobs, prompt_cache
            )

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        max_new_tokens: int | None = None,
        *,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        seeds: Sequence[int] | None = None,
        max_batch: int | None = None,
        batch_invariant: bool = True,
        prompt_cache: chunked.PromptCache | None = None,
    ) -> list[list[int]]:
        """Decode several prompts together (psr.runtime.batch.BatchDecoder): returns each
        prompt's new tokens. Each sequence's tokens are its solo `generate`'s with the same
        settings and `seeds[i]` (default 0), whatever its co-runners: its own logical
        caches, each row computed as at batch 1. At most `max_batch` (default: all) decode
        at once; the others join as sequences finish (continuous batching). `prompt_cache`:
        as `generate`'s, each prompt resuming from it when its prefill begins."""
        from psr.runtime.batch import generate_batch

        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        settings = gen.resolve_settings(
            max((len(p) for p in prompts), default=0),
            _explicit(max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id),
        )
        return generate_batch(
            self, prompts, settings, list(seeds or [0] * len(prompts)),
            max_batch or max(1, len(prompts)), batch_invariant, prompt_cache,
        )  # fmt: skip

    def _generate_plain(
        self,
        ids: torch.Tensor,
        settings: gen.Settings,
        seed: int,
        streamer: Any,
        progress: bool,
        logits_processor: Any,
        logprobs: Any,
        prompt_cache: chunked.PromptCache | None,
    ) -> torch.Tensor:
        """`generate` without a drafter (under the runtime's lock): through a decode graph
        where one applies, its captures counted."""
        graph = self._decode_graph(ids.shape[1] + settings.max_new_tokens)
        captures = 0 if graph is None else graph.captures
        try:
            return self._call(
                gen.generate,
                self.hf,
                ids,
                settings,
                seed=seed,
                streamer=streamer,
                progress=progress,
                graph=graph,
                logits_processor=logits_processor,
                logprobs=logprobs,
                prefill=self._prefill(graph, prompt_cache),
                torch_threads=1 if graph is None and self.decodes_on_kernels() else None,
            )
        finally:
            if graph is not None:
                self.runtime.acct.stats.totals["captures"] += graph.captures - captures


def _explicit(
    max_new_tokens: int | None, do_sample: bool | None, temperature: float | None,
    top_k: int | None, top_p: float | None, eos_token_id: int | Sequence[int] | None,
) -> dict[str, Any]:  # fmt: skip
    """The decoding arguments given by keyword, as `gen.resolve_settings` takes them."""
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "eos_token_id": eos_token_id,
    }


def _check_unpadded(ids: torch.Tensor, attention_mask: torch.Tensor | Iterable[int] | None) -> None:
    """`generate` decodes one unpadded sequence: a mask, if given, is all ones in its shape."""
    if attention_mask is None:
        return
    mask = torch.as_tensor(attention_mask)
    if mask.dim() == 1:
        mask = mask[None]
    if list(mask.shape) != list(ids.shape):
        raise ValueError(
            f"attention_mask has shape {list(mask.shape)}, input_ids {list(ids.shape)}"
        )
    if not bool((mask == 1).all()):
        raise ValueError(
            "attention_mask has padding (zeros): psr decodes one unpadded sequence; "
            "pass the prompt without padding"
        )
