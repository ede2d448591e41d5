"""The psr command line on a checkpoint the test creates."""

from __future__ import annotations

import json

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

from psr.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("cli") / "olmoe")
    write_tokenizer(path)
    return path


def test_generate_prints_text_then_stats(ckpt, capsys, tmp_path) -> None:
    out_json = tmp_path / "g.json"
    rc = main(
        [
            "generate",
            "--model",
            str(ckpt),
            "--prompt",
            "To be, or not",
            "--policy",
            "psr",
            "--residency",
            "0.5",
            "--lam",
            "0.3",
            "--n",
            "1",
            "--max-new-tokens",
            "6",
            "--quiet",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    text, out = capsys.readouterr()  # the text alone on stdout, what the run did on stderr
    assert text.startswith("To be, or not") and text.count("\n") == 1
    assert "policy psr(lam=0.3, n=1) (given), 4 of 8 experts resident per layer" in out
    assert "hit rate" in out and "prefetch copies" in out and "CPU threads  " in out
    data = json.loads(out_json.read_text())
    s = data["stats"]
    assert f"{s['substituted']:.0f} ({s['substitution_rate']:.3f} of routed)" in out
    assert len(data["tokens"]) == len("To be, or not") + 6
    assert (data["policy"], data["policy_source"]) == ("psr(lam=0.3, n=1)", "given")
    assert data["stats"]["tokens"] == 5


def test_generate_with_a_quant_cache(ckpt, capsys, tmp_path, monkeypatch) -> None:
    args = ["generate", "--model", str(ckpt), "--prompt-ids", "5,17,33", "--quiet"]
    args += ["--max-new-tokens", "4", "--expert-format", "int8"]
    assert main([*args, "--quant-cache", str(tmp_path / "c")]) == 0
    assert len(list((tmp_path / "c").iterdir())) == 1
    monkeypatch.setenv("PSR_CACHE", str(tmp_path / "home"))
    assert main([*args, "--quant-cache"]) == 0  # no folder: $PSR_CACHE/quantized
    assert len(list((tmp_path / "home" / "quantized").iterdir())) == 1
    import psr_kernels

    calls = []
    real = psr_kernels.quantize_expert

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(psr_kernels, "quantize_expert", counted)
    assert main([*args, "--quant-cache"]) == 0
    assert len(calls) == 3  # read back: one spot-checked expert per MoE layer, not 3 x 8
    capsys.readouterr()


def test_generate_with_ids_and_bad_args(ckpt, capsys) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                str(ckpt),
                "--prompt-ids",
                "1,2,3",
                "--policy",
                "exact",
                "--max-new-tokens",
                "2",
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ckpt), "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "psr: error: one of the arguments --prompt --prompt-ids is required\n"
    with pytest.raises(SystemExit) as e:  # a runtime error: one line, status 1
        main(["generate", "--model", str(ckpt), "--prompt", "a", "--residency", "0.1", "--quiet"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("psr: error:") and "fewer than top_k" in err
    assert err.count("\n") == 1


def test_speculative_figures_are_in_the_json(capsys, tmp_path) -> None:
    """The embedded model's block heads: the JSON carries what the text line prints."""
    out_json = tmp_path / "spec.json"
    argv = [
        "generate",
        "--prompt-ids",
        "1870,620,52,14,2009,305",
        "--max-new-tokens",
        "6",
        "--quiet",
    ]
    assert main([*argv, "--speculative", "block", "--block", "3", "--json", str(out_json)]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("speculative"))
    data = json.loads(out_json.read_text())
    spec = data["speculative"]
    assert (spec["drafter"], spec["block"], spec["verify"]) == ("block", 3, "budget")
    assert spec["block_k"] >= 1
    assert line == (
        f"speculative (block, B=3, budget(K_b={spec['block_k']})): {spec['blocks']} verify "
        "blocks, "
        f"{spec['accepted_per_block']:.2f} drafts accepted and "
        f"{spec['tokens_per_block']:.2f} tokens per block"
    )
    # The counts behind the averages, and the decode steps the stats count: one per block.
    assert spec["blocks"] == len(spec["per_block"]) == data["stats"]["tokens"] >= 1
    assert spec["accepted_per_block"] == spec["accepted"] / spec["blocks"]
    assert spec["tokens_per_block"] == sum(spec["per_block"]) / spec["blocks"]
    assert all(1 <= n <= 3 + 1 for n in spec["per_block"])
    assert len(data["tokens"]) == 6 + 6
    # Exact verify with CPU experts: the rule in the line and the JSON.
    argv_cpu = [*argv, "--speculative", "ar", "--verify", "cpu:1", "--json", str(out_json)]
    assert main(argv_cpu) == 0
    err = capsys.readouterr().err
    assert "speculative (ar, B=4, cpu(M=1)): " in err
    assert json.loads(out_json.read_text())["speculative"]["verify"] == "cpu:1"
    # Without --speculative the JSON has no such entry.
    assert main([*argv, "--json", str(out_json)]) == 0
    assert "speculative" not in json.loads(out_json.read_text())
    capsys.readouterr()


def test_lm_eval_subcommand_hands_its_arguments_to_lm_eval(monkeypatch) -> None:
    pytest.importorskip("lm_eval")
    import psr.eval.lm_eval_adapter as adapter

    seen = {}
    monkeypatch.setattr(adapter, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    main(["lm-eval", "--model", "psr", "--model_args", "residency=0.5", "--tasks", "x"])
    assert seen["argv"] == ["--model", "psr", "--model_args", "residency=0.5", "--tasks", "x"]


def test_info(capsys) -> None:
    assert main(["info"]) == 0
    assert '"cuda_compiled"' in capsys.readouterr().out


def test_generate_and_inspect_take_a_gguf_file(capsys, tmp_path) -> None:
    """A .gguf path works like a checkpoint folder: its metadata's tokenizer encodes the
    prompt, the printed text and tokens are transformers' on the twin, and the stats line
    names the file's expert types."""
    import torch
    from gguf_files import gguf_tiny_model, hf_tokenizer, twin_model, write_gguf

    model = gguf_tiny_model("qwen3_moe", head_dim=32)
    tok = hf_tokenizer()
    path = tmp_path / "m.gguf"
    twin = twin_model(model, write_gguf(model, path, {"experts": "Q4_K"}, tokenizer=tok))
    out_json = tmp_path / "g.json"
    argv = ["generate", "--model", str(path), "--prompt", "To be, or not", "--policy", "exact"]
    argv += ["--cpu-dot", "f32"]  # the twin's fp32 activations (q8 rounds them to 8 bits)
    assert main([*argv, "--max-new-tokens", "4", "--json", str(out_json)]) == 0
    out = capsys.readouterr().err
    assert "experts Q4_K,Q4_K,Q4_K (the file's blocks)" in out
    ids = tok("To be, or not", return_tensors="pt").input_ids
    with torch.no_grad():
        want = twin.generate(ids, max_new_tokens=4, do_sample=False)[0].tolist()
    assert json.loads(out_json.read_text())["tokens"] == want
    assert main(["inspect", "--model", str(path)]) == 0
    assert "Q4_K,Q4_K,Q4_K (gate, up, down) in 2 layers" in capsys.readouterr().out
