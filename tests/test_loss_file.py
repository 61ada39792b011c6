"""Each process's loss file (``exporters/loss_file.py``) and what ``otel-verl report`` reads of
the loss files of a run.

- A later process given the same pid (a restarted container, here a new pid namespace:
  the traced process is pid 1 both times) writes a file of its own: the earlier run's
  losses stay in the report.
- Written final at the shutdown, the file stays final: a flush's or the thread's later
  write keeps it so and adds what was counted since; a write that read the counters
  before the final write never lands after it.
- The report says what the files say of processes that did not shut down: killed with
  nothing unwritten, or killed holding what it lists as unsent.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import fault_workload as w
from otel_verl import health
from otel_verl.exporters.loss_file import LossFileProcessor, process_start_ticks
from store_checks import report_of


def loss_files(trace_dir) -> list:
    return [json.load(open(path, encoding="utf-8")) for path in sorted(glob.glob(os.path.join(str(trace_dir), "losses",
                                                                                                "*.json")))]


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# --------------------------------------------------------------------------- pid reuse

TRACED = """
    import os, otel_verl, fault_workload as w
    assert otel_verl.configure()
    for step in (1, 2):
        w.emit(step, w.new_uids(2), 2, fit=step == 1)
    otel_verl.shutdown()
    print("PID", os.getpid())
"""
UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]


def traced_as_pid_1(env) -> None:
    """:data:`TRACED` as the first process of a new pid namespace: pid 1 every time."""
    try:
        proc = subprocess.run([*UNSHARE, sys.executable, "-c", textwrap.dedent(TRACED)], env=w.clean_env(env),
                              capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare(1)")
    if proc.returncode != 0 and proc.stderr.startswith("unshare:"):
        pytest.skip(f"no new pid namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "PID 1" in proc.stdout.splitlines()


@pytest.mark.timeout(240)
def test_a_later_process_with_the_same_pid_keeps_the_earlier_ones_losses(tmp_path):
    """A run that lost every span to a refusing collector, then a clean run in the same
    trace dir whose process has the same pid: the report still counts the first run's."""
    trace = tmp_path / "trace"
    spans = w.expected(2, 2)["spans"] + w.expected(2, 2, fit=False)["spans"]
    with w.fault_server("http503") as port:
        traced_as_pid_1({"VERL_TRACE_DIR": str(trace), "OTEL_VERL_OFFLOAD": "0",
                         "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                         "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
                         "OTEL_VERL_SHUTDOWN_TIMEOUT_S": "4"})
    traced_as_pid_1({"VERL_TRACE_DIR": str(trace), "OTEL_VERL_OFFLOAD": "0"})
    files = loss_files(trace)
    assert [(loss["pid"], loss["final"]) for loss in files] == [(1, True), (1, True)]
    assert sorted(loss["dropped"].get("otlp", 0) for loss in files) == [0, spans]
    assert report_of([str(trace)])["losses"]["recorded"]["dropped"] == {"otlp": spans}


def test_the_report_reads_the_loss_files_of_earlier_versions_too(tmp_path):
    """Named by pid alone (otel_verl before the start time was in the name)."""
    (tmp_path / "losses").mkdir()
    for name, dropped in (("losses-h-pid7.json", 2), ("losses-h-pid7-start123.json", 3)):
        (tmp_path / "losses" / name).write_text(json.dumps({"pid": 7, "host": "h", "final": True,
                                                            "dropped": {"otlp": dropped}, "failures": {}}))
    assert report_of([str(tmp_path)])["losses"]["recorded"]["dropped"] == {"otlp": 5}


def test_the_file_is_named_after_the_process_and_its_start(tmp_path):
    processor = LossFileProcessor(str(tmp_path), interval_s=3600)
    processor.shutdown()
    start = process_start_ticks(os.getpid())
    assert start is not None  # Linux: /proc
    assert os.path.basename(processor.path).endswith(f"-pid{os.getpid()}-start{start}.json")
    assert os.path.exists(processor.path)


# --------------------------------------------------------------------------- final stays final


def test_a_write_after_the_final_one_keeps_it_final_and_adds_a_later_count(tmp_path):
    """As the export process answers a flush that came before its end on a thread of its
    own, after the shutdown wrote the file final; and an export that returned after the
    deadline counted a loss meanwhile."""
    processor = LossFileProcessor(str(tmp_path), interval_s=3600)
    processor.shutdown()
    health.record_dropped("otlp", 3, "induced by the test")
    assert processor.checkpoint()(None)
    [loss] = loss_files(tmp_path)
    assert loss["final"] is True and loss["dropped"] == {"otlp": 3}


def test_a_count_after_the_final_write_reaches_the_file_without_another_flush(tmp_path):
    processor = LossFileProcessor(str(tmp_path), interval_s=0.05)
    processor.shutdown()
    health.record_dropped("otlp", 2, "induced by the test")
    assert wait_for(lambda: loss_files(tmp_path)[0]["dropped"] == {"otlp": 2})
    assert loss_files(tmp_path)[0]["final"] is True


class _SlowToSay:
    """An output whose first ``pending()`` on the file's own thread waits for ``go``: the
    thread's write is under way, its counters read, when the shutdown comes."""

    def __init__(self):
        self.asked, self.go, self.answered = threading.Event(), threading.Event(), threading.Event()

    def pending(self):
        if threading.current_thread().name == "otel-verl-loss-file" and not self.asked.is_set():
            self.asked.set()
            self.go.wait(10)
            self.answered.set()
            return {"otlp": 5}
        return {}


def test_the_threads_write_under_way_never_lands_after_the_final_one(tmp_path):
    output = _SlowToSay()
    processor = LossFileProcessor(str(tmp_path), outputs=[output], interval_s=0.01)
    assert output.asked.wait(10)
    shutdown = threading.Thread(target=processor.shutdown)
    shutdown.start()
    time.sleep(0.2)  # the shutdown's write first, were it not held until the thread's is done
    output.go.set()
    shutdown.join(10)
    assert output.answered.wait(10)
    time.sleep(0.3)  # the thread's write, had it been left to land after the final one
    [loss] = loss_files(tmp_path)
    assert loss["final"] is True and loss["pending"] == {}


# --------------------------------------------------------------------------- the report's words


def _loss_file(directory, name, *, final, pending=None, dropped=None):
    (directory / "losses").mkdir(exist_ok=True)
    (directory / "losses" / name).write_text(json.dumps({
        "pid": 1, "host": "h", "final": final, "dropped": dropped or {}, "failures": {}, "pending": pending or {}}))


def test_the_report_says_a_killed_process_that_held_nothing_lost_nothing_it_held(tmp_path):
    """As Ray ends an LLM server or a reward actor at the end of a clean run: no shutdown,
    nothing unwritten at its last write. No "did not shut down" as if something failed."""
    _loss_file(tmp_path, "losses-h-pid1-start1.json", final=True)
    _loss_file(tmp_path, "losses-h-pid2-start1.json", final=False)
    _loss_file(tmp_path, "losses-h-pid3-start1.json", final=False)
    losses = report_of([str(tmp_path)])["losses"]
    assert losses["recorded"] == {"dropped": {}, "failures": {}}
    assert losses["note"] == (
        "dropped none; failures none (the loss files of 3 processes; 2 ended without a shutdown (killed, as Ray "
        "ends its actors at the end of a run, or still running), holding nothing unwritten at their last write, "
        "within about a second of their end)")
    assert "did not shut down" not in losses["note"]


def test_the_report_says_what_a_killed_process_still_held(tmp_path):
    _loss_file(tmp_path, "losses-h-pid1-start1.json", final=True, dropped={"otlp": 4})
    _loss_file(tmp_path, "losses-h-pid2-start1.json", final=False, pending={"otlp": 6})
    _loss_file(tmp_path, "losses-h-pid3-start1.json", final=False)
    losses = report_of([str(tmp_path)])["losses"]
    assert losses["recorded"] == {"dropped": {"otlp": 4}, "failures": {}, "unsent": {"otlp": 6}}
    assert losses["note"] == (
        "dropped otlp=4; failures none; unsent otlp=6 (the loss files of 3 processes; 2 ended without a shutdown "
        "(killed, as Ray ends its actors at the end of a run, or still running): unsent, what 1 of them still "
        "held at their last write, within about a second of their end; lost if killed)")
