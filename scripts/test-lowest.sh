#!/usr/bin/env bash
# The tests that need neither verl, torch, Ray nor the Go binaries (pytest markers `verl`
# and `e2e`) and test no offline tool (`tools`: they read files, not the SDK), in
# .venv-lowest: the lowest OpenTelemetry versions pyproject.toml allows.
# Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv-lowest.sh || exit 1
export PYTHONUNBUFFERED=1
.venv-lowest/bin/python -m pip list 2>/dev/null | grep -i '^opentelemetry-' || true
.venv-lowest/bin/python -m pytest -ra -n "${OTEL_VERL_TEST_WORKERS:-2}" --dist loadfile -m "not verl and not e2e and not tools" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit "$rc"
