#!/usr/bin/env bash
# The GPU machine's side of bench/gpu_suite.py in one line (README "GPU checks"): install the wheels that
# bench/gpu_wheels.sh put in .whl/ (no network there), then run the suite into OUT.
#
#   bash bench/gpu_run.sh OUT [gpu_suite.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/gpu_run.sh OUT [options]}
shift
mkdir -p "$out"
ls .whl/hype-*.whl >/dev/null 2>&1 || { echo "no .whl/ here: run 'bash bench/gpu_wheels.sh' first and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$out/nvidia-smi.csv" 2>&1 || true
exec python3 bench/gpu_suite.py --out "$out" "$@"
