"""Running the traced demo (or the harness) in a fresh interpreter.

The demo turns tracing on in the process that runs it (wrappers on verl's classes, a
global TracerProvider) and starts its own Ray cluster; in the pytest process that state
would leak into other tests (and a cluster another test left running would be reused
without otel_verl's runtime env). A child process keeps every test independent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import json, sys
kind, args_path, out_path = sys.argv[1:4]
with open(args_path) as f:
    args = json.load(f)
if kind == "demo":
    from otel_verl.demo.traced import run_demo
    result = run_demo(**args)
elif kind == "harness_v1":  # a bare v1 harness run (verl's v1 trainer, TransferQueue)
    from otel_verl.demo.harness_v1 import run_v1
    result = run_v1(**args)
else:  # a bare harness run with a given runtime env
    from otel_verl.demo.harness import run_v0
    keep = args.pop("_report_logs_dir", False)
    result = run_v0(**args, keep_ray=keep)
    if keep:
        import ray
        result["logs_dir"] = ray._private.worker._global_node.get_logs_dir_path()
        ray.shutdown()
with open(out_path, "w") as f:
    json.dump(result, f, default=str)
"""


def run_in_child(kind: str, args: Dict[str, Any], work_dir: str, env: Dict[str, str] | None = None, timeout: float = 850) -> Dict[str, Any]:
    """``run_demo(**args)`` (kind ``demo``), ``run_v0(**args)`` (kind ``harness``) or
    ``run_v1(**args)`` (kind ``harness_v1``) in a child interpreter; returns its JSON summary (``summary['trajectories_per_step']`` keys
    become strings)."""
    os.makedirs(work_dir, exist_ok=True)
    args_path = os.path.join(work_dir, f"{kind}-args.json")
    out_path = os.path.join(work_dir, f"{kind}-summary.json")
    log_path = os.path.join(work_dir, f"{kind}.log")
    with open(args_path, "w") as f:
        json.dump(args, f)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_TRACE"))}
    child_env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
    child_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.run([sys.executable, "-c", _CHILD, kind, args_path, out_path], cwd=REPO, env=child_env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        with open(log_path, errors="replace") as f:
            raise AssertionError(f"{kind} run exited {proc.returncode}:\n{f.read()[-6000:]}")
    with open(out_path) as f:
        return json.load(f)
