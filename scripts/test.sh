#!/usr/bin/env bash
# Lint, then the whole test suite (slow real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# Two workers: much of the suite is one-threaded Python (servers starting, HTTP, tokenizers), so
# two overlap; then, in one process, the tests that must run alone (timed against limits, or
# wanting every core). tests/conftest.py lists those and defines --phase, which composes with a
# -m given here. Exit status 5 is "no test selected" (by "$@").
rc=0
.venv/bin/python -m pytest -q --durations=40 -n "${SPECDEC_TEST_WORKERS:-2}" --dist loadgroup \
  --phase shared "$@" || rc=$?
[ "$rc" -eq 5 ] && rc=0
rc2=0
.venv/bin/python -m pytest -q --durations=20 --phase alone "$@" || rc2=$?
[ "$rc2" -eq 5 ] && rc2=0
[ "$rc" -ne 0 ] && exit "$rc"
exit "$rc2"
