#!/usr/bin/env bash
# Creates .venv (once) with torch from PyPI, otel-verl and its verl + test extras.
# Re-runs pip only when pyproject.toml changed. Downloads are cached in ~/.cache/pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=.venv/.otel-verl-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet -e ".[verl,test]"
  echo "$want" > "$stamp"
fi
