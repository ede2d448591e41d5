"""Batch-1 decoding with transformers' KV cache: teacher-forced logits and generation.

The model's own forward does the work (psr's modules sit inside it); this module only
drives it one token at a time, so every decode step runs under the routing policy.
Sampling uses transformers' own logits warpers, with psr's seeded generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from psr.runtime.kv import cache_kwarg, output_cache
from psr.store import cpu_kernels

DEFAULT_MAX_NEW_TOKENS = 32

# GenerationConfig fields psr's loop does not implement, with the value that means "off":
# set to anything else they are refused, never silently ignored.
_UNSUPPORTED: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "constraints": None,
    "sequence_bias": None,
    "min_length": 0,
    "min_new_tokens": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "guidance_scale": 1.0,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
    "watermarking_config": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "penalty_alpha": None,
    "diversity_penalty": 0.0,
    "num_beam_groups": 1,
    "dola_layers": None,
    "stop_strings": None,
    "max_time": None,
    "prompt_lookup_num_tokens": None,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
}
# Tokenizer outputs that decoder-only MoE models ignore (transformers passes them on to a
# forward that drops them).
_IGNORED_INPUTS = ("token_type_ids",)


@dataclass(frozen=True)
class Settings:
    """How to decode, resolved from arguments and a GenerationConfig."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    eos_token_ids: tuple[int, ...] = ()


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    items = [value] if not isinstance(value, (list, tuple)) else list(value)
    if any(isinstance(x, bool) or not isinstance(x, Integral) for x in items):
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(int(x) for x in items)


def resolve_settings(
    prompt_len: int,
    explicit: Mapping[str, Any],
    generation_config: Any = None,
    kwargs: Mapping[str, Any] | None = None,
) -> Settings:
    """Settings as transformers' `generate` reads them: `explicit` arguments (None: unset)
    over `kwargs` (GenerationConfig fields) over `generation_config`'s fields over psr's
    defaults (greedy, 32 new tokens). The model's own generation_config is not applied."""
    fields: dict[str, Any] = {}
    if generation_config is not None:
        if not hasattr(generation_config, "to_dict"):
            raise TypeError(
                "generation_config must be a transformers GenerationConfig, "
                f"got {type(generation_config).__name__}"
            )
        fields.update(generation_config.to_dict())
    if kwargs:
        from transformers import GenerationConfig

        known = GenerationConfig().to_dict()
        for key, value in kwargs.items():
            if key in _IGNORED_INPUTS:
                continue
            if key not in known:
                raise TypeError(f"generate() got an unexpected keyword argument {key!r}")
            fields[key] = value
    fields.update({k: v for k, v in explicit.items() if v is not None})

    for key in ("num_beams", "num_return_sequences"):
        v = fields.get(key)
        if v is not None and v != 1:
            raise ValueError(
                f"{key}={v!r}: psr decodes one sequence, greedy or sampled "
                "(no beam search, one sequence returned)"
            )
    for key, off in _UNSUPPORTED.items():
        v = fields.get(key)
        if v is not None and v != off:
            raise ValueError(
                f"{key}={v!r}: psr's generate does not implement it; model.hf.generate(...) "
                "runs transformers' own loop on the offloaded model (batch 1)"
            )

    max_new = fields.get("max_new_tokens")
    if max_new is None and fields.get("max_length") is not None:
        max_new = max(0, _count("max_length", fields["max_length"]) - prompt_len)
    s = Settings(
        max_new_tokens=_count(
            "max_new_tokens", DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
        ),
        do_sample=bool(fields.get("do_sample") or False),
        temperature=1.0 if fields.get("temperature") is None else fields["temperature"],
        top_k=_count("top_k", fields.get("top_k") or 0),
        top_p=1.0 if fields.get("top_p") is None else fields["top_p"],
        min_p=fields.get("min_p"),
        eos_token_ids=_eos_ids(fields.get("eos_token_id")),
    )
    if s.do_sample:
        t, p = s.temperature, s.top_p
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (t, p))
        if not (ok and math.isfinite(t) and t > 0 and 0 < p <= 1):
            raise ValueError("sampling needs a finite temperature > 0 and 0 < top_p <= 1")
        if s.min_p is not None and not 0 <= s.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {s.min_p!r}")
    return s


def warpers(s: Settings) -> Any:
    """transformers' sampling warpers for `s`, in the order its `generate` applies them."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out = LogitsProcessorList()
    if s.temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(s.temperature)))
    if s.top_k:
        out.append(TopKLogitsWarper(top_k=s.top_k))
    if s.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(s.top_p)))
    if s.min_p is not None:
        out.append(MinPLogitsWarper(min_p=float(s.min_p)))
    return out


# A prompt's prefill: (ids [1, T], keep every position's logits?) -> (logits [1, T or 1,
# V], the KV cache).
Prefill = Callable[[torch.Tensor, bool], tuple[torch.Tensor, Any]]


def _prefill(hf: nn.Module, ids: torch.Tensor, keep_all: bool) -> tuple[torch.Tensor, Any]:
    """The prompt as one forward (no chunking)."""
    out = hf(input_ids=ids, use_cache=True)
    return (out.logits if keep_all else out.logits[:, -1:]), output_cache(out)


@torch.no_grad()
def decode_logits(
    hf: nn.Module, ids: torch.Tensor, prompt_len: int, prefill: Prefill | None = None
) -> torch.Tensor:
    """Logits `[1, T, V]`: prefill `ids[:, :prompt_len]` (by `prefill`, default one
    forward), then one decode step per token."""
    kv_name = cache_kwarg(hf)
    first, kv = (prefill or (lambda p, k: _prefill(hf, p, k)))(ids[:, :prompt_len], True)
    logits = [first]
    for t in range(prompt_len, ids.shape[1]):
        out = hf(input_ids=ids[:, t : t + 1], use_cache=True, **{kv_name: kv})
        kv = output_cache(out)
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def next_token(
    logits: torch.Tensor, ids: torch.Tensor, warp: Any, gen: torch.Generator
) -> torch.Tensor:
    """The next token `[1, 1]` from the last position's logits `[V]`, on their device: the
    arg-max, or (`warp`: transformers' warpers) a draw from the warped softmax with `gen`
    (a generator on the logits' device)."""
    logits = logits.float()
    if warp is None:
        return logits.argmax().view(1, 1)
    scores = warp(ids, logits[None])
    return torch.multinomial(torch.softmax(scores, -1), 1, generator=gen).view(1, 1)


def token_readout(raw: torch.Tensor, nxt: torch.Tensor, top: int) -> torch.Tensor:
    """`[token, its logprob, top logprobs..., their ids...]` (float32, on the device) from
    the raw logits `[V]`: what one host read returns when logprobs are asked for."""
    lp = torch.log_softmax(raw.float(), -1)
    parts = [nxt.view(1).float(), lp[nxt.view(1)]]
    if top:
        values, indices = lp.topk(top)
        parts += [values, indices.float()]  # ids < 2**24: exact in float32
    return torch.cat(parts)


@torch.no_grad()
def _prompt_logits(
    hf: nn.Module, ids: torch.Tensor, graph: Any, prefill: Prefill | None
) -> tuple[torch.Tensor, Any]:
    """The prompt's last logits and the KV cache after it (None: the graph's static one)."""
    if prefill is not None:
        last, kv = prefill(ids, False)
        return last[0, -1], kv
    if graph is not None:
        return graph.prefill(ids)[0], None
    last, kv = _prefill(hf, ids, False)
    return last[0, -1], kv


def _read_token(raw: torch.Tensor, nxt: torch.Tensor, logprobs: Any) -> int:
    """The chosen token, in the one host read per token (end of sequence, streaming);
    with `logprobs`, the same one read, wider: its log-prob and the top ones, given to it."""
    if logprobs is None:
        return int(nxt)
    k = logprobs.top
    row = token_readout(raw, nxt, k).tolist()
    token = int(row[0])
    logprobs.add(
        token,
        row[1],
        [(int(t), v) for v, t in zip(row[2 : 2 + k], row[2 + k :], strict=True)],
    )
    return token


class TokenChooser:
    """One sequence's choice of each next token from its logits, as `generate` makes it:
    the logits processor, then the arg-max or a seeded draw from the warped softmax, the
    logprobs read with the token. A batched decoder (psr serve's slots) makes each
    sequence's choices with its own chooser, so its tokens are those of its solo run."""

    def __init__(
        self,
        ids: torch.Tensor,
        settings: Settings,
        seed: int = 0,
        logits_processor: Any = None,
        logprobs: Any = None,
    ) -> None:
        self.ids, self.settings = ids, settings
        self.processor, self.logprobs = logits_processor, logprobs
        self.warp = warpers(settings) if settings.do_sample else None
        self.gen = torch.Generator(device=ids.device).manual_seed(seed)
        self.eos = set(settings.eos_token_ids)
        self.new = 0  # tokens chosen
        self.done = settings.max_new_tokens == 0  # EOS chosen or max_new_tokens reached

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from the last position's logits `[V]` (appended to `ids`)."""
        raw = logits
        if self.processor is not None:
            logits = self.processor(self.ids, logits.float()[None])[0]
        nxt = next_token(logits, self.ids, self.warp, self.gen)
        self.ids = torch.cat([self.ids, nxt], dim=1)
        token = _read_token(raw, nxt, self.logprobs)
        self.new += 1
        self.done = token in self.eos or self.new >= self.settings.max_new_tokens
        return token


def generate(
    hf: nn.Module,
    ids: torch.Tensor,
    settings: Settings,
    *,
    seed: int = 0,
    streamer: Any = None,
    progress: bool = False,
    graph: Any = None,
    logits_processor: Any = None,
    logprobs: Any = None,
    prefill: Prefill | None = None,
    torch_threads: int | None = None,
) -> torch.Tensor:
    """Greedy or sampled decoding of `ids [1, T]`; returns `[1, T + new]`.

    The token is chosen on the model's device (`next_token`): greedy arg-max, or
    transformers' warpers on the float32 logits and a draw from their softmax with a
    generator on that device seeded by `seed` (on the CPU: the draws transformers' own
    `generate` makes after `torch.manual_seed(seed)`; on CUDA the device's generator,
    whose draws differ from the CPU's). The host reads each new token once (end of
    sequence, streaming). `graph` (a psr.runtime.graphs.DecodeGraph): decode tokens are
    replays of one captured forward over its static cache; else the model's forward with
    transformers' dynamic cache. `prefill` runs the prompt (psr.runtime.chunked: in
    chunks, through the graph's static cache when there is one); default one forward.
    `streamer` (transformers' protocol) gets the prompt, then each new token, then end().

    `logits_processor` (transformers' `(ids, scores [1, V]) -> scores`, on the device) runs
    on the float32 logits before the warpers and the arg-max. `logprobs` (an object with
    an int `top` and `add(token, logprob, top)`, top a list of (id, logprob)) gets each
    chosen token's log-softmax of the raw logits and the `top` largest, computed on the
    device and read with the token in the same single host read. `torch_threads`: torch's
    own ops' threads during the decode steps, psr's CPU kernels keeping theirs
    (cpu_kernels.torch_ops_threads; None: as they are)."""
    s = settings
    chooser = TokenChooser(ids, s, seed, logits_processor, logprobs)
    if streamer is not None:
        streamer.put(ids.cpu())
    try:
        if s.max_new_tokens == 0:
            return ids
        P = ids.shape[1]
        logits, kv = _prompt_logits(hf, ids, graph, prefill)
        bar = tqdm(range(s.max_new_tokens), disable=not progress, desc="decode", leave=False)
        with cpu_kernels.torch_ops_threads(torch_threads):
            return _decode(hf, bar, chooser, logits, kv, streamer, graph, P)
    finally:
        if streamer is not None:
            streamer.end()  # also on an error: a consumer waiting on it is released


def _decode(
    hf: nn.Module, bar: Any, chooser: TokenChooser, logits: torch.Tensor, kv: Any,
    streamer: Any, graph: Any, P: int,
) -> torch.Tensor:  # fmt: skip
    """`generate`'s decode steps after the prompt's logits: each token chosen, streamed, and
    fed back (a graph replay or the model's forward over the cache `kv`)."""
    kv_name = cache_kwarg(hf)
    for i in bar:
        token = chooser.choose(logits)
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        if chooser.done:
            break
        nxt = chooser.ids[:, -1:]
        if graph is not None:
            logits = graph.step(nxt, P + i)[0]
        else:
            out = hf(input_ids=nxt, use_cache=True, **{kv_name: kv})
            kv = output_cache(out)
            logits = out.logits[0, -1]
    return chooser.ids
