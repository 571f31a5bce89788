#!/usr/bin/env bash
# The device machine's entry point for benchmarks/gpu_check.py (its docstring has the run command):
# the image's python3, unbuffered output, OUT defaulting to ./gpu-out; arguments pass through.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/gpu-out}"
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
