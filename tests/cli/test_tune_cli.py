"""`psr tune --text` and the untuned default on the command line, on tiny checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from tiny_models import tiny_config, write_checkpoint, write_tokenizer

from psr.cli import main

LINE = "Now is the winter of our discontent made glorious summer by this sun of York.\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random OLMoE whose context holds `psr tune`'s 160-token windows."""
    import transformers

    cfg = tiny_config("olmoe")
    cfg.max_position_embeddings = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = write_checkpoint(model, tmp_path_factory.mktemp("tune_cli") / "olmoe")
    write_tokenizer(path)
    return path


def fails(argv: list[str], capsys) -> str:
    """`psr ARGV` exits with status 1 and one line on stderr; that line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("psr: error: ")
    return err


def test_bad_text_is_one_line_with_the_token_counts(ckpt, tmp_path, capsys) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "short.txt").write_text(LINE * 4)  # 312 characters: 312 tokens here
    base = ["tune", "--model", str(ckpt), "--residency", "0.5", "--quiet"]
    base += ["--out", str(tmp_path / "o"), "--text"]
    err = fails([*base, str(tmp_path / "empty.txt")], capsys)
    assert err.endswith(
        "empty.txt: no text (empty), 0 tokens; the 0.01 nats/token budget needs 47 windows of "
        "160 tokens in each set (7,520 per set, 15,040 in all) for a 95% interval narrower "
        "than the budget"
    )
    err = fails([*base, str(tmp_path / "latin1.txt")], capsys)
    assert "latin1.txt: not UTF-8 (byte 3: b'\\xe9')" in err
    err = fails([*base, str(tmp_path / "short.txt"), "--windows", "47"], capsys)
    assert "short.txt: 312 tokens (set A 156, set B 156); the 0.01 nats/token budget " in err
    assert "needs 47 windows of 160 tokens in each set (7,520 per set, 15,040 in all)" in err
    assert "about 14,728 more tokens" in err
    assert "missing: no such file or folder" in fails([*base, str(tmp_path / "missing")], capsys)
    bare = tmp_path / "bare"  # the checkpoint without its tokenizer
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(ckpt / f, bare / f)
    argv = [*base[:2], str(bare), *base[3:], str(tmp_path / "short.txt")]
    assert fails(argv, capsys).endswith(f"--text: {bare} has no tokenizer to read the text with")


def test_tune_on_text_then_generate_uses_the_point(ckpt, tmp_path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text(LINE * 20)  # 1,560 tokens: two windows of 160 per set at budget 10
    argv = ["tune", "--model", str(ckpt), "--text", str(text), "--budget", "10"]
    argv += ["--windows", "2", "--residency", "0.5", "--lams", "0.5", "--ns", "0,1"]
    argv += ["--out", str(tmp_path / "o"), "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "selected on A, replicated on B, budget 10.0" in out and "kept" in out
    gen = ["generate", "--model", str(ckpt), "--prompt-ids", "5,17,33", "--quiet"]
    gen += ["--max-new-tokens", "2", "--json", str(tmp_path / "g.json")]
    assert main(gen) == 0
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["policy_source"].startswith("tuned (") and data["policy_source"].endswith(".json)")
    assert f"({data['policy_source']})" in capsys.readouterr().err


def test_the_untuned_default_warns_in_one_line_once_per_load(ckpt, tmp_path) -> None:
    cmd = [sys.executable, "-m", "psr.cli", "generate", "--model", str(ckpt)]
    cmd += ["--prompt-ids", "5,17,33", "--max-new-tokens", "2", "--residency", "1", "--quiet"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("psr: psr(lam=")]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("psr: psr(lam=0.03, n=1) is the untuned default")
    assert lines[0].endswith(f"psr tune --model {ckpt} --text YOUR_TEXT --residency 1")
    assert "policy psr(lam=0.03, n=1) (untuned default)" in run.stderr
