"""Outages during a flood of spans: what is produced is written, or counted where it was lost.

Each case runs a fresh interpreter that drives training steps through the real events
API (``fault_workload.emit``, new uids each step) for some seconds, then compares what
it produced (``fault_workload.expected`` per step) with what the files hold and what the
counters say (``otel_verl.health``, each process's loss file, the ``otel_verl.dropped``
metric in the OTLP-JSON metric files, ``otel-verl report --json``):

- a collector that refuses (HTTP 503) or never answers, with the outputs written by an
  export process (``OTEL_VERL_OFFLOAD=1``) or in the traced process, ended by a graceful
  shutdown or by SIGKILL (as Ray ends an actor at the end of a run): no legacy line is
  lost, and every span OTLP could not deliver is counted;
- an export process that hangs (SIGSTOP) while the traced process floods: memory stays
  bounded, drops are counted as they happen, tracing goes on, the shutdown kills it;
- a disk that never drains, the outputs in-process: the same, per output;
- after an outage and after SIGTERM, the metric files, the loss files and the report
  agree with the process's own totals.

The flood is paced below what an export process sustains on a loaded 2-core machine:
one unpaced would lose spans by design (counted, ``dropped["offload"]``), which is the
hung export process's case, not the collector's.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, Dict, List

import pytest

import fault_workload as w

UIDS, TRAJS = 4, 2  # per step
PACE_S = 0.05  # one step every 50 ms: about 1000 spans a second
TIMEOUT_S = 2  # OTEL_EXPORTER_OTLP_TIMEOUT
SHUTDOWN_S = 6  # OTEL_VERL_SHUTDOWN_TIMEOUT_S: a silent collector holds a shutdown that long
LONG_S, SHORT_S = 20.0, 4.0  # flood lengths
IDLE_BEFORE_KILL_S = 1.5
RSS_BOUND_MB = 256

# The traced process. Options (JSON in argv[1]): seconds, pace_s (0: as fast as it goes),
# result (a path), end ("shutdown" or "idle": wait to be killed), stop_export_at (a step:
# flush, then SIGSTOP the export process), block_disk (every file write blocks forever),
# until_dropping (outputs: flood until each of them drops, then for `seconds` more).
FLOOD = """
    import json, os, signal, sys, threading, time
    opts = json.loads(sys.argv[1])
    if opts.get("block_disk"):
        from otel_verl.exporters import _writer
        # before any output imports it: a disk that never drains
        _writer.append_whole = lambda fd, data: threading.Event().wait()
    import otel_verl, fault_workload as w
    from otel_verl import bootstrap, health

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    def export_processes():
        pids = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read()
            except OSError:
                continue
            # (no child of this process: it serves this process)
            if b"otel_verl.offload.host" in command and f"\\0--served-pid\\0{os.getpid()}\\0".encode() in command:
                pids.append(int(entry))
        return pids

    assert otel_verl.configure()
    assert bootstrap.flush(30)  # an export process answered: started, no longer the process that starts it
    counter = w.attach_counter()
    outputs = w.Outputs()  # the writers, when they run in this process
    result = {"export_pids": export_processes(), "stopped_at": None, "samples": [], "rss_start_mb": rss_mb()}
    steps, worst, t0 = 0, 0.0, time.monotonic()
    while True:
        elapsed = time.monotonic() - t0
        if opts.get("until_dropping"):  # until every one of these outputs drops, then for `seconds`
            if "full_at" not in result and set(opts["until_dropping"]) <= set(health.snapshot()["dropped"]):
                result.update(full_at=elapsed, full_at_step=steps, rss_full_mb=rss_mb())
            if elapsed - result.get("full_at", elapsed) >= opts["seconds"] or elapsed >= 90:
                break
        elif elapsed >= opts["seconds"]:
            break
        steps += 1
        if steps == opts.get("stop_export_at"):
            assert bootstrap.flush(30)  # all written and acknowledged: what follows is never written
            for pid in result["export_pids"]:
                os.kill(pid, signal.SIGSTOP)
            result.update(stopped_at=steps, spans_before_stop=counter.sampled, rss_at_stop_mb=rss_mb())
        worst = max(worst, w.emit(steps, w.new_uids(opts["uids"]), opts["trajs"], fit=steps == 1))
        if steps % 10 == 0:
            result["samples"].append({"step": steps, "rss_mb": rss_mb(),
                                      "dropped": health.snapshot()["dropped"]})
        time.sleep(max(0.0, t0 + steps * opts["pace_s"] - time.monotonic()))
    result.update(steps=steps, spans=counter.sampled, worst_emit_s=worst, flood_s=time.monotonic() - t0,
                  rss_mb=rss_mb())
    if opts["end"] == "shutdown":
        t0 = time.monotonic()
        otel_verl.shutdown()
        result["shutdown_s"] = time.monotonic() - t0
    result.update(outputs.report())  # health, and the in-process writers' counts
    with open(opts["result"] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(opts["result"] + ".tmp", opts["result"])
    if opts["end"] == "idle":
        time.sleep(600)  # until killed
"""


# --------------------------------------------------------------------------- helpers


class Flood:
    """The traced process of :data:`FLOOD`, its stdout and stderr in files (a flood's
    progress lines would fill a pipe)."""

    def __init__(self, tmp_path, env: Dict[str, str], **opts: Any) -> None:
        self.trace = tmp_path / "trace"
        self.result_path = tmp_path / "result.json"
        self.stdout, self.stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        opts = {"uids": UIDS, "trajs": TRAJS, "pace_s": PACE_S, "end": "shutdown", **opts,
                "result": str(self.result_path)}
        env = {"VERL_TRACE_DIR": str(self.trace), "OTEL_VERL_SHUTDOWN_TIMEOUT_S": str(SHUTDOWN_S), **env}
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FLOOD), json.dumps(opts)],
                                         env=w.clean_env(env), stdout=out, stderr=err)

    def wait_result(self, timeout: float) -> Dict[str, Any]:
        """The result file, once the flood (and the shutdown, if any) is over."""
        deadline = time.monotonic() + timeout
        while not self.result_path.exists():
            assert self.proc.poll() is None, f"rc={self.proc.returncode}\n{self.stderr.read_text()[-6000:]}"
            assert time.monotonic() < deadline, "the flood did not end in time"
            time.sleep(0.1)
        return json.loads(self.result_path.read_text())

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def produced(result: Dict[str, Any], steps: int | None = None) -> Dict[str, int]:
    """What the first ``steps`` steps of a flood produced (all of them by default)."""
    steps = result["steps"] if steps is None else steps
    out = {key: 0 for key in w.expected(1, 1)}
    for step in range(1, steps + 1):
        for key, n in w.expected(UIDS, TRAJS, fit=step == 1).items():
            out[key] += n
    return out


def assert_files_hold(trace, expect: Dict[str, int]) -> None:
    """The legacy files and the OTLP-JSON span files hold exactly what was produced,
    whole lines only."""
    lines = w.file_lines(str(trace))
    assert len(lines["csv"]) == expect["csv_rows"]
    assert len(lines["progress"]) == expect["progress_lines"]
    tasks = [line for line in lines["progress"] if line.startswith("Task ") and "is completed" in line]
    assert len(tasks) == len(lines["jsonl"]) == expect["jsonl_lines"]
    assert len(w.otlp_spans(lines["otlp"])) == expect["spans"]


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pids: List[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"export process(es) {pids} still running"
        time.sleep(0.1)


def loss_files(trace) -> List[Dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted((trace / "losses").glob("*.json"))]


def loss_file_dropped(trace) -> Dict[str, int]:
    total: Dict[str, int] = {}
    for loss in loss_files(trace):
        for name, n in loss["dropped"].items():
            total[name] = total.get(name, 0) + n
    return total


def report_losses(trace) -> Dict[str, Dict[str, int]]:
    """``otel-verl report DIR --json``'s loss counters (the console script beside this
    interpreter, as a user runs it)."""
    command = os.path.join(os.path.dirname(sys.executable), "otel-verl")
    if not os.path.exists(command):
        command = shutil.which("otel-verl")
    assert command, "no otel-verl console script (pip install -e .)"
    proc = subprocess.run([command, "report", str(trace), "--json"], env=w.clean_env({}), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)["losses"]["recorded"]


def report_dropped(trace) -> Dict[str, int]:
    return report_losses(trace)["dropped"]


def metric_dropped(trace) -> Dict[str, int]:
    """The ``otel_verl.dropped`` metric of the OTLP-JSON metric files: each process's
    latest point per output (the counter is cumulative), summed over processes."""
    latest: Dict[tuple, tuple] = {}
    for path in sorted((trace / "otlp-metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            for rm in json.loads(line)["resourceMetrics"]:
                process = json.dumps(rm.get("resource", {}).get("attributes"), sort_keys=True)
                for sm in rm.get("scopeMetrics", []):
                    for metric in sm.get("metrics", []):
                        if metric["name"] != "otel_verl.dropped":
                            continue
                        for point in metric["sum"]["dataPoints"]:
                            attributes = {a["key"]: a["value"]["stringValue"] for a in point["attributes"]}
                            key, stamp = (process, attributes["otel_verl.output"]), int(point["timeUnixNano"])
                            if key not in latest or stamp >= latest[key][0]:
                                latest[key] = (stamp, int(point["asInt"]))
    total: Dict[str, int] = {}
    for (_, output), (_, value) in latest.items():
        total[output] = total.get(output, 0) + value
    return total


def otlp_env(port: int, offload: str) -> Dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TIMEOUT": str(TIMEOUT_S),
        "OTEL_VERL_OFFLOAD": offload,
        # spans (and metrics) in files beside OTLP: what the files got is checked span by
        # span, and the report reads a trace dir only with its otlp/ files
        "OTEL_VERL_OTLP_FILE": "1",
    }


# --------------------------------------------------------------------------- a collector down during a flood

# The 20 s flood for the two cases that stress the most (the export process
# outliving its killed worker; a shutdown held by a collector that never answers); the
# others are the same code paths with less time at stake, so a shorter flood.
COLLECTOR_CASES = [
    pytest.param("http503", "1", "kill", LONG_S, id="503-offload-sigkill"),
    pytest.param("silent", "1", "shutdown", LONG_S, id="silent-offload-shutdown"),
    pytest.param("http503", "1", "shutdown", SHORT_S, id="503-offload-shutdown"),
    pytest.param("silent", "1", "kill", SHORT_S, id="silent-offload-sigkill"),
    pytest.param("http503", "0", "shutdown", SHORT_S, id="503-inprocess-shutdown"),
    pytest.param("silent", "0", "shutdown", SHORT_S, id="silent-inprocess-shutdown"),
]


@pytest.mark.e2e
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode, offload, end, seconds", COLLECTOR_CASES)
def test_a_collector_down_during_a_flood_loses_no_legacy_line_and_counts_every_otlp_span(
        tmp_path, mode, offload, end, seconds):
    """Not one span reaches the collector: every one is counted under ``otlp``, and the
    files (legacy and OTLP-JSON) hold all that was produced."""
    with w.fault_server(mode) as port:
        flood = Flood(tmp_path, otlp_env(port, offload), seconds=seconds, end="idle" if end == "kill" else "shutdown")
        try:
            result = flood.wait_result(seconds + SHUTDOWN_S + 60)
            if end == "kill":
                # idle a moment, then killed as Ray ends an actor at the end of a run; its
                # export process (its own session) finishes the outputs and exits
                time.sleep(IDLE_BEFORE_KILL_S)
                flood.proc.send_signal(signal.SIGKILL)
                assert flood.wait_exit(10) == -signal.SIGKILL
                wait_gone(result["export_pids"], SHUTDOWN_S + 30)
            else:
                assert flood.wait_exit(30) == 0, flood.stderr.read_text()[-4000:]
        finally:
            flood.kill()
    expect = produced(result)
    assert result["spans"] == expect["spans"]
    assert len(result["export_pids"]) == (offload == "1")
    assert result["worst_emit_s"] < 0.5 * TIMEOUT_S  # the training side never waits for the collector
    assert_files_hold(flood.trace, expect)  # not one legacy line lost
    # none reached the collector, and every one is counted: in each process's loss file
    # (final: written at the end of the shutdown), by the report, and in-process by health
    losses = loss_files(flood.trace)
    assert [loss["final"] for loss in losses] == [True]
    assert loss_file_dropped(flood.trace) == {"otlp": expect["spans"]}
    assert report_dropped(flood.trace) == {"otlp": expect["spans"]}
    if end == "shutdown":
        assert result["health"]["dropped"] == {"otlp": expect["spans"]}
        assert result["shutdown_s"] < SHUTDOWN_S + 1.5


# --------------------------------------------------------------------------- an export process that hangs


@pytest.mark.timeout(120)
def test_a_hung_export_process_costs_bounded_memory_and_every_span_is_written_or_counted(tmp_path):
    """SIGSTOP the export process right after a flush (all it got is written), then flood
    as fast as the process goes: what follows is never written, so every span of it must
    be counted, while it happens; the queue's bound holds the memory."""
    # as fast as it goes until the queue (the default bound) is full and drops, then 2 s more
    flood = Flood(tmp_path, {"OTEL_VERL_OFFLOAD": "1", "OTEL_VERL_SHUTDOWN_TIMEOUT_S": "3"}, seconds=2, pace_s=0,
                  stop_export_at=20, until_dropping=["offload"])
    try:
        result = flood.wait_result(90)
        assert flood.wait_exit(30) == 0, flood.stderr.read_text()[-4000:]
    finally:
        flood.kill()
    stopped_at, (export_pid,) = result["stopped_at"], result["export_pids"]
    after_stop = [sample for sample in result["samples"] if sample["step"] >= stopped_at]
    assert stopped_at and result["steps"] > 10 * stopped_at  # tracing went on, at speed
    assert result["worst_emit_s"] < 0.5
    growth = max(sample["rss_mb"] for sample in after_stop) - result["rss_at_stop_mb"]
    assert growth < RSS_BOUND_MB, growth
    # counted as it happened: the count rose step after step during the flood
    counted = [sample["dropped"].get("offload", 0) for sample in after_stop]
    assert len({n for n in counted if n > 0}) >= 3, counted
    # the shutdown kept its deadline and killed the export process
    assert result["shutdown_s"] < 3 + 1.5
    assert gone(export_pid)
    # written + counted == produced: the steps before the stop are in the files, every
    # span after it is counted, and nothing else is
    before_stop = produced(result, stopped_at - 1)
    assert before_stop["spans"] == result["spans_before_stop"]
    assert_files_hold(flood.trace, before_stop)
    assert result["health"]["dropped"] == {"offload": result["spans"] - result["spans_before_stop"]}
    # the export process never wrote those counts: the traced process wrote its loss file
    assert [loss["final"] for loss in loss_files(flood.trace)] == [True]
    assert loss_file_dropped(flood.trace) == report_dropped(flood.trace) == result["health"]["dropped"]


# --------------------------------------------------------------------------- a disk that never drains

FILE_OUTPUTS = ("sample_csv", "progress_log", "trajectory_jsonl", "otlp_json_file")


@pytest.mark.timeout(150)
def test_a_disk_that_never_drains_costs_bounded_memory_and_every_line_is_counted(tmp_path):
    """Every file write blocks forever, the outputs in-process: the flood goes on until
    every output's queue is full, and some seconds more. (A small queue bound, so that
    all of them fill within the test; what one full queue costs at the default bound is
    the next test's.)"""
    env = {"OTEL_VERL_OFFLOAD": "0", "OTEL_VERL_MAX_QUEUE_MB": "1", "OTEL_VERL_SHUTDOWN_TIMEOUT_S": "3"}
    flood = Flood(tmp_path, env, seconds=2, pace_s=0, block_disk=True, until_dropping=FILE_OUTPUTS)
    try:
        result = flood.wait_result(150)
        assert flood.wait_exit(30) == 0, flood.stderr.read_text()[-4000:]
    finally:
        flood.kill()
    assert "full_at" in result, result["health"]  # every queue did fill
    assert result["worst_emit_s"] < 0.5  # tracing went on, at speed
    assert max(sample["rss_mb"] for sample in result["samples"]) - result["rss_start_mb"] < RSS_BOUND_MB
    assert result["rss_mb"] - result["rss_full_mb"] < 8  # full queues: the memory stays where it is
    # counted as it happened: each output's count rose during the flood
    full = [sample["dropped"] for sample in result["samples"] if sample["step"] >= result["full_at_step"]]
    for output in FILE_OUTPUTS:
        assert full[0][output] < full[-1][output] < result["health"]["dropped"][output], output
    assert result["shutdown_s"] < 3 + 1.5  # a write that never returns holds no shutdown
    # written + counted == produced, per output (nothing was written)
    expect = produced(result)
    for output, key in (("sample_csv", "csv_rows"), ("progress_log", "progress_lines"),
                        ("trajectory_jsonl", "jsonl_lines")):
        counts = result["writers"][output]
        assert counts["written"] + counts["dropped"] == expect[key], output
        assert counts["dropped"] == result["health"]["dropped"][output], output
    assert result["exported"]["otlp_json_file"] + result["health"]["dropped"]["otlp_json_file"] == expect["spans"]
    # the loss file is no line-by-line write: it says so too
    assert [loss["final"] for loss in loss_files(flood.trace)] == [True]
    assert loss_file_dropped(flood.trace) == result["health"]["dropped"]


FULL_QUEUE = """
    import json, threading
    from otel_verl.exporters import _writer
    _writer.append_whole = lambda fd, data: threading.Event().wait()  # a disk that never drains

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    writer = _writer.BackgroundWriter("progress_log")  # the default bound (OTEL_VERL_MAX_QUEUE_MB)
    before, jobs = rss_mb(), 0
    # one job per line, as the progress log queues a trajectory's "Task ... is completed" line
    line = "Task {:036d}/1 is completed, score=1.0 status=Finished\\n"  # 84 bytes
    while writer.write("/nonexistent/progress.log", line.format(jobs), 1):
        jobs += 1
    print(json.dumps({"bound_mb": writer.max_pending_bytes / 2**20, "jobs": jobs, "grew_mb": rss_mb() - before}))
"""


@pytest.mark.timeout(60)
def test_a_full_writer_queue_holds_about_its_bound_in_memory():
    """Four queues (three legacy files, the OTLP-JSON spans) at the default bound must stay
    well under the memory a flood with a disk that never drains may cost (256 MB)."""
    result = json.loads(w.run_python(FULL_QUEUE, {}).stdout.splitlines()[-1])
    assert result["grew_mb"] < 2 * result["bound_mb"], result


# --------------------------------------------------------------------------- the loss figures agree

AT_SHUTDOWN = re.compile(r"^otel_verl: at shutdown: dropped=(\{.*?\}) failures=", re.MULTILINE)


def assert_loss_figures_agree(trace, dropped: Dict[str, int]) -> None:
    """The metric files, the loss files and the report say what health said: ``dropped``."""
    assert dropped.get("otlp", 0) > 0  # the outage did cost spans
    assert metric_dropped(trace) == dropped
    assert [loss["final"] for loss in loss_files(trace)] == [True]
    assert loss_file_dropped(trace) == dropped
    assert report_dropped(trace) == dropped  # read from the loss files
    # without them (a run of an older otel_verl), the report reads the metric files
    metrics_only = trace.parent / "metrics-only"
    shutil.copytree(trace, metrics_only, ignore=shutil.ignore_patterns("losses"))
    assert report_dropped(metrics_only) == dropped


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offload", ["0", "1"])
def test_the_loss_figures_agree_with_health_after_an_outage(tmp_path, offload):
    with w.fault_server("http503") as port:
        flood = Flood(tmp_path, {**otlp_env(port, offload), "OTEL_VERL_SHUTDOWN_TIMEOUT_S": "3"}, seconds=2)
        try:
            result = flood.wait_result(60)
            assert flood.wait_exit(30) == 0, flood.stderr.read_text()[-4000:]
        finally:
            flood.kill()
    assert_loss_figures_agree(flood.trace, result["health"]["dropped"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offload", ["0", "1"])
def test_the_loss_figures_agree_with_health_after_sigterm_during_a_flood(tmp_path, offload):
    """SIGTERM while spans keep ending: the shutdown runs on a thread of its own, the
    process dies of SIGTERM, and its totals (logged at shutdown) are those of its files."""
    with w.fault_server("http503") as port:
        flood = Flood(tmp_path, {**otlp_env(port, offload), "OTEL_VERL_SHUTDOWN_TIMEOUT_S": "3"}, seconds=60)
        try:
            deadline = time.monotonic() + 60
            while flood.stdout.read_text().count(" is completed, ") < 50:  # a second of steps
                assert flood.proc.poll() is None and time.monotonic() < deadline, flood.stderr.read_text()[-4000:]
                time.sleep(0.1)
            flood.proc.send_signal(signal.SIGTERM)
            assert flood.wait_exit(30) == -signal.SIGTERM, flood.stderr.read_text()[-4000:]
        finally:
            flood.kill()
    logged = AT_SHUTDOWN.search(flood.stderr.read_text())
    assert logged, flood.stderr.read_text()[-4000:]
    assert_loss_figures_agree(flood.trace, ast.literal_eval(logged.group(1)))


# --------------------------------------------------------------------------- a whole demo run

DEMO_STEPS, DEMO_PROMPTS, DEMO_N = 2, 8, 4


@pytest.mark.verl
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["http503", "silent"])
def test_a_demo_run_against_a_collector_that_is_down_writes_every_legacy_line(tmp_path, mode):
    """The traced CPU demo (real verl on Ray: trainer, rollout workers with their export
    processes, LLM servers, reward workers) sending OTLP to a collector that refuses or
    never answers, with otel_verl's defaults: every trajectory's JSONL line, CSV rows and
    Task line are written, and what OTLP lost is counted in the loss files and the report."""
    from demo_checks import csv_rows, jsonl_lines, progress_lines
    from demo_process import run_in_child

    trace = tmp_path / "trace"
    with w.fault_server(mode) as port:
        summary = run_in_child("demo", {"trace_dir": str(trace), "steps": DEMO_STEPS, "prompts": DEMO_PROMPTS,
                                        "n": DEMO_N, "agent": "tool"}, str(tmp_path / "run"),
                               env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                    "OTEL_VERL_OTLP_FILE": "1"})  # the spans produced, to account for
        wait_for_export_processes_of(trace)  # they finish the rollout workers' outputs after Ray ended them
    assert summary["steps_run"] == DEMO_STEPS
    trajectories = DEMO_STEPS * DEMO_PROMPTS * DEMO_N
    assert len(jsonl_lines(str(trace))) == trajectories
    rows = csv_rows(str(trace))
    for detail in ("agent_task_started", "agent_run_completed"):
        assert sum(r["fields"]["detail"] == detail for r in rows) == trajectories, detail
    assert sum(line.startswith("Task ") for line in progress_lines(str(trace))) == trajectories
    # OTLP delivered nothing: the spans the run produced (the OTLP-JSON files hold them) are
    # counted lost, as dropped, or as still held by a process Ray ended without its shutdown,
    # all but those that ended after the process's last loss-file write (Ray ends the
    # trainer right after fit, so its last spans may go uncounted)
    produced = len(w.otlp_spans(w.file_lines(str(trace))["otlp"]))
    dropped = loss_file_dropped(trace)
    unsent = loss_file_unsent(trace)
    assert set(dropped) <= {"otlp"} and set(unsent) <= {"otlp", "otlp_json_file"}  # no legacy line lost
    assert 0 < dropped.get("otlp", 0) + unsent.get("otlp", 0) <= produced
    recorded = report_losses(trace)  # the report reads the trace dir, spans or not
    assert recorded["dropped"] == dropped and recorded.get("unsent", {}) == unsent


def loss_file_unsent(trace) -> Dict[str, int]:
    """What the outputs of processes that did not shut down still held at their last write."""
    total: Dict[str, int] = {}
    for loss in loss_files(trace):
        if not loss["final"]:
            for name, n in loss.get("pending", {}).items():
                total[name] = total.get(name, 0) + n
    return total


def wait_for_export_processes_of(trace, timeout_s: float = 60.0) -> None:
    """Until no export process writing into ``trace`` runs (their outputs are finished)."""
    deadline = time.monotonic() + timeout_s
    marker = f"VERL_TRACE_DIR={trace}".encode()
    while time.monotonic() < deadline:
        running = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"otel_verl.offload.host" not in f.read():
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    running = running or marker in f.read().split(b"\0")
            except OSError:
                continue
        if not running:
            return
        time.sleep(0.5)
    raise AssertionError(f"export processes of {trace} still running after {timeout_s} s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offload", ["0", "1"])
def test_the_metric_files_say_what_health_says_while_a_collector_hangs(tmp_path, offload):
    """A collector that never answers holds each OTLP metric export (and its retries) for
    the whole export timeout; collected every 200 ms, one is always in flight. The metric
    files' collections, the last one included, do not wait for it."""
    with w.fault_server("silent") as port:
        env = {**otlp_env(port, offload), "OTEL_VERL_SHUTDOWN_TIMEOUT_S": "3", "OTEL_METRIC_EXPORT_INTERVAL": "200",
               "OTEL_METRIC_EXPORT_TIMEOUT": "30000"}
        flood = Flood(tmp_path, env, seconds=3)
        try:
            result = flood.wait_result(60)
            assert flood.wait_exit(30) == 0, flood.stderr.read_text()[-4000:]
        finally:
            flood.kill()
    assert_loss_figures_agree(flood.trace, result["health"]["dropped"])
