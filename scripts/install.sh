#!/usr/bin/env bash
# Fresh-machine install: a venv in .venv with the pinned dependencies and psr
# built in editable mode (CUDA backend too wherever nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -m pip install -q --no-build-isolation -e .
.venv/bin/python -c "import psr, json; print(json.dumps(psr.backend_info()))"
