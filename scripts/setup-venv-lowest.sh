#!/usr/bin/env bash
# Creates .venv-lowest (once): otel-verl and its test extra with the LOWEST OpenTelemetry
# versions pyproject.toml allows (each opentelemetry-* dependency pinned to its ">=" bound),
# and no verl, torch or Ray. scripts/test-lowest.sh runs the tests that need none of them
# there, so the lower bounds in pyproject.toml are tested, not hoped for.
# Re-runs pip only when pyproject.toml changed. Downloads are cached in ~/.cache/pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
venv=.venv-lowest
if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
stamp=$venv/.otel-verl-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # "opentelemetry-sdk>=1.30,<2" -> "opentelemetry-sdk==1.30"
  grep -oE '"opentelemetry-[a-z-]+>=[^,"]+' pyproject.toml | sed 's/^"//; s/>=/==/' > "$venv/constraints.txt"
  if [ ! -s "$venv/constraints.txt" ]; then
    echo "setup-venv-lowest: no opentelemetry-* lower bounds found in pyproject.toml" >&2
    exit 1
  fi
  "$venv/bin/python" -m pip install --quiet -c "$venv/constraints.txt" -e ".[test]"
  echo "$want" > "$stamp"
fi
