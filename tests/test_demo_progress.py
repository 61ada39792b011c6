"""The demo's progress lines (otel_verl.demo.progress): the harness's phases from its file,
each finished step from verl's metrics file, a heartbeat while a phase is silent. No Ray,
no verl: the files are written here as the harness and verl's file logger write them."""

from __future__ import annotations

import io
import json
import os
import time

from otel_verl.demo.progress import ProgressReporter, note_phase


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _step_line(step):
    return json.dumps({"step": step, "data": {"training/global_step": step, "actor/pg_loss": 0.1}}) + "\n"


def test_phases_steps_and_a_heartbeat(tmp_path):
    phases, metrics = str(tmp_path / "phases.jsonl"), str(tmp_path / "metrics.jsonl")
    out = io.StringIO()
    with ProgressReporter(phases, metrics, total_steps=2, stream=out, heartbeat_s=0.3) as reporter:
        reporter.phase("switching tracing on")
        note_phase(phases, "starting the workers")
        assert _wait_for(lambda: "starting the workers" in out.getvalue())
        assert _wait_for(lambda: "... still starting the workers" in out.getvalue())  # silent for a while
        note_phase(phases, "training: step 1 of 2")
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": 1, "data": {"val-core/acc": 1.0}}) + "\n")  # no training step
            f.write(_step_line(1))
        assert _wait_for(lambda: "step 1 of 2 done; training: step 2 of 2" in out.getvalue())
        with open(metrics, "a") as f:
            f.write(_step_line(2))
    lines = out.getvalue().splitlines()
    assert all(line.startswith("[demo ") for line in lines)
    said = [line.split("] ", 1)[1] for line in lines if "... still" not in line]
    assert said == ["switching tracing on", "starting the workers", "training: step 1 of 2",
                    "step 1 of 2 done; training: step 2 of 2", "step 2 of 2 done"]


def test_files_a_previous_run_left_are_not_this_runs(tmp_path):
    phases, metrics = str(tmp_path / "phases.jsonl"), str(tmp_path / "metrics.jsonl")
    note_phase(phases, "an old run's phase")
    with open(metrics, "w") as f:
        f.write(_step_line(1))
    old = time.time() - 3600
    for path in (phases, metrics):
        os.utime(path, (old, old))
    out = io.StringIO()
    with ProgressReporter(phases, metrics, total_steps=2, stream=out):
        time.sleep(0.8)
    assert out.getvalue() == ""


def test_a_closed_stream_or_an_unwritable_phase_file_does_not_stop_the_run(tmp_path):
    note_phase(str(tmp_path / "no such dir" / "phases.jsonl"), "lost, quietly")
    note_phase(None, "no file")
    out = io.StringIO()
    reporter = ProgressReporter(str(tmp_path / "p"), str(tmp_path / "m"), total_steps=1, stream=out)
    with reporter:
        out.close()
        reporter.phase("nobody reads this")


def test_a_step_that_finished_before_a_later_phase_is_told_before_it(tmp_path):
    phases, metrics = str(tmp_path / "phases.jsonl"), str(tmp_path / "metrics.jsonl")
    out = io.StringIO()
    with ProgressReporter(phases, metrics, total_steps=1, stream=out, heartbeat_s=60):
        time.sleep(0.05)
        note_phase(phases, "training: step 1 of 1")
        with open(metrics, "w") as f:
            f.write(_step_line(1))
        note_phase(phases, "training done; stopping the workers")  # both seen in one poll
    said = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert said == ["training: step 1 of 1", "step 1 of 1 done", "training done; stopping the workers"]
