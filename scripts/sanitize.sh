#!/usr/bin/env bash
# The expert store under AddressSanitizer + UndefinedBehaviorSanitizer.
#
# Builds psr._C with PSR_SANITIZE (default "address,undefined"; CPU backend, Debug) into
# build/sanitize/ -- the normal build in python/psr is not touched -- then runs tests/store
# and a short decode against it, through a package tree (build/sanitize/pkg/psr) that is the
# source tree but for the sanitized extension.
#
#   bash scripts/sanitize.sh                        # ASan + UBSan
#   PSR_SANITIZE=address bash scripts/sanitize.sh   # one sanitizer
#   bash scripts/sanitize.sh -k retries             # extra arguments go to pytest
#
# An installed sanitized build is the one-liner `PSR_SANITIZE=address,undefined pip install -e .`
# (it replaces the normal extension: reinstall without PSR_SANITIZE afterwards); run Python with
# the LD_PRELOAD and *SAN_OPTIONS set below.
#
# The Python interpreter and torch are not instrumented, so the sanitizer runtimes are preloaded
# (ASan must come first; libstdc++ too, so ASan intercepts C++ throws). detect_leaks=0:
# LeakSanitizer would report the interpreter's and torch's own allocations that are never freed
# at exit; the store's own memory and threads are checked by the lifetime tests instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
SAN=${PSR_SANITIZE:-address,undefined}
OUT=$ROOT/build/sanitize

echo "== build psr._C with -fsanitize=$SAN into $OUT"
mkdir -p "$OUT"
cmake -S "$ROOT" -B "$OUT/cmake" -G Ninja \
  -DPython_EXECUTABLE="$PY" \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DPSR_WITH_CUDA=OFF -DPSR_SANITIZE="$SAN" -DCMAKE_BUILD_TYPE=Debug \
  -DPSR_OUTPUT_DIR="$OUT/lib" >"$OUT/cmake.log" 2>&1 || { cat "$OUT/cmake.log"; exit 1; }
cmake --build "$OUT/cmake" --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"

PKG=$OUT/pkg/psr
rm -rf "$OUT/pkg"
mkdir -p "$PKG"
for f in "$ROOT"/python/psr/*; do
  case "$(basename "$f")" in _C.*.so | __pycache__) continue ;; esac
  ln -s "$f" "$PKG/"
done
ln -s "$OUT"/lib/_C.*.so "$PKG/"

preload=()
for lib in libasan.so libubsan.so libstdc++.so; do
  case "$lib" in
    libasan.so) [[ $SAN == *address* ]] || continue ;;
    libubsan.so) [[ $SAN == *undefined* ]] || continue ;;
  esac
  path=$(gcc -print-file-name="$lib")
  [[ $path == /* ]] || { echo "sanitize.sh: gcc has no $lib" >&2; exit 1; }
  preload+=("$path")
done

export LD_PRELOAD="${preload[*]}"
# allocator_may_return_null=1: the tests ask for impossible sizes and expect MemoryError.
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:check_initialization_order=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export PYTHONPATH=$OUT/pkg${PYTHONPATH:+:$PYTHONPATH}
export PSR_SANITIZED=1      # tests skip their own sanitizer build
export PSR_SKIP_CUDA_BUILD=1  # this extension has no CUDA backend: skip the cubin check
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# The store is the extension's one door; which file it loaded is a start-up check here.
"$PY" -c "
import psr.store, sys
f = sys.modules['psr._C'].__file__
assert f.startswith('$OUT'), f
print('sanitized extension:', f)"

echo "== tests/store under $SAN"
"$PY" -m pytest -q -p no:cacheprovider "$ROOT/tests/store" "$@"

echo "== short decode under $SAN"
"$PY" -m psr.cli generate --max-new-tokens 8 --quiet --prompt "HAMLET."
echo "sanitize.sh: clean under $SAN"
