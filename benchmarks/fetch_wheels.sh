#!/usr/bin/env bash
# Download the wheels that benchmarks/gpu.sh installs on the GPU machine (which has torch,
# transformers, onnxruntime, numpy, grpcio, protobuf, httpx, prometheus-client, ... but not the
# serving stack) into .whl/, for CPython 3.12 on manylinux x86_64, at the versions installed in
# this checkout's .venv (`make install` first). Carry .whl with the device call.
#
# Usage:  benchmarks/fetch_wheels.sh [PYTHON]   (default .venv/bin/python)
set -eu
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
PKGS="fastapi starlette uvicorn python-multipart pydantic pydantic_core annotated-types typing-inspection
typing_extensions opentelemetry-api tritonclient python-rapidjson soundfile cffi pycparser"
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
for p in $PKGS; do
  v=$("$PY" -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "$p is not installed in $PY's environment" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$p==$v" 2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl
