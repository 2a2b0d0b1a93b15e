#!/usr/bin/env bash
# The GPU engine's checks in one command and one table (scripts/gpu_check.py): greedy exactness of every algorithm
# with CUDA graphs in float32 and bfloat16, forward cost by width, and bench --device cuda on a subset.
#   bash scripts/gpu_check.sh [--limit 4] [--rounds 2] [--out bench_results/gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
if [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
exec "$python" scripts/gpu_check.py "$@"
