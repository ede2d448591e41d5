"""`psr inspect` of a GGUF file reads its header alone: no torch, no transformers.

The header's answer (tensor table, family tables, the torch-free KV accounting) is checked
against the reference that builds transformers' config and the model on the meta device,
on tiny files of every GGUF architecture psr reads and on header-faithful files of
published models (bench/fit_table.py); `psr inspect FILE.gguf` runs in a process where
torch and transformers cannot be imported, in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gguf_files import fit_table, gguf_tiny_model, write_gguf

import psr.models.tiers as tiers
from psr.models.gguf import GGUFCheckpoint
from psr.models.inspect import _inspect_gguf, inspect
from psr.models.memory_plan import Budget

ROOT = Path(__file__).resolve().parents[2]
MEMINFO = {"MemTotal": 64 * 2**30, "MemAvailable": 48 * 2**30}


def _both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """(header's answer, reference's answer) at a fixed MemAvailable (the host-memory line
    prints it, and it moves between two reads)."""
    monkeypatch.setattr(tiers, "meminfo", lambda: dict(MEMINFO))
    fast = inspect(path)
    ck = GGUFCheckpoint(path)
    try:
        ref = _inspect_gguf(path, ck, reference=True)
    finally:
        ck.close()
    return fast, ref


TINY = {
    "qwen3_moe": {"experts": "Q4_K", "dense": "Q8_0"},
    "qwen2_moe": {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K", "dense": "Q8_0"},
    "olmoe": "Q8_0",
    "mixtral": {"experts": "Q4_K", "dense": "F16"},
    "glm4_moe": {"experts": "Q4_K", "dense": "Q8_0"},
    "gpt_oss": "F32",
    "deepseek_v3": {"experts": lambda layer: "Q4_K" if layer % 2 else "Q6_K", "dense": "Q8_0"},
    "deepseek_v2": "Q8_0",
}


@pytest.mark.parametrize("family", list(TINY))
def test_the_header_answers_as_the_meta_model_does(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / f"{family}.gguf"
    write_gguf(gguf_tiny_model(family), path, TINY[family])  # type: ignore[arg-type]
    fast, ref = _both(path, monkeypatch)
    assert fast.supported and fast.dense_bytes > 0 and fast.kv_bytes_per_1k_tokens > 0
    assert fast.to_dict() == ref.to_dict()
    assert fast.table() == ref.table()


@pytest.mark.parametrize("model", ["Qwen3-30B-A3B Q4_K_M", "DeepSeek-V3 Q4_K_M"])
def test_header_faithful_files_answer_as_the_meta_model_does(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Published shapes: a 150k vocabulary (Qwen3), MLA, dense first layers, shared
    experts, the MTP layer and the router's correction bias (DeepSeek-V3)."""
    fit = fit_table()
    (path,) = fit.write(fit.SPECS[model], tmp_path / "m.gguf")
    fast, ref = _both(path, monkeypatch)
    assert fast.to_dict() == ref.to_dict()
    assert fast.table() == ref.table()


# the memory plan's flags: the plan is torch-free too
PLAN = [
    "--gpu-memory",
    "24GiB",
    "--host-memory",
    "64GiB",
    "--context",
    "32k",
    "--dense-format",
    "float",
]
CHILD = (
    f"PLAN = {PLAN!r}\n"
    + """
import json, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "triton"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocked())
from psr.cli import main

try:
    rc = main(["inspect", "--json", "--model", sys.argv[1], *PLAN])
except SystemExit as e:
    rc = e.code
# VmHWM: this process's peak RSS (ru_maxrss would keep the forking parent's across exec)
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
peak = int(hwm.split()[1]) * 1024
print(json.dumps({"rc": rc, "peak_rss": peak}))
"""
)


def test_psr_inspect_of_a_gguf_file_imports_no_torch_and_stays_small(tmp_path: Path) -> None:
    """`psr inspect --json FILE.gguf` of Qwen3-30B-A3B Q4_K_M's header (151,936 tokens;
    18.6 GB of holes), with a memory plan, in a process where torch, transformers and
    triton cannot be imported: it answers (what the in-process call answers) within 200 MB
    of peak RSS."""
    fit = fit_table()
    (path,) = fit.write(fit.SPECS["Qwen3-30B-A3B Q4_K_M"], tmp_path / "q.gguf")
    env = {"PYTHONPATH": f"{ROOT / 'python'}:{ROOT}", "OMP_NUM_THREADS": "1", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    *printed, last = out.stdout.strip().splitlines()
    status = json.loads(last)
    assert status["rc"] == 0, out.stderr
    found = json.loads("\n".join(printed))
    from psr.eval.latency import get_profile

    rates = get_profile("rtx4090").rates()  # psr inspect's default --profile
    budget = Budget(24 * 2**30, 64 * 2**30, 32768, dense_format="float", rates=rates)
    want = inspect(path, budget).to_dict()
    for key in ("host_memory", "default_host_memory"):  # MemAvailable moves between reads
        found.pop(key), want.pop(key)
    assert found == want and found["num_experts"] == 128
    assert found["plan"]["fits"] and found["plan"]["context"] == 32768
    assert found["plan"]["modeled"]["rates"] == "rtx4090"
    assert status["peak_rss"] < 200 * 2**20, status["peak_rss"]
