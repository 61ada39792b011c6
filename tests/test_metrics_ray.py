"""The metric files of Ray actors that Ray ends without their shutdown, as it ends its actors
at the end of a run (``ray.kill``): their ``otel_verl.dropped`` says what their loss files
say. A reward actor writes its outputs itself and dies with its last collection; a rollout
worker's export process outlives it and collects a last time as it exits.

Each case runs one job on a Ray cluster of its own, from a driver in a fresh interpreter,
against a collector that refuses every request (every span is counted lost).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time
from typing import Dict, List

import pytest

import fault_workload as w
from otel_verl.exporters.metrics import DROPPED
from otel_verl.tools.report.inputs import read_counters

pytestmark = [pytest.mark.verl, pytest.mark.e2e]

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
SPANS = w.expected(2, 2)["spans"] + w.expected(2, 2, fit=False)["spans"]

# The actor traces two steps, waits until its loss file counts every span lost (the
# collector refuses them all), then idles a while before Ray kills it: longer than the
# loss file's second and the metrics' spacing of collections while losses go on (5 s).
_JOB = """
    import glob, json, os, time, ray
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=os.environ["RAY_TEMP_DIR"])

    @ray.remote(num_cpus=0)
    class Traced:
        def trace(self, role):
            import otel_verl, fault_workload as w

            assert otel_verl.configure(role=role)
            for step in (1, 2):
                w.emit(step, w.new_uids(2), 2, fit=step == 1)

            def counted():
                total = 0
                for path in glob.glob(os.path.join(os.environ["VERL_TRACE_DIR"], "losses", "*.json")):
                    try:
                        with open(path) as f:
                            total += json.load(f)["dropped"].get("otlp", 0)
                    except (OSError, ValueError):
                        pass
                return total

            deadline = time.monotonic() + 90
            while counted() < SPANS and time.monotonic() < deadline:
                time.sleep(0.1)
            return os.getpid()

    actor = Traced.remote()
    pid = ray.get(actor.trace.remote(os.environ["ROLE"]))
    time.sleep(7)
    ray.kill(actor)  # no shutdown
    print("WORKER", pid, flush=True)
    ray.shutdown()
""".replace("SPANS", str(SPANS))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _export_processes_of(pid: int) -> List[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read()
        except OSError:
            continue
        if b"otel_verl.offload.host" in args and f"\0{pid}\0".encode() in args:
            found.append(int(entry))
    return found


def _loss_file_dropped(trace) -> Dict[str, int]:
    total: Dict[str, int] = {}
    for path in glob.glob(os.path.join(str(trace), "losses", "*.json")):
        with open(path, encoding="utf-8") as f:
            for name, n in json.load(f)["dropped"].items():
                total[name] = total.get(name, 0) + n
    return total


@pytest.mark.timeout(300)
@pytest.mark.parametrize("role", ["reward_worker", "agent_loop_worker"])
def test_an_actor_ray_kills_leaves_its_losses_in_its_metric_files(tmp_path, role):
    trace = tmp_path / "trace"
    ray_temp = tempfile.mkdtemp(prefix="otel-verl-ray-", dir="/tmp")  # short: Ray's socket paths
    try:
        with w.fault_server("http503") as port:
            env = {**RAY_ENV, "RAY_TEMP_DIR": ray_temp, "ROLE": role, "VERL_TRACE_DIR": str(trace),
                   "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
                   "OTEL_VERL_OTLP_FILE": "1", "OTEL_VERL_SHUTDOWN_TIMEOUT_S": "4"}
            driver = w.run_python(_JOB, env, timeout=240)
            worker = int(next(line for line in driver.stdout.splitlines() if line.startswith("WORKER ")).split()[1])
            deadline = time.monotonic() + 30
            while (_alive(worker) or _export_processes_of(worker)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(worker) and not _export_processes_of(worker)
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)
    assert _loss_file_dropped(trace) == {"otlp": SPANS}
    counters, processes = read_counters(sorted(glob.glob(str(trace / "otlp-metrics" / "*.jsonl"))), (DROPPED,))
    assert processes == 1 and counters[DROPPED] == {("otlp",): SPANS}
