"""Rehearsal of bench/gpu_bench.sh on the CPU: the GPU run's scripts run in tiny mode without
a Python error and write every field its summary reads (docs/gpu.md). A GPU run is rare and
short; this is what lets it work the first time."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import psr_kernels as pk
from psr.eval.latency import Profile, simulate
from psr.eval.microbench import COPY_FORMATS
from psr.runtime import Trace

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
POLICIES = {"exact", "exact-prefetch", "cache-prior", "psr"}
FORMATS = ["int8", "int4", "fp8"]  # gpu_replay.py's default --formats, in order
TINY_HF = (64, 32)


def _env() -> dict[str, str]:
    """The rehearsal's environment: the checkout importable, Triton's interpreter, offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "python"), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.update(
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _run(args: list[str], timeout: float = 300) -> str:
    p = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, f"{args}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny replay (bf16 and every quantized format), one tiny decode (the scripts'
    --tiny mode) and the rehearsal's copy stage, shared by the tests."""
    d = tmp_path_factory.mktemp("gpu_bench")
    _run([str(BENCH / "gpu_replay.py"), "--tiny", "--out", str(d), "--prompts", "1"])
    _run([str(BENCH / "gpu_decode.py"), "--tiny", "--out", str(d), "--tokens", "4"])
    copy = ["-m", "psr.cli", "bench", "copy", "--backend", "cpu", "--shape", "3x64x32"]
    _run(
        [*copy, "--experts", "8", "--slots", "4", "--repeats", "3", "--json", str(d / "copy.json")]
    )
    return d


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow
def test_replay_writes_every_field(out: Path) -> None:
    r = json.loads((out / "replay.json").read_text())
    assert r["status"] == "complete" and r["mode"] == "tiny"
    assert r["kernel_check"]["ok"] and r["kernel_check"]["kernel"] == "triton"
    ops = pk.kernel_ops("auto", "cpu")  # what replayed: $PSR_COMPUTE, else the torch reference
    assert r["ffn"] == f"{ops.path} {ops.expert_ffn.__name__}"
    for key in ("h2d_gbps", "expert_ms", "dense_ms_per_layer", "expert_bytes"):
        assert _finite(r["calibration"][key]) and r["calibration"][key] > 0, key
    rows = r["rows"]
    assert len(rows) == 8 and {x["residency"] for x in rows} == {0.5, 0.25}
    for rho in (0.5, 0.25):
        assert {x["spec"].split(":")[0] for x in rows if x["residency"] == rho} == POLICIES
    for x in rows:
        for key in (
            "ms_per_token",
            "modeled_ms",
            "model_error",
            "speedup_vs_exact",
            "modeled_speedup_vs_exact",
            "speedup_error",
            "misses_per_token",
            "copies_per_token",
            "stall_ms_per_token",
            "modeled_h200_ms",
        ):
            assert _finite(x[key]), (x["policy"], key)
        assert x["ms_per_token"] > 0 and x["modeled_ms"] > 0 and x["tokens"] > 0
        if x["policy"] == "exact":
            assert x["speedup_vs_exact"] == 1.0 and x["modeled_speedup_vs_exact"] == 1.0
    c = r["checks"]
    assert _finite(c["max_abs_model_error"]) and _finite(c["max_abs_psr_speedup_error"])
    assert set(c["psr_speedup_error"]) == {"0.5", "0.25"}
    assert "| measured ms/tok |" in (out / "replay.md").read_text()
    # The saved traces and profile reproduce the modeled figures.
    prof = Profile.load(out / "replay_profile.json")
    traces = sorted((out / "traces").glob("*.json"))
    assert len(traces) == 8
    exact = Trace.load(out / "traces" / "0.5_exact.json")
    row = next(x for x in rows if x["residency"] == 0.5 and x["policy"] == "exact")
    assert simulate(exact, prof).ms_per_token == pytest.approx(row["modeled_ms"])


@pytest.mark.slow
def test_replay_covers_each_format(out: Path) -> None:
    """exact and psr at each residency replayed again in every quantized format: that
    format's rows and kernel, the same routing, modeled with the format's bytes ratio and
    its own expert-kernel time."""
    r = json.loads((out / "replay.json").read_text())
    assert r["format_list"] == FORMATS and r["format_policies"] == ["exact", "psr"]
    base = r["calibration"]["expert_bytes"]
    bf16_exact = {x["residency"]: x for x in r["rows"] if x["policy"] == "exact"}
    for fmt in FORMATS:
        f = r["formats"][fmt]
        assert f["status"] == "complete", f
        assert f["kernel_check"]["ok"] and f["kernel_check"]["kernel"] == "triton", f
        assert f["ffn"] == f"{r['ffn']} fmt={fmt}"
        assert f["row_bytes"] == pk.QuantLayout.of(fmt, *TINY_HF).nbytes
        assert f["bytes_ratio"] == pytest.approx(f["row_bytes"] / base) and f["bytes_ratio"] < 1
        assert f["bytes_ratio_vs_bf16"] == pytest.approx(pk.bytes_ratio(fmt, *TINY_HF))
        for key in ("expert_ms", "expert_ms_vs_bf16", "h2d_gbps", "profile_hbm_gbps", "seconds"):
            assert _finite(f[key]) and f[key] > 0, (fmt, key)
        mine = [x for x in r["format_rows"] if x["format"] == fmt]
        assert sorted((x["residency"], x["spec"].split(":")[0]) for x in mine) == [
            (0.25, "exact"),
            (0.25, "psr"),
            (0.5, "exact"),
            (0.5, "psr"),
        ]
        for x in mine:
            assert x["bytes_ratio"] == f["bytes_ratio"], (fmt, x["policy"])
            for key in (
                "ms_per_token",
                "modeled_ms",
                "model_error",
                "speedup_vs_bf16_exact",
                "modeled_speedup_vs_bf16_exact",
                "speedup_vs_bf16_exact_error",
                "speedup_vs_exact",
                "modeled_speedup_vs_exact",
                "stall_ms_per_token",
                "modeled_h200_ms",
                "copies_per_token",
            ):
                assert _finite(x[key]), (fmt, x["policy"], key)
            assert x["ms_per_token"] > 0 and x["modeled_ms"] > 0
            b = bf16_exact[x["residency"]]
            assert x["speedup_vs_bf16_exact"] == pytest.approx(
                b["ms_per_token"] / x["ms_per_token"]
            )
            # The same routing trace: the same misses and copies as bf16's row.
            same = next(
                y for y in r["rows"] if y["residency"] == x["residency"] and y["spec"] == x["spec"]
            )
            assert x["copies_per_token"] == same["copies_per_token"]
        c = r["format_checks"]["by_format"][fmt]
        assert _finite(c["max_abs_model_error"])
        assert set(c["psr_speedup_vs_bf16_exact"]) == {"0.5", "0.25"}
        # The saved bf16 trace + the format's bytes ratio + its profile reproduce the model.
        prof = Profile.load(out / f"replay_profile_{fmt}.json")
        assert prof.expert_bytes == base
        assert prof.expert_bytes * f["bytes_ratio"] / (prof.hbm_gbps * 1e9) == pytest.approx(
            f["expert_ms"] * 1e-3
        )
        tr = dataclasses.replace(
            Trace.load(out / "traces" / "0.25_exact.json"), bytes_ratio=f["bytes_ratio"]
        )
        row = next(x for x in mine if x["residency"] == 0.25 and x["policy"] == "exact")
        assert simulate(tr, prof).ms_per_token == pytest.approx(row["modeled_ms"])
    assert _finite(r["format_checks"]["max_abs_model_error"])
    assert "| format | bytes ratio |" in (out / "replay.md").read_text()


def test_replay_follows_psr_compute(tmp_path: Path) -> None:
    """--compute auto (the default) follows $PSR_COMPUTE as every psr entry point does:
    forcing Triton where it cannot run (the CPU without the interpreter) stops before any
    work, naming the variable."""
    env = _env() | {"PSR_COMPUTE": "triton", "TRITON_INTERPRET": "0"}
    d = tmp_path / "replay"
    cmd = [str(BENCH / "gpu_replay.py"), "--tiny", "--backend", "cpu", "--out", str(d)]
    p = subprocess.run(
        [sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "--compute auto: compute='triton' (from PSR_COMPUTE) needs a CUDA device" in p.stderr
    assert not d.exists()


@pytest.mark.slow
def test_copy_covers_each_format(out: Path) -> None:
    """The copy stage's per-format rows: bf16, int8, fp8, int4 at the shape's H x F."""
    c = json.loads((out / "copy.json").read_text())
    for key in ("engine_gbps", "engine_vs_peak", "overlap_efficiency", "t_copy_ms"):
        assert _finite(c[key]), key  # the bf16 fields the summary reads, as before
    assert c["format_shape"] == list(TINY_HF) and list(c["formats"]) == list(COPY_FORMATS)
    for fmt, f in c["formats"].items():
        for key in ("gbps", "copy_ms", "time_ratio_vs_bf16", "bytes_ratio", "ratio_error"):
            assert _finite(f[key]), (fmt, key)
        assert f["abs_ratio_error"] == pytest.approx(abs(f["ratio_error"]))
        want = 1.0 if fmt == "bf16" else pk.bytes_ratio(fmt, *TINY_HF)
        assert f["bytes_ratio"] == pytest.approx(want)
        assert f["row_bytes"] == (
            3 * TINY_HF[0] * TINY_HF[1] * 2
            if fmt == "bf16"
            else pk.QuantLayout.of(fmt, *TINY_HF).nbytes
        )
    assert c["formats"]["bf16"]["time_ratio_vs_bf16"] == 1.0


@pytest.mark.slow
def test_decode_writes_every_field(out: Path) -> None:
    d = json.loads((out / "decode.json").read_text())
    assert d["status"] == "complete" and d["shape"] == "tiny"
    assert len(d["runs"]) == 8
    for x in d["runs"]:
        for key in (
            "measured_ms",
            "modeled_ms",
            "model_error",
            "speedup_vs_exact",
            "modeled_speedup_vs_exact",
        ):
            assert _finite(x[key]), (x["policy"], key)
    assert _finite(d["checks"]["max_abs_model_error"])
    assert _finite(d["copy"]["engine_vs_peak"]) and _finite(d["copy"]["overlap_efficiency"])
    assert list(d["copy"]["formats"]) == list(COPY_FORMATS)  # run_copy_overlap's default
    assert (out / "decode_profile.json").is_file()


@pytest.mark.slow
def test_summary_gives_every_check_a_verdict(out: Path) -> None:
    (out / "stages.tsv").write_text("replay\tok\t0\t1.0\t240\t\ndecode\ttimeout\t124\t9.0\t9\t\n")
    (out / "MODE").write_text("rehearsal (test)")
    _run([str(BENCH / "gpu_summary.py"), "--out", str(out), "--quiet"])
    text = (out / "summary.md").read_text()
    assert "| decode | timeout |" in text and "## Trace replay" in text
    assert "Copy per expert format (64 x 32 rows" in text and "| int4 |" in text
    assert "| format | bytes ratio |" in text and "* int8: complete;" in text
    checks = json.loads((out / "checks.json").read_text())
    assert len(checks) == 5
    for c in checks:  # every stage they read ran: a verdict, never NO DATA
        assert c["verdict"] in ("PASS", "FAIL"), c
    assert checks[-1]["source"] == "copy.json: formats.int8.abs_ratio_error"


def test_summary_verdicts(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_summary
    finally:
        sys.path.remove(str(BENCH))
    (tmp_path / "copy.json").write_text(
        json.dumps({"engine_vs_peak": 0.95, "overlap_efficiency": 0.85})
    )
    (tmp_path / "replay.json").write_text(
        json.dumps({"checks": {"max_abs_model_error": 0.04, "max_abs_psr_speedup_error": None}})
    )
    got = [c["verdict"] for c in gpu_summary.checks(tmp_path)]
    assert got == ["PASS", "FAIL", "PASS", "NO DATA", "NO DATA"]  # a copy.json before formats
    for err, verdict in ((0.04, "PASS"), (0.15, "FAIL")):
        int8 = {"abs_ratio_error": err, "ratio_error": -err}
        (tmp_path / "copy.json").write_text(json.dumps({"formats": {"int8": int8}}))
        assert gpu_summary.checks(tmp_path)[-1]["verdict"] == verdict


def test_build_fallbacks_are_prepared() -> None:
    """The nvcc-free build rewrites csrc/cuda's kernels into host stand-ins: every kernel in
    cuda_backend.cu needs one in gpu_build.SHIM, or that fallback cannot build."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_build
    finally:
        sys.path.remove(str(BENCH))
    body, kernels = gpu_build.host_source((ROOT / "csrc/cuda/cuda_backend.cu").read_text())
    assert "<<<" not in body and "__global__" not in body
    for k in kernels:
        assert f"psr_shim_{k}(" in gpu_build.SHIM and f"psr_shim_{k}(" in body
    assert gpu_build.cuda_gencode("9.0") == (["-gencode", "arch=compute_90,code=sm_90"], "90-real")
    assert gpu_build.cuda_gencode("8.0;9.0+PTX")[1] == "80-real,90"
    sh = subprocess.run(["bash", "-n", str(BENCH / "gpu_bench.sh")], capture_output=True)
    assert sh.returncode == 0, sh.stderr


def test_gpu_tests_runner_without_pytest(tmp_path: Path) -> None:
    """The GPU image may have no pytest: bench/gpu_tests.py's mini runner stands in."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_tests
    finally:
        sys.path.remove(str(BENCH))
    f = tmp_path / "test_fake_gpu.py"
    f.write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "@pytest.mark.parametrize('a', [1, 2])\n"
        "@pytest.mark.parametrize('b,c', [(3, 4)])\n"
        "def test_params(a, b, c, tmp_path):\n"
        "    assert tmp_path.is_dir() and a in (1, 2) and (b, c) == (3, 4)\n"
        "def test_raises():\n"
        "    with pytest.raises(ValueError, match='bad'):\n"
        "        raise ValueError('a bad value')\n"
        "def test_fails():\n"
        "    assert False\n"
    )
    rc = gpu_tests.mini(tmp_path, files=[f], need_cuda=False)
    got = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert rc == 1 and got["counts"] == {"passed": 3, "failed": 1, "error": 0, "skipped": 0}
    assert {r["test"] for r in got["results"]} >= {
        "test_fake_gpu.py::test_params[1-3-4]",
        "test_fake_gpu.py::test_params[2-3-4]",
    }
