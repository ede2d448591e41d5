#!/usr/bin/env bash
# The GPU machine's one script (about 5-8 minutes on an H200): build the CUDA backend,
# run the GPU tests, then the benchmarks; everything lands under bench/results/gpu/.
#   bash bench/gpu_bench.sh            (python3 there holds CUDA torch + triton)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
step() { echo "== $1 ($(date +%T))" | tee -a "$OUT/summary.txt"; }

step build
PSR_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  $PY -m pip install --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
$PY -c "import psr, json; print(json.dumps(psr.backend_info()))" | tee -a "$OUT/summary.txt"

step "gpu tests"
$PY -m pytest -q -m gpu tests/store 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"

step "copy engine vs pinned copy_, overlap"
$PY -m psr.cli bench copy --backend cuda --json "$OUT/copy.json" 2>&1 | tee "$OUT/copy.txt"

step "kernels vs torch"
$PY bench/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.md"

step "decode: OLMoE-1B-7B shape, four policies, 50% / 25%"
$PY bench/gpu_decode.py --out "$OUT" 2>&1 | tee "$OUT/decode.txt"
step done
