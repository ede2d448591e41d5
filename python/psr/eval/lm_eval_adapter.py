"""An lm-evaluation-harness model backed by psr: `--model psr`.

    psr lm-eval --model psr --model_args pretrained=PATH,policy=psr,residency=0.5,lam=0.3,n=1 \
        --tasks ...

lm_eval's own CLI has no plugin hook for external models, so `psr lm-eval` is that CLI
with this module imported (which registers "psr"); from Python, import this module and
call `lm_eval.simple_evaluate(model="psr", ...)`.

Requests are built exactly as `--model hf` (HFLM) builds them: lm_eval's `TemplateLM`
encodes context and continuation together (trailing whitespace of the context moves to
the continuation), an empty context becomes the prefix token (BOS, else EOS), and
`loglikelihood_rolling` uses lm_eval's rolling windows. What differs is how a request is
run: one sequence at a time, the context prefilled (exact routing; its last position
predicts the first continuation token) and the continuation fed as decode steps under
the policy, as psr serves tokens. With `policy=exact` the scores equal HFLM's
(tests/eval/test_lm_eval.py).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.models.utils_hf import stop_sequences_criteria
from tqdm.auto import tqdm

from psr.models import DEFAULT_MODEL, load

log = logging.getLogger(__name__)

# lm_eval fills these in for every model; psr has no use for them.
_IGNORED = frozenset({"max_batch_size", "trust_remote_code", "parallelize"})


@register_model("psr")
class PSRLM(TemplateLM):
    """lm_eval model over a psr-offloaded checkpoint (batch 1).

    Args (as `--model_args key=value,...`):
        pretrained: local checkpoint folder with a tokenizer (default: the embedded model).
        policy, residency, lam, n: the routing policy and its operating point (`psr.load`).
        dtype: "auto" (default, as HFLM: the checkpoint's dtype), float32, bfloat16, float16.
        device: compute device; a CUDA request without CUDA falls back to the CPU.
        max_length: context window (default: as HFLM, from the config, else 2048).
        add_bos_token, prefix_token_id: as HFLM.
        batch_size: accepted and ignored: psr decodes one sequence at a time.

    Log-probabilities are taken in float32 (HFLM takes them in the model's dtype; the two
    agree for float32 models).
    """

    _DEFAULT_MAX_LENGTH = 2048

    def __init__(
        self,
        pretrained: str | None = None,
        policy: str = "psr",
        residency: float | None = 0.5,
        lam: float | None = None,
        n: int | None = None,
        dtype: str | torch.dtype | None = "auto",
        device: str | None = None,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        batch_size: int | str | None = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if str(batch_size) not in ("1", "None"):
            log.warning("psr decodes batch 1: batch_size=%s is ignored", batch_size)
        unknown = sorted(set(kwargs) - _IGNORED)
        if unknown:
            log.warning("psr model: ignoring model_args %s", unknown)
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's CLI may pass --device cuda; without one, say so and run where psr can.
            log.warning("no CUDA device: psr model runs on the CPU")
            device = "cpu"
        self.model = load(
            pretrained or DEFAULT_MODEL,
            policy=policy,
            residency=None if residency is None else float(residency),
            lam=None if lam is None else float(lam),
            n=None if n is None else int(n),
            dtype=None if dtype in (None, "auto") else dtype,  # None: the checkpoint's
            device=device,
            progress=False,
        )
        if self.model.tokenizer is None:
            raise ValueError(f"{pretrained}: lm_eval needs a tokenizer in the checkpoint")
        self.tokenizer = self.model.tokenizer
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_length = int(max_length) if max_length else None

    # --- what TemplateLM and the harness ask of a model ---------------------------------
    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int | None:
        # HFLM's order: an explicit prefix token, else BOS, else EOS.
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return resolve_max_length(
            self.model.config, self.tokenizer, default=self._DEFAULT_MAX_LENGTH
        )

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """HFLM's encoding: the tokenizer's special tokens unless told otherwise, and none
        when the string already starts with the prefix token's text."""
        kw: dict[str, bool] = {}
        if add_special_tokens is not None:
            kw["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            kw["add_special_tokens"] = self.add_bos_token
        prefix = self.prefix_token_id
        if (
            add_special_tokens is None
            and prefix is not None
            and string.startswith(self.tokenizer.decode(prefix))
        ):
            kw["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **kw)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int] | int, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # --- scoring ------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """Score each continuation: HFLM's input window (context + continuation, left-
        truncated to max_length + 1, last token dropped); the tokens before the first
        continuation token are prefilled, the rest are decode steps."""
        out: list[tuple[float, bool]] = []
        last_key: tuple[tuple[int, ...], int] | None = None
        logp = torch.empty(0)
        for req_str, ctx, cont in tqdm(requests, disable=disable_tqdm, desc="psr loglikelihood"):
            if not ctx or ctx[0] is None:  # an empty context needs a prefix token
                raise ValueError("psr lm-eval: no BOS/EOS token: pass prefix_token_id=")
            if not cont or len(cont) > self.max_length:
                raise ValueError(
                    f"psr lm-eval: a continuation must be non-empty and at most "
                    f"{self.max_length} tokens ({len(cont)})"
                )
            if len(ctx) + len(cont) > self.max_length + 1:
                log.warning(
                    "context (%d) + continuation (%d) exceed max_length %d: left-truncated",
                    len(ctx),
                    len(cont),
                    self.max_length,
                )
            inp = (ctx + cont)[-(self.max_length + 1) :][:-1]
            plen = len(inp) - len(cont) + 1  # >= 1: len(cont) <= max_length
            key = (tuple(inp), plen)
            # Choices that differ only in their last token share one run (same logits:
            # each run begins its own sequence, so no state carries over).
            if key != last_key:
                logits = self.model.decode_logits(torch.tensor([inp]), plen)[0, plen - 1 :]
                logp = F.log_softmax(logits.float(), dim=-1)
                last_key = key
            target = torch.tensor(cont, device=logp.device)
            answer = (
                float(logp.gather(1, target[:, None]).sum()),
                bool((logp.argmax(-1) == target).all()),
            )
            out.append(answer)
            if req_str is not None:  # rolling windows are cached per document instead
                self.cache_hook.add_partial("loglikelihood", req_str, answer)
        return out

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """HFLM's disjoint rolling windows (context_len 1, prefix token first)."""
        out = []
        for (string,) in tqdm(
            [req.args for req in requests], disable=disable_tqdm, desc="psr rolling"
        ):
            windows = [
                (None, *lm_utils.make_disjoint_window(w))
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # --- generation ---------------------------------------------------------------------
    def _encode_prompt(self, string: str, left_truncate_len: int) -> list[int]:
        """HFLM's tok_batch_encode for one string."""
        kw: dict[str, bool] = {}
        bos = self.tokenizer.bos_token
        if bos is not None and string.startswith(bos):
            kw["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            kw["add_special_tokens"] = self.add_bos_token
        ids = self.tokenizer(string, **kw)["input_ids"]
        if len(ids) > left_truncate_len:
            log.warning("prompt of %d tokens left-truncated to %d", len(ids), left_truncate_len)
        ids = ids[-left_truncate_len:]
        return ids or [self.prefix_token_id]  # an empty prompt conditions on the prefix

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """As HFLM: greedy unless the task samples, stop strings (and EOS) end a generation
        and are cut from it, at most max_gen_toks new tokens. transformers' generate runs
        on the offloaded model (prefill, then decode steps under the policy)."""
        eot = self.eot_token_id
        eos = None if eot is None else self.tok_decode(eot, skip_special_tokens=False)
        hf = self.model.hf
        out = []
        for context, gen_kwargs in tqdm(
            [req.args for req in requests], disable=disable_tqdm, desc="psr generate"
        ):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if max_gen_toks >= self.max_length:
                raise ValueError(
                    f"max_gen_toks ({max_gen_toks}) must be less than max_length "
                    f"({self.max_length})"
                )
            ctx = self._encode_prompt(context, self.max_length - max_gen_toks)
            ids = torch.tensor([ctx], device=self.model.device)
            max_len = kwargs.pop("max_length", len(ctx) + max_gen_toks)
            # HFLM's _model_generate: temperature 0 means greedy.
            temp = kwargs.setdefault("temperature", 0.0)
            if temp == 0.0 and kwargs.get("do_sample") is None:
                kwargs["do_sample"] = False
            if kwargs.get("do_sample") is False and temp == 0.0:
                kwargs.pop("temperature")
            gen = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_length=max_len,
                stopping_criteria=stop_sequences_criteria(self.tokenizer, until, len(ctx), 1),
                pad_token_id=self.tokenizer.pad_token_id,
                use_cache=True,
                **kwargs,
            )
            text = postprocess_generated_text(
                self.tok_decode(gen[0, len(ctx) :].tolist()), until, None
            )
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out


def main(argv: list[str] | None = None) -> int:
    """lm_eval's CLI with the psr model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
