#!/usr/bin/env bash
# The test command (README): sets up .venv, then runs the whole suite.
# Extra arguments go to pytest. pytest's exit code 5 ("no tests collected") is a failure
# here only when tests were expected: a selection that matches nothing is reported, not hidden.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh || exit 1
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
# Two workers (pytest-xdist), a module on one (and the modules reading the shared demo
# on one: tests/conftest.py): part of the suite's time is waits (Ray, servers,
# subprocesses). OTEL_VERL_TEST_WORKERS=0: one process.
.venv/bin/python -m pytest -ra -n "${OTEL_VERL_TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit "$rc"
