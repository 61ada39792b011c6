#!/usr/bin/env bash
# The test command (README): sets up .venv, then runs the whole suite.
# Extra arguments go to pytest. pytest's exit code 5 ("no tests collected") is a failure
# here only when tests were expected: a selection that matches nothing is reported, not hidden.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh || exit 1
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
.venv/bin/python -m pytest -ra "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit "$rc"
