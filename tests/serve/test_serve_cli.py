"""`psr serve` and `psr bench serve` on the command line: argument errors in one line
before anything loads, the load options shared with `psr generate`, and one short run of
the benchmark."""

from __future__ import annotations

import json
import socket
import statistics
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint

from psr.cli import build_parser, main
from psr.cli.generate import load_options


@pytest.fixture
def no_load(monkeypatch):
    import psr.models

    def boom(*args, **kwargs):
        raise AssertionError("reached a model load; the arguments should have failed")

    monkeypatch.setattr(psr.models, "load", boom)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["serve", "--port", "0"], 2, "argument --port: expected a port in [1, 65535], got '0'"),
        (["serve", "--port", "http"], 2, "argument --port: expected a port number, got 'http'"),
        (["serve", "--max-queue", "-1"], 2, "argument --max-queue: expected an integer >= 0"),
        (["serve", "--residency", "2"], 2, "argument --residency: expected a number in (0, 1]"),
        (["serve", "--host", ""], 2, "argument --host: expected a non-empty string"),
        (["serve", "--policy", "exact", "--lam", "0.3"], 2, "--policy exact: "),
        (["serve", "--model", "/no/such/folder"], 1, "--model /no/such/folder: no such folder"),
        (["serve", "--max-body", "0"], 2, "argument --max-body: expected an integer >= 1"),
        (["serve", "--api-key-file", "/no/such/keys"], 1, "--api-key-file /no/such/keys: "),
        (["serve", "--chat-template", "/no/such.jinja"], 1, "--chat-template /no/such.jinja: "),
        (["serve", "--api-key", "two words"], 1, "--api-key: a key must be non-empty"),
        (["serve", "--allowed-origins", ","], 1, "--allowed-origins: give origins"),
        (
            ["serve", "--tool-parser", "nope"],
            1,
            "--tool-parser 'nope': one of deepseek_v3, glm45, ",
        ),
        (["bench", "serve", "--requests", "0"], 2, "argument --requests: expected an integer >= 1"),
        (["bench", "serve", "--max-tokens", "x"], 2, "argument --max-tokens: expected an integer"),
    ],
)
def test_errors_are_one_line_before_loading(argv, code, message, capsys, no_load) -> None:
    got, out, err = run(argv, capsys)
    assert got == code and out == ""
    assert err.startswith("psr: error: ") and err.count("\n") == 1, err
    assert message in err


def test_a_checkpoint_without_a_tokenizer_is_refused(tmp_path, capsys, no_load) -> None:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")
    capsys.readouterr()  # the writer's progress bar
    code, _, err = run(["serve", "--model", str(path)], capsys)
    assert code == 1 and "has no tokenizer" in err and err.count("\n") == 1


def test_a_taken_port_fails_before_loading(capsys, no_load) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = run(["serve", "--port", str(port)], capsys)
    assert code == 1 and f"--port {port}: cannot listen" in err and err.count("\n") == 1


def test_listening_beyond_loopback_without_a_key_warns(caplog, no_load) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for host, warns in (("0.0.0.0", True), ("127.0.0.1", False)):
        caplog.clear()
        # no_load: the server gets as far as loading, and stops
        with pytest.raises(AssertionError, match="reached a model load"):
            main(["serve", "--host", host, "--port", str(port)])
        assert ("without an API key" in caplog.text) == warns
    with pytest.raises(AssertionError, match="reached a model load"):
        main(["serve", "--host", "0.0.0.0", "--port", str(port), "--api-key", "k"])
    assert "without an API key" not in caplog.text


def test_serve_takes_generates_load_options_and_defaults() -> None:
    p = build_parser()
    gen = p.parse_args(["generate", "--prompt", "x"])
    serve = p.parse_args(["serve"])
    assert load_options(serve) == load_options(gen)
    argv = ["--policy", "cache-prior", "--residency", "0.25", "--expert-format", "int8"]
    assert load_options(p.parse_args(["serve", *argv])) == load_options(
        p.parse_args(["generate", "--prompt", "x", *argv])
    )
    assert (serve.host, serve.port, serve.max_queue) == ("127.0.0.1", 8000, 16)
    assert serve.model is None and serve.served_model_name is None


def test_bench_serve_prints_its_table(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--dtype", "float32", "--requests", "2", "--max-tokens", "4"]
    code, text, _ = run([*argv, "--rounds", "2", "--json", str(out), "--quiet"], capsys)
    assert code == 0
    assert "| model.generate | 8 | " in text  # 2 rounds x (before + after) x 2 prompts
    for row in ("server, sequential", "server, 2 concurrent"):
        assert f"| {row} | 4 | " in text
    assert "with a Student-t 95% interval over the 4 pairs" in text
    assert "| decode thread CPU ms/token | event loop CPU ms/token |" in text
    assert "greedy outputs equal to model.generate, token for token: yes" in text
    result = json.loads(Path(out).read_text())
    assert result["greedy_equal"] is True
    assert len(result["rounds"]) == 2
    pairs = {"server, sequential": [], "server, 2 concurrent": []}
    for ref, seq, conc in result["rounds"]:
        assert ref["tokens"] == 2 * seq["tokens"] == 2 * conc["tokens"]  # the pairs
        assert len(seq["outputs"]) == 2 and seq["outputs"] == conc["outputs"] == ref["outputs"][:2]
        assert ref["outputs"][2:] == ref["outputs"][:2]
        # CPU time: the decoding thread's in every run, the event loop's in the server's
        assert min(r["decode_cpu_s"] for r in (ref, seq, conc)) > 0
        assert ref["loop_cpu_s"] == 0 and seq["loop_cpu_s"] > 0 and conc["loop_cpu_s"] > 0
        for r in (ref, seq, conc):  # every gap kept; per request, its median
            at, medians = 0, []
            for o in r["outputs"]:
                medians.append(statistics.median(r["gaps_ms"][at : at + len(o) - 1]))
                at += len(o) - 1
            assert at == len(r["gaps_ms"]) and r["request_ms"] == medians
        pairs["server, sequential"] += [
            b / a - 1 for a, b in zip(ref["request_ms"][:2], seq["request_ms"], strict=True)
        ]
        pairs["server, 2 concurrent"] += [
            b / a - 1 for a, b in zip(ref["request_ms"][2:], conc["request_ms"], strict=True)
        ]
    for name, want in pairs.items():
        o = result["overheads"][name]
        assert o["values"] == pytest.approx(want) and len(want) == 4
        assert o["lo"] < o["mean"] < o["hi"] and o["mean"] == pytest.approx(sum(want) / 4)
        # the row shows the same figures
        assert f"| {o['mean'] * 100:+.1f}% [{o['lo'] * 100:+.1f}, {o['hi'] * 100:+.1f}] |" in text


def test_bench_overhead_interval_is_student_t_over_pairs() -> None:
    from psr.serve.overhead import Overhead

    one = Overhead.of([0.04])
    assert (one.mean, one.lo, one.hi, str(one)) == (0.04, None, None, "+4.0%")
    two = Overhead.of([0.01, 0.03])
    # t(0.975, 1 df) = 12.7062; sd = 0.01 * sqrt(2); half = t * sd / sqrt(2) = 0.127062
    assert two.mean == pytest.approx(0.02)
    assert (two.lo, two.hi) == (
        pytest.approx(0.02 - 0.127062, abs=1e-6),
        pytest.approx(0.02 + 0.127062, abs=1e-6),
    )
    five = Overhead.of([0.02, 0.03, 0.01, 0.02, 0.02])  # t(0.975, 4 df) = 2.7764
    assert five.hi - five.mean == pytest.approx(2.7764 * 0.0070711 / 5**0.5, rel=1e-4)
    assert str(five) == "+2.0% [+1.1, +2.9]"
