"""A ``worker_process_setup_hook`` that records which Ray worker processes ran it.

Used to check that a ``runtime_env`` given to the harness reaches every process of a run
(the same path a tracing layer's setup hook takes). It imports nothing heavy.

    run_v0(out, runtime_env={
        "worker_process_setup_hook": "otel_verl.demo.probe.setup_hook",
        "env_vars": {"OTEL_VERL_DEMO_PROBE_DIR": "/tmp/probe"},
    })
    # /tmp/probe/<pid>.json for every Ray worker process that started
"""

from __future__ import annotations

import json
import os
import sys
import time

PROBE_DIR_ENV = "OTEL_VERL_DEMO_PROBE_DIR"


def setup_hook() -> None:
    directory = os.environ.get(PROBE_DIR_ENV)
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "ts": time.time(), "argv": sys.argv[:3]}, f)


def recorded_pids(directory: str) -> set:
    if not os.path.isdir(directory):
        return set()
    return {int(name.split(".")[0]) for name in os.listdir(directory) if name.endswith(".json")}
