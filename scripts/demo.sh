#!/usr/bin/env bash
# The main job (README): sets up .venv, then runs the traced CPU demo — real verl (v0
# trainer, agent loops with a tool, reward, sglang server code) on a local Ray cluster,
# stand-ins only for GPU parts — writing every output to ${1:-out/demo}.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip runs quietly and the first set-up takes minutes: say so first
[ -f .venv/.otel-verl-installed ] || echo "demo: setting up .venv (the first time: about 3 GB from PyPI, several minutes)" >&2
bash scripts/setup-venv.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
trace_dir=${1:-out/demo}
shift || true
exec .venv/bin/otel-verl demo --trace-dir "$trace_dir" "$@"
