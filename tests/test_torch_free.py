"""The pure parts of psr import and work where torch cannot be imported.

A subprocess installs an import hook that makes `import torch` (and triton, transformers,
matplotlib) raise ImportError, then imports the latency model, the traces, the report
tables, the option words, the policies, the operating points, the logical cache and the
evaluation defaults, and uses them: a hand-built trace through the latency model (every
time below worked out by hand), a markdown table, a policy, a cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "triton", "transformers", "matplotlib")

CODE = """
import json, sys

BLOCKED = %r


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None


sys.meta_path.insert(0, Blocked())
try:
    import torch  # noqa: F401
    blocker_works = False
except ImportError:
    blocker_works = True

import psr.eval.defaults as defaults
import psr.points  # noqa: F401
import psr.runtime
import psr.vocab as vocab
from psr.cache import LogicalCache
from psr.eval.latency import Profile, simulate
from psr.eval.labels import pct
from psr.eval.report import markdown_table
from psr.eval.ttft import ttft_report
from psr.policy import make_policy
from psr.runtime.trace import Copy, LayerStep, Trace

# Two decoder layers, both MoE, one token: layer 0 misses expert 3 (slot 0) and prefetches
# expert 5 into layer 1's slot 1; layer 1 routes expert 5 and must wait for that prefetch.
trace = Trace(2, [0, 1], 1, 1_000_000, "hand-built")
trace.tokens.append(
    [
        LayerStep(0, [3], [0], 0, [Copy(0, 0, 3, "miss"), Copy(1, 1, 5, "prefetch")]),
        LayerStep(1, [5], [1], 1),
    ]
)
trace = Trace.from_json(json.loads(json.dumps(trace.to_json())))  # survives JSON
unit = Profile("unit", h2d_gbps=1.0, copy_overhead_us=0.0, hbm_gbps=4.0,
               expert_overhead_us=0.0, dense_ms_per_layer=0.5, expert_bytes=1_000_000)
lat = simulate(trace, unit)

result = {
    "config": {"policy": "psr", "residency": 0.375, "lam": 0.1, "n": 1},
    "label": "psr(lam=0.1, n=1)",
    "stats": {"misses_per_token": 1.0, "hit_rate": 0.5, "prefetches": 1,
              "prefetch_used_frac": 1.0},
    "latency": {p: {"ms_per_token": lat.ms_per_token} for p in defaults.DEFAULT_PROFILES},
    "speedup": {"rtx4090": 1.25},
    "greedy_agreement": 1.0,
}
cache = LogicalCache(2, 8)
use = cache.use([4, 1])
print(json.dumps({
    "blocker_works": blocker_works,
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
    "lazy_trace": psr.runtime.Trace is Trace,
    "latency": [lat.ms_per_token, lat.compute_ms, lat.copy_ms, lat.stall_ms, lat.tokens],
    "table": markdown_table([result]).splitlines(),
    "pct": pct(0.375),
    "policy": make_policy("psr", 0.1, 1).describe(),
    "cache": [use.hits, [m.expert for m in use.misses], cache.order()],
    "vocab": [vocab.canonical_dtype("torch.bf16"), vocab.expert_format("native")],
    "profiles": list(defaults.DEFAULT_PROFILES),
    "ttft": ttft_report().splitlines()[0],
}))
"""


def test_pure_modules_work_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE % (BLOCKED,)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["blocker_works"], "the import hook did not block torch"
    assert r["loaded"] == []
    assert r["lazy_trace"]
    # dense 0.5 | miss copy 0.5-1.5, stall to 1.5, expert to 1.75 | dense to 2.25 | the
    # prefetch (1.5-2.5) overlapped layer 0's expert and layer 1's dense: stall to 2.5,
    # expert to 2.75. Compute 2 x (0.5 + 0.25), copies 2 x 1.0, stalls 1.0 + 0.25.
    assert r["latency"] == pytest.approx([2.75, 1.5, 2.0, 1.25, 1], abs=1e-9)
    head, rule, row = r["table"]
    assert head.startswith("| residency | policy | misses/tok |") and "rtx4090 ms/tok" in head
    assert rule == "|" + "---|" * 10
    # no substitution count in this result (as in results written before it): "-"
    assert row == (
        "| 37.5% | psr(lam=0.1, n=1) | 1.00 | 0.50 | 1.00 | 2.75 | 2.75 | 1.25x | - | 1.00 |"
    )
    assert r["pct"] == "37.5%"
    assert r["policy"] == "psr(lam=0.1, n=1)"
    assert r["cache"] == [0, [1, 4], [4, 1]]  # lower id ends most recent
    assert r["vocab"] == ["bfloat16", None]
    assert r["profiles"] == ["rtx4090", "h200"]
    assert r["ttft"].startswith("modeled time to first token")
