"""Rehearsal of bench/gpu_bench.sh on the CPU: the GPU run's scripts run in tiny mode without
a Python error and write every field its summary reads (docs/gpu.md). A GPU run is rare and
short; this is what lets it work the first time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from psr.eval.latency import Profile, simulate
from psr.runtime import Trace

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
POLICIES = {"exact", "exact-prefetch", "cache-prior", "psr"}


def _run(args: list[str], timeout: float = 300) -> str:
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
    p = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, f"{args}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny replay and one tiny decode (the scripts' --tiny mode), shared by the tests."""
    d = tmp_path_factory.mktemp("gpu_bench")
    _run([str(BENCH / "gpu_replay.py"), "--tiny", "--out", str(d), "--prompts", "1"])
    _run([str(BENCH / "gpu_decode.py"), "--tiny", "--out", str(d), "--tokens", "4"])
    return d


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow
def test_replay_writes_every_field(out: Path) -> None:
    r = json.loads((out / "replay.json").read_text())
    assert r["status"] == "complete" and r["mode"] == "tiny"
    assert r["kernel_check"]["ok"] and r["kernel_check"]["kernel"] == "triton"
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
    assert (out / "decode_profile.json").is_file()


@pytest.mark.slow
def test_summary_gives_every_check_a_verdict(out: Path) -> None:
    (out / "stages.tsv").write_text("replay\tok\t0\t1.0\t240\t\ndecode\ttimeout\t124\t9.0\t9\t\n")
    (out / "MODE").write_text("rehearsal (test)")
    _run([str(BENCH / "gpu_summary.py"), "--out", str(out), "--quiet"])
    text = (out / "summary.md").read_text()
    assert "| decode | timeout |" in text and "## Trace replay" in text
    checks = json.loads((out / "checks.json").read_text())
    assert len(checks) == 4
    by = {c["source"].split(":")[0]: c["verdict"] for c in checks}
    assert by["replay.json"] in ("PASS", "FAIL")  # replay ran: a verdict, never NO DATA
    assert by["copy.json"] == "NO DATA"  # the copy stage did not run here


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
    assert got == ["PASS", "FAIL", "PASS", "NO DATA"]


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
