#!/usr/bin/env bash
# Makes sure Prometheus is installed for tests/test_dashboard_prometheus.py (which runs the
# shipped Grafana dashboard's queries on it) and prints its path. Debian's `prometheus`
# package puts it at /usr/bin/prometheus; when missing, it is installed with apt-get if
# this user may (root, or sudo without a password). The tests start their own Prometheus
# on free loopback ports, so the package's service is not wanted.
set -euo pipefail
bin=/usr/bin/prometheus
if [ ! -x "$bin" ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-prometheus: $bin missing and no apt-get to install Debian's prometheus package" >&2
    exit 1
  fi
  if [ "$(id -u)" -eq 0 ]; then
    as_root=""
  elif sudo -n true 2>/dev/null; then
    as_root="sudo -n"
  else
    echo "setup-prometheus: $bin missing; installing it needs root: apt-get install prometheus" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # a fresh container has no package lists yet
  $as_root apt-get install -y --no-install-recommends prometheus \
    || { $as_root apt-get update && $as_root apt-get install -y --no-install-recommends prometheus; }
  # where systemd runs, the package starts its service on :9090 (in a container
  # policy-rc.d keeps it from starting)
  if [ -d /run/systemd/system ]; then
    $as_root systemctl disable --now prometheus.service || true
  fi
fi
"$bin" --version >&2
echo "$bin"
