"""`--prefill-chunk` on `psr generate` / `psr serve` (issue 36): it reaches the model, and
bad values are one-line errors naming the option or the context."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint

from psr.cli import build_parser, main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("cli_pf") / "m")


def test_the_chunk_reaches_the_model(ckpt, capsys, monkeypatch) -> None:
    import psr.models

    real_load, seen = psr.models.load, {}

    def spy_load(*args, **kwargs):
        seen["model"] = real_load(*args, **kwargs)
        return seen["model"]

    monkeypatch.setattr(psr.models, "load", spy_load)
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "1,2,3,4,5", "--prefill-chunk", "2"]
    assert main([*argv, "--max-new-tokens", "2", "--quiet"]) == 0
    assert seen["model"].prefill_chunk == 2
    serve = build_parser().parse_args(["serve", "--prefill-chunk", "64", "--prompt-cache", "0"])
    assert serve.prefill_chunk == 64 and serve.prompt_cache == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "argument --prefill-chunk"), ("100000", "exceeds the model's context")],
)
def test_bad_chunks_are_one_line_errors(ckpt, capsys, value, message) -> None:
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--prefill-chunk", value]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--quiet"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code != 0
    assert err.startswith("psr: error:") and message in err and len(err.splitlines()) == 1, err


def test_bench_ttft_prints_the_modeled_table(capsys) -> None:
    assert main(["bench", "ttft", "--profiles", "rtx4090", "--chunk", "256"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("modeled time to first token (s; chunk 256")
    assert "| rtx4090 | Qwen3-30B-A3B (Q8_0) | 4096 |" in out and "| h200 |" not in out
    with pytest.raises(SystemExit):
        main(["bench", "ttft", "--profiles", "a100"])
    err = capsys.readouterr().err.strip()
    assert "no GPU FLOP/s for a100" in err and len(err.splitlines()) == 1
