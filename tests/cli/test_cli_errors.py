"""The psr command line's errors, argument checks, help text and wiring.

Most cases fail while the line is parsed or in the checks that run before a model
loads; `psr.models.load` and the evaluation runs are replaced by stubs that fail the
test if they are reached.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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

# Each case: the line, and what its one-line error must say. The messages name the option
# and the reason, so that a case cannot pass on argparse's "unrecognized arguments" alone
# (which names any option, removed ones too).
G = ["generate", "--prompt", "a"]
POLICY_NAMES = "exact, exact-prefetch, cache-prior, psr, cache-prior-async"
DTYPES = "float32, fp32, float, bfloat16, bf16, float16, fp16, half"
BAD_ARGUMENTS = [
    (["eval", "--prompts", "0"], "argument --prompts: expected an integer >= 1, got '0'"),
    (["eval", "--prompts", "two"], "argument --prompts: expected an integer, got 'two'"),
    (["eval", "--windows", "-3"], "argument --windows: expected an integer >= 1, got '-3'"),
    (["eval", "--cloze", "-1"], "argument --cloze: expected an integer >= 0, got '-1'"),
    (["eval", "--gen-tokens", "0"], "argument --gen-tokens: expected an integer >= 1, got '0'"),
    (
        ["eval", "--residency", "0.5,abc"],
        "argument --residency: entry 2 of '0.5,abc': expected a number, got 'abc'",
    ),
    (["eval", "--residency", "0.5,,0.25"], "argument --residency: entry 2 of '0.5,,0.25' is empty"),
    (
        ["eval", "--residency", "0"],
        "argument --residency: entry 1 of '0': expected a number in (0, 1], got '0'",
    ),
    (
        ["eval", "--residency", "1.5"],
        "argument --residency: entry 1 of '1.5': expected a number in (0, 1], got '1.5'",
    ),
    (
        ["eval", "--policies", "psr:lam=x"],
        "argument --policies: policy parameter lam='x': expected a number",
    ),
    (
        ["eval", "--policies", "bogus"],
        f"argument --policies: unknown policy 'bogus'; expected one of {POLICY_NAMES}",
    ),
    (
        ["eval", "--policies", "exact:lam=0.3"],
        "argument --policies: policy 'exact' has lam=0; got lam=0.3",
    ),
    (["eval", "--policies", ";"], "argument --policies: no policy in ';'"),
    (
        ["eval", "--expert-format", "native,int3"],
        "argument --expert-format: entry 2 of 'native,int3': expected one of native, bf16, "
        "int8, fp8, int4, got 'int3'",
    ),
    (["bench", "copy", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
    (["bench", "copy", "--experts", "0"], "argument --experts: expected an integer >= 1, got '0'"),
    (["bench", "copy", "--slots", "-1"], "argument --slots: expected an integer >= 1, got '-1'"),
    (["bench", "copy", "--slots", "9", "--experts", "8"], "--slots 9 exceeds --experts 8"),
    (
        ["bench", "copy", "--shape", "3x0x4"],
        "argument --shape: every dimension must be >= 1, got '3x0x4'",
    ),
    (
        ["bench", "copy", "--shape", "3xbig"],
        "argument --shape: expected integers joined by 'x' (e.g. 3x2048x1024), got '3xbig'",
    ),
    (["bench", "copy", "--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
    (
        ["bench", "sweep", "--lams", "0.1,-1"],
        "argument --lams: entry 2 of '0.1,-1': expected a finite number >= 0, got '-1'",
    ),
    (
        ["bench", "sweep", "--lams", "0.1,nan"],
        "argument --lams: entry 2 of '0.1,nan': expected a finite number, got 'nan'",
    ),
    (["bench", "sweep", "--ns", "1,x"], "argument --ns: entry 2 of '1,x': expected an integer"),
    # The quality budget (once --tolerance): a non-finite budget would accept every point.
    (["bench", "sweep", "--budget", "inf"], "argument --budget: expected a finite number"),
    (["tune", "--budget", "-0.01"], "argument --budget: expected a finite number >= 0"),
    (["bench", "sweep", "--windows", "0"], "argument --windows: expected an integer >= 1"),
    (
        ["bench", "speculative", "--drafters", "block,medusa"],
        "argument --drafters: entry 2 of 'block,medusa': unknown drafter 'medusa': block, ar, "
        "mtp, oracle",
    ),
    ([*G, "--max-new-tokens", "-1"], "argument --max-new-tokens: expected an integer >= 0"),
    ([*G, "--max-new-tokens", "1.5"], "argument --max-new-tokens: expected an integer, got '1.5'"),
    ([*G, "--residency", "0"], "argument --residency: expected a number in (0, 1], got '0'"),
    ([*G, "--residency", "nan"], "argument --residency: expected a finite number, got 'nan'"),
    ([*G, "--slots", "-1"], "argument --slots: expected an integer >= 0, got '-1'"),
    ([*G, "--slots", "0"], "--slots 0 needs --experts-on cpu or hybrid"),
    ([*G, "--lam", "-0.1"], "argument --lam: expected a finite number >= 0, got '-0.1'"),
    ([*G, "--lam", "inf"], "argument --lam: expected a finite number, got 'inf'"),
    ([*G, "--n", "-1"], "argument --n: expected an integer >= 0, got '-1'"),
    ([*G, "--quality-budget", "-1"], "argument --quality-budget: expected a finite number >= 0"),
    ([*G, "--temperature", "0"], "argument --temperature: expected a finite number > 0, got '0'"),
    ([*G, "--top-p", "0"], "argument --top-p: expected a number in (0, 1], got '0'"),
    ([*G, "--top-p", "1.1"], "argument --top-p: expected a number in (0, 1], got '1.1'"),
    ([*G, "--top-k", "-1"], "argument --top-k: expected an integer >= 0, got '-1'"),
    ([*G, "--top-k", "2.5"], "argument --top-k: expected an integer, got '2.5'"),
    ([*G, "--seed", "x"], "argument --seed: expected an integer, got 'x'"),
    ([*G, "--block", "0"], "argument --block: expected an integer >= 1, got '0'"),
    ([*G, "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    ([*G, "--dtype", "int8"], f"argument --dtype: expected one of {DTYPES}, got 'int8'"),
    ([*G, "--policy", "fastest"], "argument --policy: invalid choice: 'fastest'"),
    ([*G, "--compute", "gpu"], "argument --compute: invalid choice: 'gpu'"),
    ([*G, "--expert-format", "int3"], "argument --expert-format: invalid choice: 'int3'"),
    ([*G, "--speculative", "medusa"], "argument --speculative: invalid choice: 'medusa'"),
    (
        [*G, "--policy", "exact", "--lam", "0.3"],
        "--policy exact: policy 'exact' has lam=0; got lam=0.3",
    ),
    (
        [*G, "--policy", "cache-prior", "--n", "2"],
        "--policy cache-prior: policy 'cache-prior' has n=0; got n=2",
    ),
    (["generate", "--prompt-ids", "1,a"], "argument --prompt-ids: token id 'a' is not an integer"),
    (["generate", "--prompt-ids", "1,-2"], "argument --prompt-ids: token id '-2' is negative"),
    (
        ["generate", "--prompt-ids", ","],
        "argument --prompt-ids: expected token ids such as '1,2,3', got ','",
    ),
    (["generate", "--prompt", ""], "argument --prompt: expected a non-empty string"),
    (["generate"], "one of the arguments --prompt --prompt-ids is required"),
    ([*G, "--prompt-ids", "1"], "argument --prompt-ids: not allowed with argument --prompt"),
    ([*G, "--no-such-option"], "unrecognized arguments: --no-such-option"),
    ([], "the following arguments are required: COMMAND"),
    (["bench"], "the following arguments are required: BENCH"),
]


@pytest.mark.parametrize(
    "argv,message", BAD_ARGUMENTS, ids=[" ".join(a) or "<none>" for a, _ in BAD_ARGUMENTS]
)
def test_a_bad_argument_is_one_line_naming_the_option(argv, message, capsys, no_load) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    # A prefix: choice errors end in a list whose quoting changed in Python 3.12.
    assert one_line_error(err).startswith(f"psr: error: {message}"), err


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
    assert kw["record_modes"] is False
    assert main([*argv, "--record-modes"]) == 0
    assert seen["eval"][1]["record_modes"] is True
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--lams", "0.1", "--ns", "0,2", "--out", str(out)]) == 0
    (path, out_arg, rho, lams, ns), kw = seen["sweep"]
    assert (rho, lams, ns) == ([0.5, 0.25], [0.1], [0, 2]) and kw["progress"] is False


def test_demo_writes_under_psr_results_where_it_runs(tmp_path, monkeypatch, capsys) -> None:
    """Like `psr eval`: ./psr-results/demo, never bench/results/ of whatever folder."""
    import inspect

    import psr.eval.runs
    from psr.machine import physical_cores

    seen = {}
    monkeypatch.setattr(psr.eval.runs, "demo", lambda out, **kw: seen.update(out=out, kw=kw))
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--quick"]) == 0
    workers = seen["kw"].pop("workers")  # --workers' default: the physical cores
    assert seen["out"] == "psr-results/demo" and seen["kw"] == {"progress": False, "quick": True}
    assert workers.workers == physical_cores() and workers.threads >= 1
    assert (tmp_path / "psr-results" / "demo").is_dir() and not (tmp_path / "bench").exists()
    monkeypatch.undo()  # the library's own default is the same folder
    assert inspect.signature(psr.eval.runs.demo).parameters["out"].default == "psr-results/demo"


def test_python_m_psr_cli_parses_without_torch() -> None:
    """`python -m psr.cli` is `psr`, and building the help or parsing a line imports no torch
    (the handlers import what they run)."""
    code = (
        "import runpy, sys\n"
        "class Blocked:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton', 'transformers', 'numpy'):\n"
        "            raise ImportError(name + ' is blocked')\n"
        "sys.meta_path.insert(0, Blocked())\n"
        "from psr.cli import build_parser\n"
        "p = build_parser()\n"
        "p.parse_args(['generate', '--prompt', 'a', '--dtype', 'bf16', '--compute', 'torch'])\n"
        "p.parse_args(['eval', '--policies', 'psr:lam=0.3,n=2', '--expert-format', 'native,fp8'])\n"
        "sys.argv = ['psr', 'bench', 'sweep', '--help']\n"
        "runpy.run_module('psr.cli', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: psr bench sweep") and "--budget" in r.stdout


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
    err = capsys.readouterr().err
    assert "\r" not in err and "%|" not in err  # no progress bars off a terminal
    assert err.lstrip().startswith("policy ")  # what the run did: on stderr


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
