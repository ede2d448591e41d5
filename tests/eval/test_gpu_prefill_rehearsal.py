"""Rehearsal of gpu_bench.sh's prefill stage (bench/gpu_prefill.py --dry-run) on the CPU: it
runs, writes every field, and the split it forces takes experts off the copies without
changing the first token; layer-major beside it, the same first token, no more copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_stage_dry_run(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    args = ["--dry-run", "--models", "embedded", "--prompts", "24", "--reps", "1"]
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_prefill.py"), *args, "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "prefill.json").read_text())
    assert res["device"] == "cpu" and res["chunk"] == 16
    m = res["models"]["embedded (bf16 rows)"]
    assert m["threshold"] == 3 and set(m["costs"]) == {"copy_s", "cpu_expert_s"}
    k = m["kernels"]  # the grouped GEMM beside the per-expert reference, both computed
    assert k["grouped_chunk_s"] > 0 and k["reference_per_expert_s"] > 0
    assert k["max_abs_diff_chunk"] <= 0.02 * k["ref_max_abs"]  # bf16 outputs' rounding
    row = m["prompts"]["24"]
    off, on = row["off"], row["on"]
    assert off["cpu_experts"] == 0 < on["cpu_experts"]
    assert on["prefill_copies"] < off["prefill_copies"]
    assert row["same_first_token"] and on["tok_s"] > 0 and off["ttft_s"] > 0
    # layer-major (the split on): the same first token, each layer's experts copied once
    lm = row["layer_major"]
    assert row["layer_major_same_first_token"] and lm["cpu_experts"] == on["cpu_experts"]
    assert lm["prefill_copies"] <= on["prefill_copies"]
    assert lm["schedule"]["layers"] == 8 and lm["schedule"]["read"] > 0  # 8 MoE layers
    # gpu_bench.sh's summary shows the stage
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_summary
    finally:
        sys.path.remove(str(ROOT / "bench"))
    table = gpu_summary.prefill_lines(tmp_path)
    assert table[1].startswith("## Prefill") and table[-1].startswith(
        "| embedded (bf16 rows) | 24 | 3 |"
    )
