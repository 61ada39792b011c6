"""Tracing in a job run on a real Ray cluster the way a user runs it: what Ray itself
does with otel_verl's settings and with SIGTERM.

- Credentials (OTLP exporter headers with a bearer token, an endpoint URL with a
  password) never appear in clear where a run leaves text: Ray's session logs (Ray
  writes every runtime env it sets up into them), the trace dir, the driver's output,
  ``otel-verl doctor`` and ``otel-verl overrides``. The Ray workers still export with
  them: they inherit the variables from the process that started Ray, not from the
  runtime env.
- SIGTERM to a driver that configured tracing and then called ``ray.init``, which puts
  Ray's own handlers in place: a Python one raising SystemExit, its shutdown at exit, and
  the core worker's C++ one, which aborts the process (SIGABRT) when it has not exited
  about 3 s after the signal. Every span, row and line of the spans that ended before
  the signal is in the files, the sample still open is ended and written by the
  shutdown, the loss file is final and counts whatever could not be sent (to a
  collector that never answers: every span), and the process exits, never aborts.

- A rollout worker's export process outlives the worker, which Ray ends by ``ray.kill``,
  at the job's end or by SIGTERM (Ray SIGKILLs a worker's children as it exits, and its
  process group): it writes every span it was sent, counts the ones the worker had queued
  and not sent, finishes its outputs (a final loss file) and exits by itself.

Each credentials and SIGTERM test starts one Ray cluster, from a driver in a fresh
interpreter, in a Ray temp dir of its own: only that run's session logs are searched. The
export-process tests share one cluster (``ray_cluster``), each its own job.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Dict, Iterator, List

import pytest

import fault_workload as w
from otel_verl import semconv as sc

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture
def ray_temp_dir() -> Iterator[str]:
    """A Ray temp dir for one run. Short, under /tmp: Ray puts its Unix sockets in it,
    whose paths may not pass 107 bytes (tmp_path can be longer)."""
    path = tempfile.mkdtemp(prefix="otel-verl-ray-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def otlp_receiver(tmp_path) -> Iterator[Dict[str, Any]]:
    """An OTLP/HTTP receiver answering 200 (``otlp_receivers.py``, its own process) that
    records each request's path, headers and body. Yields ``{"port", "requests"}``;
    ``requests()`` reads what it recorded."""
    capture, config = tmp_path / "received.jsonl", tmp_path / "receiver.json"
    config.write_text(json.dumps({"protocol": "http", "answers": [{"status": 200}], "capture": str(capture)}))
    proc = subprocess.Popen([sys.executable, os.path.join(w.TESTS_DIR, "otlp_receivers.py"), str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = (proc.stdout.readline() if proc.stdout else "").strip()
        assert line.startswith("PORT "), f"receiver did not start: {line!r}"

        def requests() -> List[Dict[str, Any]]:
            return [json.loads(r) for r in capture.read_text().splitlines()] if capture.exists() else []

        yield {"port": int(line.split()[1]), "requests": requests}
    finally:
        proc.kill()
        proc.wait(10)


def exported_spans(request: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The spans of one recorded OTLP/HTTP trace request, each with its process's pid."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    assert not request["headers"].get("content-encoding"), "the exporters send uncompressed by default"
    message = ExportTraceServiceRequest.FromString(bytes.fromhex(request["body_hex"]))
    spans = []
    for rs in message.resource_spans:
        pid = next((a.value.int_value for a in rs.resource.attributes if a.key == sc.PROCESS_PID), None)
        spans.extend({"name": s.name, "pid": pid} for ss in rs.scope_spans for s in ss.spans)
    return spans


def files_containing(root: str, needle: str) -> List[str]:
    """Every regular file under ``root`` whose bytes contain ``needle``."""
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    if needle.encode() in f.read():
                        found.append(path)
    return found


def otel_verl_cli(*args: str, env: Dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "otel_verl.tools.cli", *args], env=w.clean_env({**RAY_ENV, **env}),
                          capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- credentials

# The user's script, run as `otel-verl run -- python job.py`: the launcher's ray.init
# patch gives Ray otel_verl's runtime env. An actor traces one training step to the
# OTLP endpoint and says what its process got, and from where.
_JOB = """
    import json, os, ray
    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=os.environ["RAY_TEMP_DIR"])

    @ray.remote(num_cpus=0)
    class Trainer:
        def step(self):
            import otel_verl, fault_workload as w
            from otel_verl import activation

            assert otel_verl.configure(role="trainer")
            w.emit(1, ["u-1"], 2)
            otel_verl.shutdown()  # every span exported before the job ends
            runtime_env = ray.get_runtime_context().runtime_env.get("env_vars", {})
            return {"pid": os.getpid(), "active": activation.is_active(), "runtime_env": sorted(runtime_env),
                    "environ": sorted(k for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP"))}

    print("WORKER " + json.dumps(ray.get(Trainer.remote().step.remote())), flush=True)
    ray.shutdown()
"""


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_credentials_stay_out_of_ray_logs_files_and_cli_output_and_workers_still_export_with_them(
        tmp_path, ray_temp_dir):
    token, password = f"tok{secrets.token_hex(12)}", f"pw{secrets.token_hex(12)}"  # hex: no escaping changes them
    trace, job = tmp_path / "trace", tmp_path / "job.py"
    job.write_text(textwrap.dedent(_JOB))
    with otlp_receiver(tmp_path) as receiver:
        port = receiver["port"]
        traces_endpoint = f"http://127.0.0.1:{port}/v1/traces"
        env = {
            "VERL_TRACE_DIR": str(trace),
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer {token}",
            # the password's endpoint takes what has no endpoint of its own (the metrics); the
            # spans go to a plain one, where the bearer header is the only credential (an HTTP
            # client sends a URL's password as basic auth, in place of that header)
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{password}@127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces_endpoint,
            "RAY_TEMP_DIR": ray_temp_dir,
        }
        driver = otel_verl_cli("run", "--", sys.executable, str(job), env=env, timeout=240)
        assert driver.returncode == 0, f"stdout:{driver.stdout[-3000:]}\nstderr:{driver.stderr[-6000:]}"
        requests = receiver["requests"]()

    # the worker traced, with settings from the runtime env and credentials inherited
    worker = json.loads(next(line for line in driver.stdout.splitlines() if line.startswith("WORKER "))[7:])
    assert worker["active"]
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in worker["runtime_env"]
    assert not {"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_ENDPOINT"} & set(worker["runtime_env"])
    assert {"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= set(worker["environ"])
    # ... and its spans reached the receiver with the bearer token
    trace_requests = [r for r in requests if r["path"] == "/v1/traces"]
    assert trace_requests
    assert {r["headers"].get("authorization") for r in trace_requests} == {f"Bearer {token}"}
    spans = [s for r in trace_requests for s in exported_spans(r)]
    assert len(spans) == w.expected(1, 2)["spans"]
    assert {s["pid"] for s in spans} == {worker["pid"]}

    # Ray logs the runtime env it sets up where we look: a forwarded value is there
    assert files_containing(ray_temp_dir, traces_endpoint), "no runtime env in Ray's logs: the search below proves nothing"
    for name, secret in (("token", token), ("password", password)):
        assert not files_containing(ray_temp_dir, secret), f"the {name} is in Ray's session logs"
        assert not files_containing(str(trace), secret), f"the {name} is in the trace dir"
        assert secret not in driver.stdout + driver.stderr, f"the {name} is in the driver's output"

    # The CLI with the job's settings. The collector is gone now: doctor prints the endpoint
    # in its fix. Without the plain traces endpoint the one with the password is what it checks.
    doctor_env = {k: v for k, v in env.items() if k != "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}
    doctor = otel_verl_cli("doctor", "--no-hooks", "--timeout", "1", env=doctor_env)
    assert f"127.0.0.1:{port}" in doctor.stdout, doctor.stdout[-3000:] + doctor.stderr[-3000:]
    overrides = otel_verl_cli("overrides", env=env)
    assert overrides.returncode == 0, overrides.stderr[-3000:]
    assert f"env_vars.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT={traces_endpoint}" in overrides.stdout
    for variable in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        assert f"env_vars.{variable}=" not in overrides.stdout
    for name, secret in (("token", token), ("password", password)):
        assert secret not in doctor.stdout + doctor.stderr, f"the {name} is in doctor's output"
        assert secret not in overrides.stdout + overrides.stderr, f"the {name} is in the overrides' output"


# --------------------------------------------------------------------------- SIGTERM

SHUTDOWN_TIMEOUT_S = 4  # longer than the few seconds Ray's C++ SIGTERM handler gives a process before it aborts

# A trainer-like driver: tracing configured (legacy files and OTLP-JSON files, written in
# this process), then ray.init. It ends a training step, opens one more sample and waits,
# in ray.get (as verl's driver waits on its TaskRunner) or in Python code.
_DRIVER = """
    import os, time
    import otel_verl, fault_workload as w
    from otel_verl import events

    assert otel_verl.configure(role="trainer")
    import ray  # after configure: Ray's shutdown at exit registers after otel_verl's, so runs first

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=os.environ["RAY_TEMP_DIR"])

    @ray.remote(num_cpus=0)
    def rollout():
        time.sleep(600)

    pending = rollout.remote()
    w.emit(1, ["u-a", "u-b"], 2)
    events.samples_created(["u-open"], step=2, trainer=w.TRAINER)  # still open at the signal
    print("EMITTED", flush=True)
    if os.environ["WAIT_IN"] == "ray.get":
        ray.get(pending)
    else:
        time.sleep(600)
"""


def loss_file_of(trace, pid: int) -> Dict[str, Any]:
    """The counters process ``pid`` left in the trace dir (``exporters/loss_file.py``)."""
    files = []
    for path in glob.glob(os.path.join(str(trace), "losses", "*.json")):
        with open(path, encoding="utf-8") as f:
            files.append(json.load(f))
    mine = [f for f in files if f["pid"] == pid]
    assert len(mine) == 1, files
    return mine[0]


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("collector, wait_in", [
    (None, "python"),
    # the shutdown then takes its whole budget: Ray's C++ handler, were it still the one
    # SIGTERM reaches, would abort the process before that
    ("silent", "ray.get"),
], ids=["files-only-waiting-in-python", "silent-collector-waiting-in-ray-get"])
def test_sigterm_to_a_ray_driver_writes_or_counts_what_ended_and_exits(tmp_path, ray_temp_dir, collector, wait_in):
    trace = tmp_path / "trace"
    env = {**RAY_ENV, "VERL_TRACE_DIR": str(trace), "OTEL_VERL_OFFLOAD": "0", "OTEL_VERL_OTLP_FILE": "1",
           "OTEL_VERL_SHUTDOWN_TIMEOUT_S": str(SHUTDOWN_TIMEOUT_S), "RAY_TEMP_DIR": ray_temp_dir, "WAIT_IN": wait_in}
    with w.fault_server(collector) if collector else contextlib.nullcontext() as port:
        if port:
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        proc = w.popen_python(_DRIVER, env)
        try:
            for line in proc.stdout:
                if line.strip() == "EMITTED":
                    break
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            time.sleep(1.5)  # the step's spans ended over a second ago
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            _, err = proc.communicate(timeout=SHUTDOWN_TIMEOUT_S + 60)
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # it exits: dies of SIGTERM or raises SystemExit (Ray's handler), never aborts
    assert proc.returncode == -signal.SIGTERM or proc.returncode >= 0, f"rc={proc.returncode}\n{err[-4000:]}"
    assert elapsed < SHUTDOWN_TIMEOUT_S + 30, elapsed  # the shutdown's budget, then Ray's own teardown
    expect = w.expected(2, 2)
    lines = w.file_lines(str(trace))  # whole lines only
    assert len(lines["csv"]) == expect["csv_rows"] + 1  # + u-open's uid_generated
    assert len(lines["progress"]) == expect["progress_lines"]
    assert len(lines["jsonl"]) == expect["jsonl_lines"]
    spans = w.otlp_spans(lines["otlp"])
    assert len(spans) == expect["spans"] + 1, err[-4000:]  # + u-open's sample span
    # the shutdown ran before the process went: it ended the open sample, and said so
    outcomes = [{a["key"]: a["value"] for a in s["attributes"]}.get(sc.SAMPLE_OUTCOME) for s in spans
                if {"key": sc.UID, "value": {"stringValue": "u-open"}} in s["attributes"]]
    assert outcomes == [{"stringValue": "unfinished_at_shutdown"}]
    # and it counted what it could not send: every span, to a collector that never answers
    losses = loss_file_of(trace, proc.pid)
    assert losses["final"], losses
    assert losses["dropped"] == ({"otlp": len(spans)} if collector else {}), losses


# --------------------------------------------------------------------------- the export process outlives its worker

EXPORT_SHUTDOWN_TIMEOUT_S = 4
N_UIDS, N_TRAJ = 3, 4


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Dict[str, str]]:
    """One local Ray cluster for the module's jobs: a process that started it holds it
    until its stdin ends. Yields the environment a driver connects with."""
    temp_dir = tempfile.mkdtemp(prefix="otel-verl-ray-", dir="/tmp")  # short: Ray's socket paths
    holder = w.popen_python("""
        import os, sys, ray
        context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                           _temp_dir=os.environ["RAY_TEMP_DIR"])
        print("ADDRESS", context.address_info["gcs_address"], flush=True)
        sys.stdin.read()
        ray.shutdown()
    """, {**RAY_ENV, "RAY_TEMP_DIR": temp_dir}, stdin=subprocess.PIPE)
    try:
        line = holder.stdout.readline().split()
        assert line[:1] == ["ADDRESS"], holder.stderr.read()[-4000:]
        yield {**RAY_ENV, "RAY_ADDRESS": line[1]}
    finally:
        holder.stdin.close()
        try:
            holder.wait(60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


# A job whose rollout worker, an async actor as verl's AgentLoopWorker (tracing configured
# on its event loop's thread, where no SIGTERM handler can be set), traces two steps,
# offloaded, into the trace dir: the first flushed (its export process runs), then, right
# after the second step's last span ended: ray.kill of the actor, the job's end (the driver
# exits), or SIGTERM to the worker.
_OUTLIVED_JOB = """
    import os, signal, sys, time, ray
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)

    @ray.remote(num_cpus=0)
    class RolloutWorker:
        async def step(self, step):
            import otel_verl, fault_workload as w

            if step == 1:
                assert otel_verl.configure(role="agent_loop_worker")
            w.emit(step, [f"u{step}-{i}" for i in range(N_UIDS)], N_TRAJ, fit=step == 1)
            if step == 1:
                assert otel_verl.flush(60)
            return os.getpid()

    env_vars = {k: v for k, v in os.environ.items() if k.startswith(("VERL_", "OTEL_"))}
    worker = RolloutWorker.options(runtime_env={"env_vars": env_vars}).remote()
    ray.get(worker.step.remote(1))
    pid = ray.get(worker.step.remote(2))
    print("WORKER", pid, flush=True)
    end = os.environ["END"]
    if end == "ray.kill":
        ray.kill(worker)
    elif end == "sigterm":
        os.kill(pid, signal.SIGTERM)
    else:  # the job ends
        sys.exit(0)
    time.sleep(600)
""".replace("N_UIDS", str(N_UIDS)).replace("N_TRAJ", str(N_TRAJ))


def export_processes_of(pid: int) -> List[int]:
    """The export processes serving process ``pid`` (started with ``--served-pid PID``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if b"otel_verl.offload.host" in args and f"--served-pid\0{pid}\0".encode() in b"\0".join(args) + b"\0":
                found.append(int(entry))
    return found


def loss_files_of(trace, pid: int) -> List[Dict[str, Any]]:
    files = []
    for path in glob.glob(os.path.join(str(trace), "losses", "*.json")):
        with open(path, encoding="utf-8") as f:
            files.append(json.load(f))
    return [f for f in files if f["pid"] == pid]


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("end, collector", [("ray.kill", None), ("job end", None), ("sigterm", None),
                                            ("sigterm", "silent")])
def test_a_workers_export_process_outlives_it_and_writes_or_counts_every_span(tmp_path, ray_cluster, end, collector):
    """Ray SIGKILLs a worker's children as the worker exits, and its process group: the
    export process, neither, writes what it was sent, counts what the worker had queued
    and not sent, finishes its outputs with a final loss file, and exits by itself."""
    trace = tmp_path / "trace"
    env = {**ray_cluster, "VERL_TRACE_DIR": str(trace), "OTEL_VERL_OFFLOAD": "1", "OTEL_VERL_OTLP_FILE": "1",
           "OTEL_VERL_SHUTDOWN_TIMEOUT_S": str(EXPORT_SHUTDOWN_TIMEOUT_S), "END": end}
    with contextlib.ExitStack() as stack:
        if collector:  # the export process's shutdown then takes its whole deadline
            port = stack.enter_context(w.fault_server(collector))
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        worker = _run_outlived_job(env)

    losses = loss_files_of(trace, worker)
    assert losses and any(f["final"] for f in losses), losses  # the export process finished its outputs
    dropped: Dict[str, int] = {}
    for f in losses:
        for name, n in f["dropped"].items():
            dropped[name] = dropped.get(name, 0) + n
    first, second = w.expected(N_UIDS, N_TRAJ), w.expected(N_UIDS, N_TRAJ, fit=False)
    produced, lines = {key: first[key] + second[key] for key in first}, w.file_lines(str(trace))
    spans = w.otlp_spans(lines["otlp"])
    assert {int(s["resource"]["process.pid"]) for s in spans} <= {worker}
    # every span written or counted, the spans the worker queued and never sent included
    assert len(spans) + dropped.get("otlp_json_file", 0) + dropped.get("offload", 0) == produced["spans"], dropped
    if end == "sigterm":  # its shutdown sent everything: written, not counted (but by a collector that never answers)
        assert {name: n for name, n in dropped.items() if name != "otlp"} == {}, dropped
    if not dropped.get("offload"):  # every span reached the export process: every row and line too
        assert len(lines["csv"]) + dropped.get("sample_csv", 0) == produced["csv_rows"]
        assert len(lines["progress"]) + dropped.get("progress_log", 0) == produced["progress_lines"]
        assert len(lines["jsonl"]) + dropped.get("trajectory_jsonl", 0) == produced["jsonl_lines"]
    else:  # the spans counted lost are the legacy files' only gap
        assert len(lines["csv"]) < produced["csv_rows"] or len(lines["progress"]) < produced["progress_lines"]


def _run_outlived_job(env: Dict[str, str]) -> int:
    """Runs the job until its worker and that worker's export process are gone; the worker's pid."""
    driver = w.popen_python(_OUTLIVED_JOB, env)
    try:
        line = driver.stdout.readline().split()
        assert line[:1] == ["WORKER"], driver.stderr.read()[-6000:]
        worker = int(line[1])
        deadline = time.monotonic() + 60
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker was not ended"
        gone_at = time.monotonic()
        while export_processes_of(worker) and time.monotonic() < gone_at + EXPORT_SHUTDOWN_TIMEOUT_S + 10:
            time.sleep(0.1)
        assert not export_processes_of(worker), "the export process did not exit by itself"
        return worker
    finally:
        driver.kill()
        driver.wait(30)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
