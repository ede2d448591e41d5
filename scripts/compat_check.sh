#!/usr/bin/env bash
# Compatibility check of pyproject.toml's declared ranges: a scratch venv with the LOWEST
# version each [project] dependency admits (its ">=" bound), psr built CPU-only into it, and a
# subset of the tests run with that venv's python. Not run by CI: it downloads from PyPI.
#
#   bash scripts/compat_check.sh                 # lower bounds -> build/venv-compat
#   COMPAT_OVERRIDES="triton==3.8.0" COMPAT_VENV=build/venv-compat-hi bash scripts/compat_check.sh
#
# Environment:
#   COMPAT_VENV       the venv (default build/venv-compat; remade each run unless COMPAT_REUSE=1)
#   COMPAT_OVERRIDES  space-separated requirements replacing the lower bound of the same name
#                     (default "torch==2.13.0": torch's lower bound 2.9 exists on x86_64 Linux
#                     only as a CUDA build of several GB; 2.13.0 CPU is the wheel on local disk.
#                     torch 2.11, the GPU image's, is likewise only a multi-GB download here)
#   COMPAT_TESTS      the tests to run (default below)
#   PYTHON            the interpreter the venv is made from (default python3)
# Logs: $COMPAT_VENV/{install,build,tests}.log; the summary goes to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${COMPAT_VENV:-build/venv-compat}
OVERRIDES=${COMPAT_OVERRIDES-torch==2.13.0}
TESTS=${COMPAT_TESTS:-tests/runtime tests/bookkeeping tests/test_architecture.py \
tests/kernels/test_routing.py tests/kernels/test_expert_ffn.py tests/eval/test_eval.py \
tests/test_packaging.py}
SRC=build/compat-src
t0=$SECONDS
step() { echo "compat: [$((SECONDS - t0))s] $*"; }

if [ "${COMPAT_REUSE:-0}" != 1 ] || [ ! -x "$VENV/bin/python" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
VPY=$(cd "$VENV" && pwd)/bin/python

# The requirements: each dependency's lower bound (">=X" -> "==X"), then the overrides; the
# build requirements and the test runner at whatever the index has.
REQ_LINES=$("$VPY" - "$OVERRIDES" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

with open("pyproject.toml", "rb") as f:
    doc = tomllib.load(f)
over = {canonicalize_name(Requirement(r).name): r for r in sys.argv[1].split()}
for dep in doc["project"]["dependencies"]:
    req = Requirement(dep)
    name = canonicalize_name(req.name)
    if name in over:
        print(over.pop(name))
        continue
    lows = [s.version for s in req.specifier if s.operator == ">="]
    if len(lows) != 1:
        sys.exit(f"compat: {dep!r} has no single '>=' lower bound")
    print(f"{req.name}=={lows[0]}")
if over:
    sys.exit(f"compat: overrides name no dependency: {sorted(over)}")
for dep in doc["build-system"]["requires"]:
    print(dep)
print("pytest")
print("pytest-benchmark")
EOF
)
mapfile -t REQS <<<"$REQ_LINES"
step "venv $VENV ($("$VPY" --version)); installing: ${REQS[*]}"
"$VPY" -m pip install -q --upgrade pip >"$VENV/install.log" 2>&1
"$VPY" -m pip install "${REQS[@]}" >>"$VENV/install.log" 2>&1 || {
  tail -30 "$VENV/install.log"
  step "FAILED: pip could not install the lower bounds (log: $VENV/install.log)"
  exit 1
}
step "installed:"
"$VPY" -m pip list --format=freeze 2>/dev/null |
  grep -iE '^(torch|triton|transformers|numpy|safetensors|tqdm|tokenizers|matplotlib|scipy|platformdirs|huggingface.hub|setuptools|pybind11|cmake|ninja|pytest)==' |
  sed 's/^/  /'

# psr from a copy of the work tree (tracked and untracked-but-not-ignored files), so this
# build shares no CMake cache or build/ folder with .venv's editable install.
rm -rf "$SRC" && mkdir -p "$SRC"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard |
    tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$SRC"
else
  tar -cf - --exclude=./build --exclude=./.venv . | tar -xf - -C "$SRC"
fi
step "building psr (PSR_CUDA=0) from $SRC"
if ! PSR_CUDA=0 "$VPY" -m pip install -v --no-build-isolation --no-deps "$SRC" >"$VENV/build.log" 2>&1; then
  tail -30 "$VENV/build.log"
  step "FAILED: build (log: $VENV/build.log)"
  exit 1
fi
grep -m1 -o 'psr: building backends.*' "$VENV/build.log" | sed 's/^/  /' || true
(cd "$SRC" && "$VPY" -c "
import json, psr
info = psr.backend_info()
print('  backend_info:', json.dumps(info))
assert info['cuda_compiled'] is False, 'PSR_CUDA=0 built a CUDA backend'
")

step "pytest ${TESTS}"
set +e
# shellcheck disable=SC2086  # TESTS is a word list
(cd "$SRC" && "$VPY" -m pytest -q -p no:cacheprovider $TESTS) >"$VENV/tests.log" 2>&1
rc=$?
set -e
grep -E '^(FAILED|ERROR)' "$VENV/tests.log" | sed 's/^/  /' || true
tail -1 "$VENV/tests.log" | sed 's/^/  /'
step "done: pytest exit $rc (log: $VENV/tests.log)"
exit $rc
