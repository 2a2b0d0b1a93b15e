#!/usr/bin/env bash
# Execute the six teaching notebooks and render each to HTML that shows its figures offline
# (bench_results/notebooks/*.html); arguments go to scripts/build_notebooks.py (--out DIR, notebooks).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/build_notebooks.py "$@"
