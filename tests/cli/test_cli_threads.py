"""--threads and --ctx-size on the command line, and `psr info`'s thread figures (issue 42)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

from psr.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("thr_cli") / "olmoe")


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def test_threads_and_ctx_size(ckpt, capsys, tmp_path, monkeypatch) -> None:
    before = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    base = ["generate", "--model", str(ckpt), "--prompt-ids", "5,17,33,2,9,41,12,60", "--quiet"]
    base += ["--policy", "exact", "--residency", "0.5", "--json", str(tmp_path / "g.json")]
    try:
        rc, _, err = _run([*base, "--threads", str(cpus), "--max-new-tokens", "2"], capsys)
        assert rc == 0 and torch.get_num_threads() == cpus
        assert json.loads((tmp_path / "g.json").read_text())["stats"]["threads"] == cpus
        assert f"CPU threads                             {cpus}" in err
        rc, _, err = _run([*base, "--threads", str(cpus + 1)], capsys)
        assert rc == 2 and err == (
            f"psr: error: --threads {cpus + 1}: only {cpus} CPUs are available to this "
            f"process (its affinity mask; the default is its "
            f"{err.split('is its ')[1].split()[0]} physical cores)\n"
        )
        monkeypatch.setenv("PSR_THREADS", "0")
        rc, _, err = _run(base, capsys)
        assert rc == 2 and err == "psr: error: $PSR_THREADS=0: expected an integer >= 1\n"
        monkeypatch.delenv("PSR_THREADS")
        ctx = [*base, "--ctx-size", "10", "--max-new-tokens"]
        assert _run([*ctx, "2"], capsys)[0] == 0
        rc, _, err = _run([*ctx, "3"], capsys)
        assert rc == 1 and err == (
            "psr: error: prompt of 8 tokens + 3 new exceeds the model's context of 10 tokens\n"
        )
        rc, _, err = _run([*base, "--ctx-size", "129"], capsys)
        assert rc == 1 and "context=129 exceeds the model's context of 128 tokens" in err
    finally:
        torch.set_num_threads(before)
    assert "PSR_THREADS" not in os.environ  # main() leaves the environment as it found it


def test_info_shows_cpus_cores_and_threads(capsys, monkeypatch) -> None:
    monkeypatch.setenv("PSR_THREADS", "1")
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["threads"] == 1 and info["cpus_available"] == len(os.sched_getaffinity(0))
    assert 1 <= info["physical_cores"] <= info["cpus_available"]
