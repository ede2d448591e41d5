"""`psr generate --graphs / --no-graphs`: the option reaches psr.load, and the summary line
says whether decode tokens ran as one graph, and why not (model.graph_status)."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr.models
from psr.cli import main

BASE = ["--prompt-ids", "5,17,33", "--max-new-tokens", "3", "--dtype", "float32", "--quiet"]
# 3 + 3 tokens: a static cache of 64 (graphs.bucket's smallest); the third new token is the
# first replay (the first decode step runs eagerly), so --graphs captures once.
CASES = [  # (extra arguments, graphs= given to psr.load, the status printed, captures)
    ([], "auto", "off (graphs='auto': on for CUDA only)", 0),
    (["--no-graphs"], False, "off (graphs=False)", 0),
    (["--graphs"], True, "on (static cache of 64 tokens)", 1),
    (
        ["--graphs", "--decode", "host"],
        True,
        "off: decode='host' (graphs need the device decode step)",
        0,
    ),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("cli_graphs") / "olmoe")


@pytest.mark.parametrize(
    ("extra", "graphs", "status", "captures"),
    CASES,
    ids=["default", "no-graphs", "graphs", "graphs-decode-host"],
)
def test_generate_prints_the_graph_status(
    ckpt, capsys, tmp_path, monkeypatch, extra, graphs, status, captures
) -> None:
    loads: list[object] = []
    real_load = psr.models.load

    def spy(*a, **kw):
        loads.append(kw["graphs"])
        return real_load(*a, **kw)

    monkeypatch.setattr(psr.models, "load", spy)  # run_generate imports it at call time
    compiled: list[object] = []

    def identity(fn=None, **kw):
        """torch.compile as the identity: the graph path (static cache, capture, replay)
        without an inductor compile, which takes minutes on the CPU."""
        compiled.append(fn)
        return fn

    out_json = tmp_path / "g.json"
    argv = ["generate", "--model", str(ckpt), *BASE, *extra, "--json", str(out_json)]
    with mock.patch.object(torch, "compile", identity):
        assert main(argv) == 0
    out = capsys.readouterr().err
    decode = "host" if "host" in extra else "device"
    lines = [line for line in out.splitlines() if line.startswith("policy ")]
    assert len(lines) == 1, out
    assert lines[0].endswith(f", decode {decode}, graphs {status}"), lines[0]
    assert loads == [graphs]
    data = json.loads(out_json.read_text())
    assert len(data["tokens"]) == 3 + 3
    assert data["stats"]["captures"] == captures
    assert len(compiled) == captures  # on the CPU a capture is a torch.compile
