"""psr.serve.decoding without a server: the grammar mask against llguidance's own bitmask
read bit by bit, and a grammar that does not compile."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from psr.models import DEFAULT_MODEL
from psr.serve.decoding import GrammarError, Grammars
from psr.serve.protocol import Structured


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    return Grammars(tok, 2048, (tok.eos_token_id,))


def test_mask_allows_exactly_the_bitmask_tokens(grammars) -> None:
    mask = grammars.mask(grammars.grammar(Structured("regex", "[a-z ]{1,12}\\.")))
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        scores = torch.randn(1, 2048, generator=gen)
        out = mask(None, scores.clone())
        words = mask.bitmask[0].tolist()
        allowed = [j for j in range(2048) if (words[j // 32] >> (j % 32)) & 1]
        assert allowed and torch.isfinite(out[0]).nonzero().view(-1).tolist() == allowed
        assert torch.equal(out[0, allowed], scores[0, allowed])
        mask.consume(int(out.argmax()))
        if mask.done:
            break
    assert mask.masks >= 1 and mask.seconds > 0


def test_bad_grammars_name_the_problem(grammars) -> None:
    with pytest.raises(GrammarError, match="regex"):
        grammars.grammar(Structured("regex", "[a-"))
    with pytest.raises(GrammarError):
        grammars.grammar(Structured("lark", "start: missing_rule"))


def test_logprobs_and_penalties_keep_one_read_per_token(tmp_path) -> None:
    """psr.eval.host_probe's probe over a decode with logprobs and every penalty: the token
    loop still reads the device once per token (the token, its logprob and the top ones
    in one read) and the MoE path not at all."""
    from tiny_models import tiny_model, write_checkpoint

    import psr
    from psr.eval.host_probe import HostProbe
    from psr.serve.decoding import LogprobSink, Penalties, Processors
    from psr.serve.protocol import Sampling

    prompt = torch.tensor([[5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]])
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "m")
    model = psr.load(path, "psr", 0.5, lam=0.5, n=2, decode="device", progress=False)
    s = Sampling(None, 0, 1, 0, None, (), repetition_penalty=1.3, presence_penalty=0.5)
    sink = LogprobSink(3)
    with HostProbe(model) as probe:
        out = model.generate(
            prompt,
            max_new_tokens=6,
            logprobs=sink,
            logits_processor=Processors([Penalties(s, prompt.shape[1])]),
        )
    per = probe.per_token()
    assert per["token_reads"] == 1 and per["reads"] == 0 and per["h2d"] == 0
    assert [t for t, _, _ in sink.rows] == out[0, prompt.shape[1] :].tolist()
    assert all(len(top) == 3 and lp <= 0 for _, lp, top in sink.rows)
