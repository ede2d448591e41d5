"""The psr command line's errors, argument checks, help text and wiring.

Most cases fail while the line is parsed or in the checks that run before a model
loads; `psr.models.load` and the evaluation runs are replaced by stubs that fail the
test if they are reached.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

from psr.cli import build_parser, main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("cli_err") / "olmoe")
    write_tokenizer(path)
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if anything loads a model or starts an evaluation run."""
    import psr.eval.microbench
    import psr.eval.runs
    import psr.models

    def boom(*args, **kwargs):
        raise AssertionError("reached a model load or a run; the arguments should have failed")

    monkeypatch.setattr(psr.models, "load", boom)
    for name in ("demo", "evaluate", "sweep"):
        monkeypatch.setattr(psr.eval.runs, name, boom)
    monkeypatch.setattr(psr.eval.microbench, "run_copy_overlap", boom)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status (0 when main returns), stdout, stderr."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    assert err.startswith("psr: error: "), err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------ bad arguments: status 2

G = ["generate", "--prompt", "a"]
BAD_ARGUMENTS = [
    (["eval", "--prompts", "0"], "--prompts"),
    (["eval", "--prompts", "two"], "--prompts"),
    (["eval", "--windows", "-3"], "--windows"),
    (["eval", "--cloze", "-1"], "--cloze"),
    (["eval", "--gen-tokens", "0"], "--gen-tokens"),
    (["eval", "--residency", "0.5,abc"], "--residency"),
    (["eval", "--residency", "0.5,,0.25"], "--residency"),
    (["eval", "--residency", "0"], "--residency"),
    (["eval", "--residency", "1.5"], "--residency"),
    (["eval", "--policies", "psr:lam=x"], "--policies"),
    (["eval", "--policies", "bogus"], "--policies"),
    (["eval", "--policies", "exact:lam=0.3"], "--policies"),
    (["eval", "--policies", ";"], "--policies"),
    (["bench", "copy", "--repeats", "0"], "--repeats"),
    (["bench", "copy", "--experts", "0"], "--experts"),
    (["bench", "copy", "--slots", "-1"], "--slots"),
    (["bench", "copy", "--slots", "9", "--experts", "8"], "--slots"),
    (["bench", "copy", "--shape", "3x0x4"], "--shape"),
    (["bench", "copy", "--shape", "3xbig"], "--shape"),
    (["bench", "copy", "--backend", "tpu"], "--backend"),
    (["bench", "sweep", "--lams", "0.1,-1"], "--lams"),
    (["bench", "sweep", "--lams", "0.1,nan"], "--lams"),
    (["bench", "sweep", "--ns", "1,x"], "--ns"),
    (["bench", "sweep", "--tolerance", "inf"], "--tolerance"),
    (["bench", "sweep", "--windows", "0"], "--windows"),
    ([*G, "--max-new-tokens", "-1"], "--max-new-tokens"),
    ([*G, "--max-new-tokens", "1.5"], "--max-new-tokens"),
    ([*G, "--residency", "0"], "--residency"),
    ([*G, "--residency", "nan"], "--residency"),
    ([*G, "--slots", "0"], "--slots"),
    ([*G, "--lam", "-0.1"], "--lam"),
    ([*G, "--lam", "inf"], "--lam"),
    ([*G, "--n", "-1"], "--n"),
    ([*G, "--temperature", "0"], "--temperature"),
    ([*G, "--top-p", "0"], "--top-p"),
    ([*G, "--top-p", "1.1"], "--top-p"),
    ([*G, "--top-k", "-1"], "--top-k"),
    ([*G, "--top-k", "2.5"], "--top-k"),
    ([*G, "--seed", "x"], "--seed"),
    ([*G, "--device", "tpu"], "--device"),
    ([*G, "--dtype", "int8"], "--dtype"),
    ([*G, "--policy", "fastest"], "--policy"),
    ([*G, "--compute", "gpu"], "--compute"),
    ([*G, "--policy", "exact", "--lam", "0.3"], "--policy"),
    ([*G, "--policy", "cache-prior", "--n", "2"], "--policy"),
    (["generate", "--prompt-ids", "1,a"], "--prompt-ids"),
    (["generate", "--prompt-ids", "1,-2"], "--prompt-ids"),
    (["generate", "--prompt-ids", ","], "--prompt-ids"),
    (["generate", "--prompt", ""], "--prompt"),
    (["generate"], "--prompt"),
    (["generate", "--prompt", "a", "--prompt-ids", "1"], "--prompt"),
    ([*G, "--no-such-option"], "--no-such-option"),
    ([], "COMMAND"),
    (["bench"], "BENCH"),
]


@pytest.mark.parametrize(
    "argv,option", BAD_ARGUMENTS, ids=[" ".join(a) or "<none>" for a, _ in BAD_ARGUMENTS]
)
def test_a_bad_argument_is_one_line_naming_the_option(argv, option, capsys, no_load) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert option in one_line_error(err)


def test_parsed_values_have_their_types() -> None:
    p = build_parser()
    a = p.parse_args(
        ["eval", "--residency", "0.5, 0.25", "--policies", "psr:lam=0.3,n=2", "--cloze", "0"]
    )
    assert a.residency == [0.5, 0.25] and a.cloze == 0
    assert [x.describe() for x in a.policies] == ["exact", "psr(lam=0.3, n=2)"]
    from psr.eval.defaults import SWEEP_LAMS, SWEEP_NS

    a = p.parse_args(["bench", "sweep"])  # string defaults are parsed too
    assert a.residency == [0.5, 0.25] and a.lams == list(SWEEP_LAMS)
    assert a.ns == list(SWEEP_NS)
    a = p.parse_args(["tune"])
    assert a.residency == [0.5, 0.375, 0.25] and a.budget == 0.01 and a.profile == "rtx4090"
    a = p.parse_args(["bench", "copy", "--shape", "2x4"])
    assert a.shape == (2, 4)
    a = p.parse_args(
        ["generate", "--prompt-ids", "1, 2 3", "--dtype", "bf16", "--device", "cuda:1"]
    )
    assert a.prompt_ids == [1, 2, 3] and a.dtype == "bfloat16" and a.device == "cuda:1"
    assert a.top_k == 0 and a.max_new_tokens == 32


# ------------------------------------------------------------------ runtime errors: status 1


def test_model_path_that_is_a_file(tmp_path, capsys, no_load) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    code, _, err = run(["generate", "--model", str(f), "--prompt", "a"], capsys)
    assert code == 1
    assert "--model" in one_line_error(err) and "not a folder" in err


@pytest.mark.parametrize(
    "config,expect",
    [
        (None, "no config.json"),
        ("{broken", "corrupt config.json"),
        ('{"model_type": "bert"}', "bert"),
    ],
)
def test_bad_checkpoint_folder(tmp_path, capsys, no_load, config, expect) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    code, _, err = run(["generate", "--model", str(d), "--prompt-ids", "1"], capsys)
    assert code == 1
    assert "--model" in one_line_error(err) and expect in err


def test_missing_model_folder(tmp_path, capsys, no_load) -> None:
    code, _, err = run(["generate", "--model", str(tmp_path / "nope"), "--prompt", "a"], capsys)
    assert code == 1 and "no such folder" in one_line_error(err)


def test_prompt_text_needs_a_tokenizer_and_ids_the_vocabulary(tmp_path, capsys, no_load) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "olmoe", "vocab_size": 64}')
    code, _, err = run(["generate", "--model", str(d), "--prompt", "a"], capsys)
    assert code == 1 and "--prompt-ids" in one_line_error(err) and "tokenizer" in err
    code, _, err = run(["generate", "--model", str(d), "--prompt-ids", "1,64"], capsys)
    assert code == 1 and "--prompt-ids" in one_line_error(err) and "64" in err


def test_debug_flag_and_env_show_the_traceback(tmp_path, capsys, monkeypatch, no_load) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{broken")
    argv = ["generate", "--model", str(d), "--prompt-ids", "1"]
    for env, extra in (("1", []), ("", ["--debug"])):
        monkeypatch.setenv("PSR_DEBUG", env)
        code, _, err = run([*extra, *argv], capsys)
        assert code == 1
        assert "Traceback (most recent call last)" in err and "CheckpointError" in err
        assert err.splitlines()[-1].startswith("psr: error: --model: corrupt config.json")
    monkeypatch.delenv("PSR_DEBUG")
    code, _, err = run(argv, capsys)
    assert code == 1 and one_line_error(err)


def test_store_errors_and_interrupts(monkeypatch, capsys) -> None:
    import psr.store

    def store_error():
        raise psr.StoreError("the store is closed")

    monkeypatch.setattr(psr.store, "backend_info", store_error)
    code, _, err = run(["info"], capsys)
    assert code == 1 and one_line_error(err) == "psr: error: the store is closed\n"

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(psr.store, "backend_info", interrupt)
    code, _, err = run(["info"], capsys)
    assert code == 130 and err == "psr: interrupted\n"


def test_a_closed_pipe_exits_quietly(monkeypatch, capsys) -> None:
    import psr.store

    def closed():
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(psr.store, "backend_info", closed)
    code, _, err = run(["info"], capsys)
    assert code == 1 and err == ""


def test_other_exceptions_keep_their_traceback(monkeypatch) -> None:
    """A bug (not a bad value, file or store) is not reduced to one line."""
    import psr.store

    def bug():
        raise KeyError("internal")

    monkeypatch.setattr(psr.store, "backend_info", bug)
    with pytest.raises(KeyError):
        main(["info"])


# ------------------------------------------------------------------ outputs, checked up front


def test_json_under_a_file_fails_before_loading(ckpt, tmp_path, capsys, no_load) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for target in (blocker / "out.json", blocker / "sub" / "out.json"):
        code, _, err = run(
            ["generate", "--model", str(ckpt), "--prompt", "a", "--json", str(target)], capsys
        )
        assert code == 1
        assert "--json" in one_line_error(err) and "not a folder" in err
    code, _, err = run(
        ["generate", "--model", str(ckpt), "--prompt", "a", "--json", str(tmp_path)], capsys
    )
    assert code == 1 and "is a folder" in one_line_error(err)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anywhere")
def test_json_in_a_read_only_folder_fails_before_loading(ckpt, tmp_path, capsys, no_load) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        for target in (ro / "out.json", ro / "sub" / "out.json"):
            code, _, err = run(
                ["generate", "--model", str(ckpt), "--prompt", "a", "--json", str(target)], capsys
            )
            assert code == 1 and "--json" in one_line_error(err)
    finally:
        ro.chmod(0o700)


def test_a_folder_that_refuses_files_fails_before_loading(
    ckpt, tmp_path, capsys, monkeypatch, no_load
) -> None:
    """What a read-only folder does for a user who is not root (the probe's failure)."""
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    target = tmp_path / "out.json"
    code, _, err = run(
        ["generate", "--model", str(ckpt), "--prompt", "a", "--json", str(target)], capsys
    )
    assert code == 1
    assert one_line_error(err) == (
        f"psr: error: --json {target}: cannot write to {tmp_path}: Permission denied\n"
    )
    assert not target.exists()


@pytest.mark.parametrize(
    "argv,option",
    [
        (["demo"], "--out"),
        (["eval"], "--out"),
        (["bench", "sweep"], "--out"),
        (["bench", "copy", "--shape", "4"], "--json"),
    ],
)
def test_unwritable_outputs_fail_before_running(argv, option, tmp_path, capsys, no_load) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run([*argv, option, str(blocker / "x")], capsys)
    assert code == 1 and option in one_line_error(err)
    if option == "--out":  # an existing file is no output folder either
        code, _, err = run([*argv, option, str(blocker)], capsys)
        assert code == 1 and "not a folder" in one_line_error(err)


def test_eval_model_needs_heldout_text(ckpt, tmp_path, capsys, no_load) -> None:
    code, _, err = run(["eval", "--model", str(ckpt), "--out", str(tmp_path / "o")], capsys)
    assert code == 1 and "heldout.txt" in one_line_error(err)


# ------------------------------------------------------------------ wiring


def test_eval_and_sweep_get_parsed_values(tmp_path, capsys, monkeypatch) -> None:
    import psr.eval.runs

    seen = {}
    monkeypatch.setattr(psr.eval.runs, "evaluate", lambda *a, **kw: seen.update(eval=(a, kw)))
    monkeypatch.setattr(psr.eval.runs, "sweep", lambda *a, **kw: seen.update(sweep=(a, kw)))
    out = tmp_path / "new" / "eval"
    argv = ["eval", "--policies", "psr:lam=0.3,n=1", "--residency", "0.25", "--out", str(out)]
    assert main(argv) == 0
    (path, configs, out_arg), kw = seen["eval"]
    assert path == psr.DEFAULT_MODEL and out.is_dir() and out_arg == str(out)
    assert [(c.policy.describe(), c.residency) for c in configs] == [
        ("exact", 0.25),
        ("psr(lam=0.3, n=1)", 0.25),
    ]
    assert kw["progress"] is False  # stderr is not a terminal here
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--lams", "0.1", "--ns", "0,2", "--out", str(out)]) == 0
    (path, out_arg, rho, lams, ns), kw = seen["sweep"]
    assert (rho, lams, ns) == ([0.5, 0.25], [0.1], [0, 2]) and kw["progress"] is False


def test_bench_copy_writes_json(tmp_path, capsys, monkeypatch) -> None:
    import psr.eval.microbench as mb

    class Result:
        def table(self) -> str:
            return "copy table"

        def as_dict(self) -> dict:
            return {"ok": 1}

    seen = {}
    monkeypatch.setattr(
        mb, "run_copy_overlap", lambda *a, **kw: seen.update(args=(a, kw)) or Result()
    )
    target = tmp_path / "a" / "b" / "copy.json"
    argv = ["bench", "copy", "--shape", "2x3", "--experts", "4", "--slots", "2"]
    assert main([*argv, "--repeats", "1", "--json", str(target)]) == 0
    assert seen["args"] == (((2, 3), 4, 2, 1), {"backend": None})
    assert json.loads(target.read_text()) == {"ok": 1}
    assert capsys.readouterr().out.strip() == "copy table"


def test_top_k_and_sampling_reach_model_generate(ckpt, tmp_path, capsys, monkeypatch) -> None:
    import psr.models

    real_load = psr.models.load
    seen: dict = {}

    def spy_load(*args, **kwargs):
        seen["load"] = kwargs
        model = real_load(*args, **kwargs)
        generate = model.generate

        def spy_generate(*a, **kw):
            seen["generate"] = kw
            return generate(*a, **kw)

        model.generate = spy_generate
        return model

    monkeypatch.setattr(psr.models, "load", spy_load)
    out = tmp_path / "deep" / "g.json"
    argv = ["generate", "--model", str(ckpt), "--prompt", "To be", "--sample", "--top-k", "3"]
    argv += ["--top-p", "0.9", "--temperature", "0.7", "--seed", "5", "--max-new-tokens", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    kw = seen["generate"]
    assert kw["top_k"] == 3 and kw["do_sample"] is True and kw["top_p"] == 0.9
    assert kw["temperature"] == 0.7 and kw["seed"] == 5 and kw["max_new_tokens"] == 3
    assert kw["progress"] is False and seen["load"]["progress"] is False
    assert len(json.loads(out.read_text())["tokens"]) == len("To be") + 3
    assert capsys.readouterr().err == ""  # no progress bars off a terminal


def test_lm_eval_after_debug_still_goes_to_lm_eval(monkeypatch) -> None:
    pytest.importorskip("lm_eval")
    import psr.eval.lm_eval_adapter as adapter

    seen = {}
    monkeypatch.setattr(adapter, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    main(["--debug", "lm-eval", "--tasks", "x"])
    assert seen["argv"] == ["--tasks", "x"]


# ------------------------------------------------------------------ help


def _parsers(p: argparse.ArgumentParser, name: str = "psr"):
    yield name, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, sp in a.choices.items():
                yield from _parsers(sp, f"{name} {sub}")


def test_help_has_help_and_a_default_for_every_option() -> None:
    parsers = dict(_parsers(build_parser()))
    assert {"psr generate", "psr eval", "psr bench copy", "psr bench sweep"} <= set(parsers)
    checked = 0
    for name, p in parsers.items():
        text = p.format_help()
        fmt = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"{name} {a.option_strings[0]} has no help"
            assert a.option_strings[0] in text
            if a.default is not argparse.SUPPRESS:
                assert "default" in fmt._expand_help(a), f"{name} {a.option_strings[0]}"
                checked += 1
    assert checked > 40


@pytest.mark.parametrize("argv", [["--help"], ["generate", "-h"], ["bench", "sweep", "--help"]])
def test_help_exits_zero(argv, capsys) -> None:
    code, out, _ = run(argv, capsys)
    assert code == 0 and "default" in out
