"""An lm-evaluation-harness model backed by psr: `--model psr`.

    psr lm-eval --model psr --model_args pretrained=PATH,policy=psr,residency=0.5,lam=0.3,n=1 \
        --tasks ...

lm_eval's own CLI has no plugin hook for external models, so `psr lm-eval` is that CLI
with this module imported (which registers "psr"); from Python, import this module and
call `lm_eval.simple_evaluate(model="psr", ...)`. Requests are scored one sequence at a
time: the context is prefilled (exact routing) and the continuation is scored as
decode steps under the policy, as the harness's likelihood tasks require.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from psr.models.embedded import DEFAULT_MODEL
from psr.models.loader import load


@register_model("psr")
class PSRLM(LM):
    def __init__(
        self,
        pretrained: str | None = None,
        policy: str = "psr",
        residency: float = 0.5,
        lam: float | None = None,
        n: int | None = None,
        dtype: str = "float32",
        device: str | None = None,
        max_length: int | None = None,
        batch_size: Any = 1,
        **_: Any,
    ) -> None:
        super().__init__()
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's CLI defaults to --device cuda; on a machine without one, say so and
            # run where psr can.
            logging.getLogger(__name__).warning("no CUDA device: psr model runs on the CPU")
            device = "cpu"
        self.model = load(
            pretrained or DEFAULT_MODEL,
            policy=policy,
            residency=float(residency),
            lam=None if lam is None else float(lam),
            n=None if n is None else int(n),
            dtype=dtype,
            device=device,
            progress=False,
        )
        if self.model.tokenizer is None:
            raise ValueError(f"{pretrained}: lm_eval needs a tokenizer in the checkpoint")
        self.tok = self.model.tokenizer
        limit = getattr(self.model.config, "max_position_embeddings", 2048)
        self.max_length = int(max_length or limit)
        self.eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _score(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        ids = (ctx + cont)[-self.max_length :]
        plen = max(1, len(ids) - len(cont))
        logits = self.model.decode_logits(torch.tensor([ids]), plen)[0, plen - 1 : -1].float()
        target = torch.tensor(ids[plen:], device=logits.device)
        logp = torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
        return float(logp.sum()), bool((logits.argmax(-1) == target).all())

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="psr loglikelihood"):
            context, continuation = req.args
            ctx = self._encode(context) or [self.eos]
            out.append(self._score(ctx, self._encode(continuation)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="psr rolling"):
            ids = self._encode(req.args[0])
            total, step = 0.0, self.max_length - 1
            for i in range(0, len(ids), step):  # windows: eos or previous token as prompt
                prev = [self.eos] if i == 0 else ids[i - 1 : i]
                total += self._score(prev, ids[i : i + step])[0]
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="psr generate"):
            context, kw = req.args
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ctx = (self._encode(context) or [self.eos])[-(self.max_length - 1) :]
            budget = min(int(kw.get("max_gen_toks", 64)), self.max_length - len(ctx))
            ids = self.model.generate(ctx, budget, eos_token_id=self.tok.eos_token_id)
            text = self.tok.decode(ids[0, len(ctx) :].tolist(), skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def main(argv: list[str] | None = None) -> int:
    """lm_eval's CLI with the psr model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
