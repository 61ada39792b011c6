#!/usr/bin/env bash
# Creates (once) a virtual environment with MLflow, a GenAI trace viewer that takes OTLP,
# for tests/test_e2e_mlflow.py, and prints its `mlflow` command. Kept apart from .venv
# (MLflow's dependencies do not mix with verl's) under ~/.cache; pip downloads are cached.
set -euo pipefail
MLFLOW_VERSION=3.17.2
dir="${OTEL_VERL_MLFLOW_VENV:-$HOME/.cache/otel_verl/mlflow-venv}"
if [ "$(cat "$dir/.installed" 2>/dev/null)" != "$MLFLOW_VERSION" ]; then
  rm -rf "$dir"
  "${PYTHON:-python3}" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet "mlflow==$MLFLOW_VERSION"
  echo "$MLFLOW_VERSION" > "$dir/.installed"
fi
echo "$dir/bin/mlflow"
