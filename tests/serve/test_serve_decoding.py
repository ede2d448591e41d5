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
