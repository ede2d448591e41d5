"""`--experts-on` / `--hybrid-m` (psr generate, serve) and `psr bench machine`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint

import psr.machine as mc
from psr.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("cli_eo") / "olmoe")


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def test_generate_on_the_cpu_counts_cpu_experts(ckpt, capsys, tmp_path) -> None:
    out_json = tmp_path / "g.json"
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "5,17,33,2", "--residency", "0.25"]
    argv += ["--policy", "exact", "--max-new-tokens", "4", "--quiet", "--json", str(out_json)]
    rc, _, out = _run([*argv, "--experts-on", "hybrid", "--hybrid-m", "0,1,0"], capsys)
    assert rc == 0 and "routed experts on the CPU" in out
    assert ", experts on hybrid:0,1,0, graphs " in out
    s = json.loads(out_json.read_text())["stats"]
    assert s["cpu_experts"] > 0 and s["copies"] == s["misses"] - s["cpu_experts"]


def test_generate_with_no_slab(ckpt, capsys, tmp_path) -> None:
    """--slots 0 --experts-on cpu: every routed expert on the CPU, no copy; with the default
    --experts-on gpu the same flags are a one-line usage error naming the fix."""
    out_json = tmp_path / "g.json"
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "5,17,33,2", "--slots", "0"]
    argv += ["--policy", "exact", "--max-new-tokens", "4", "--quiet", "--json", str(out_json)]
    rc, _, _ = _run([*argv, "--experts-on", "cpu"], capsys)
    s = json.loads(out_json.read_text())["stats"]
    assert rc == 0 and s["cpu_experts"] == s["routed"] > 0 and s["copies"] == s["hits"] == 0
    rc, _, err = _run(argv, capsys)  # refused before anything loads
    assert rc == 2 and "--slots 0 needs --experts-on cpu or hybrid" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--experts-on", "tpu"], "invalid choice"),
        (["--experts-on", "cpu", "--hybrid-m", "1"], "--hybrid-m is for --experts-on hybrid"),
        (["--experts-on", "hybrid", "--hybrid-m", "1,x"], "expected an integer"),
    ],
)
def test_bad_experts_on_arguments_are_one_line_errors(ckpt, capsys, extra, match) -> None:
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", "5,17", "--quiet", *extra]
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and match in err and err.count("\n") == 1


def test_bench_machine_writes_a_profile_hybrid_reads(ckpt, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PSR_HOME", str(tmp_path))
    argv = ["bench", "machine", "--hidden", "32", "--ffn", "16", "--format", "float32"]
    rc, out, _ = _run([*argv, "--top-k", "2", "--repeats", "2", "--threads", "1"], capsys)
    assert rc == 0 and "CPU call fixed cost" in out
    p = mc.read_profile()
    assert p is not None and p.fingerprint["threads"] == 1 and p.cpu_fixed_s > 0
    c = p.shapes[mc.shape_key(32, 16, "float32")]
    assert c.row_bytes == 3 * 32 * 16 * 4 and c.cpu_expert_s > 0 and c.copy_s is None
    rc, _, err = _run(["bench", "machine", "--threads", "100000"], capsys)
    assert rc == 2 and err.startswith("psr: error: --threads 100000: only ")
