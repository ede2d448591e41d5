"""psr.load of a multi-GB synthetic GGUF file: load time and peak resident memory against
the file's expert bytes + the dequantized dense part (issue 26's bound: at most 10% over).

    .venv/bin/python bench/gguf_load.py [--layers 16] [--experts 128] [--out FILE] [--json F]

Writes a qwen3moe file with bench/gguf_open.py's writer (hidden 1024, expert FFN 768, Q4_K
experts as random blocks with valid scales, F16 dense tensors), then in a fresh process
loads it (policy exact, residency 0.25, CPU) and reads ru_maxrss: the process's peak, from
before transformers is imported to the loaded model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def measure(path: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    import psr

    t_import = time.perf_counter() - t0
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    model = psr.load(path, "exact", residency=0.25, device="cpu", progress=False)
    t_load = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mem = model.memory(context=0)
    bound = mem["host_experts"] + mem["device_slab"] + mem["device_dense"]
    return {
        "file_gib": path.stat().st_size / 2**30,
        "host_experts_gib": mem["host_experts"] / 2**30,
        "device_slab_gib": mem["device_slab"] / 2**30,
        "dense_gib": mem["device_dense"] / 2**30,
        "import_s": t_import,
        "load_s": t_load,
        "load_gb_per_s": mem["host_experts"] / t_load / 1e9,
        "rss_before_gib": base / 2**30,
        "peak_rss_gib": peak / 2**30,
        "peak_growth_gib": (peak - base) / 2**30,
        "growth_over_experts_slab_dense": (peak - base) / bound,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("/tmp/psr-big-load.gguf"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the file")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.out)))
        return
    from gguf_open import write

    t0 = time.perf_counter()
    if not a.out.exists():
        write(a.out, a.layers, a.experts)
    print(
        f"file {a.out} ({a.out.stat().st_size / 2**30:.2f} GiB), {time.perf_counter() - t0:.0f} s"
    )
    out = subprocess.run(
        [sys.executable, __file__, "--measure", "--out", str(a.out)],
        check=True,
        capture_output=True,
        text=True,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for k, v in res.items():
        print(f"{k:34s} {v:10.3f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res | {"layers": a.layers, "experts": a.experts}, indent=2))
    if not a.keep:
        a.out.unlink()


if __name__ == "__main__":
    main()
