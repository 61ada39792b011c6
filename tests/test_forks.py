"""The one after-fork hook (``otel_verl.forks``): what a forked child remakes."""

from __future__ import annotations

import os
import threading

import pytest

from otel_verl import forks

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _in_child(check) -> int:
    """Runs ``check()`` in a forked child; its exit status (0: it held)."""
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


class Owner:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.restarted = 0

    def _after_fork_in_child(self) -> None:
        self.restarted += 1
        if self.fail:
            raise RuntimeError("cannot restart")


def test_a_child_remakes_what_was_handed_over_and_counts_what_failed():
    from otel_verl import health

    held = threading.Lock()
    state = {"lock": held}

    @forks.in_child
    def new_lock():
        state["lock"] = threading.Lock()

    failing, working, gone = Owner(fail=True), Owner(), Owner()
    for owner in (failing, working, gone):
        forks.in_child(owner._after_fork_in_child)
    forks.forget(gone._after_fork_in_child)
    dropped = Owner()
    forks.in_child(dropped._after_fork_in_child)
    del dropped  # held weakly: nothing to restart
    ready, release = threading.Event(), threading.Event()

    def hold():  # another thread holds the lock at fork time: the child must not wait on it
        with held:
            ready.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    ready.wait(10)
    try:
        def check():
            return (state["lock"].acquire(timeout=1) and working.restarted == 1 and failing.restarted == 1
                    and gone.restarted == 0 and health.snapshot()["failures"].get("fork") == 1)

        assert _in_child(check) == 0
    finally:
        release.set()
        holder.join()
        for remake in (new_lock, failing._after_fork_in_child, working._after_fork_in_child):
            forks.forget(remake)
    assert working.restarted == 0  # the parent's own objects go on as they were


# --------------------------------------------------------------------------- children that end by os._exit

# The traced process (a worker, whose outputs are its own or, OTEL_VERL_OFFLOAD=1, an
# export process's) forks a child that traces one step and ends by os._exit: as
# multiprocessing's fork start method ends its children, or by a bare os.fork().
_FORKED_CHILD = """
    import multiprocessing, os, sys
    import otel_verl, fault_workload as w

    assert otel_verl.configure(role="worker")

    def work():
        w.emit(1, w.new_uids(4), 4, fit=False)

    if sys.argv[1] == "multiprocessing":
        child = multiprocessing.get_context("fork").Process(target=work)
        child.start()
        child.join()
        assert child.exitcode == 0, child.exitcode
        pid = child.pid
    else:
        pid = os.fork()
        if pid == 0:
            work()
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    otel_verl.shutdown()
    print("CHILD", pid)
"""
PRODUCED = {"csv": 165, "progress": 29, "jsonl": 16, "spans": 85}  # fault_workload.expected(4, 4, fit=False)


def _run_forked_child(trace, how: str, offload: str) -> int:
    import subprocess
    import sys
    import textwrap

    import fault_workload

    assert fault_workload.expected(4, 4, fit=False) == {"csv_rows": PRODUCED["csv"], "progress_lines": PRODUCED["progress"],
                                                       "jsonl_lines": PRODUCED["jsonl"], "spans": PRODUCED["spans"]}
    env = fault_workload.clean_env({"VERL_TRACE_DIR": str(trace), "OTEL_VERL_OTLP_FILE": "1", "OTEL_VERL_OFFLOAD": offload})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FORKED_CHILD), how], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return int(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("CHILD ")))


def _final_loss_file(trace, pid: int, wait_s: float = 0.0) -> dict:
    """The final loss file of process ``pid``, waited for ``wait_s`` at most (an export
    process that outlives its traced process writes it as it ends)."""
    import glob
    import json
    import time

    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for path in glob.glob(os.path.join(str(trace), "losses", f"losses-*-pid{pid}*.json")):
            with open(path) as f:
                found.append(json.load(f))
        final = [loss for loss in found if loss["pid"] == pid and loss["final"]]
        if final or time.monotonic() > deadline:
            assert len(final) == 1, found
            return final[0]
        time.sleep(0.1)


def _written_by(trace, pid: int) -> dict:
    """What the files of process ``pid`` hold, whole lines only (its progress lines: the
    hour's file, which only the child writes here)."""
    import glob
    import json

    import fault_workload

    lines = fault_workload.file_lines(str(trace))  # checks that every file holds whole lines only
    named = lambda pattern: [n for path, n in lines["files"].items() if glob.fnmatch.fnmatch(path, pattern)]  # noqa: E731
    spans = []
    for path in glob.glob(os.path.join(str(trace), "otlp", f"spans-*-pid{pid}*.jsonl")):
        with open(path) as f:
            spans += fault_workload.otlp_spans([json.loads(line) for line in f])
    return {"csv": sum(named(f"*/sample/*-pid{pid}.csv")), "progress": len(lines["progress"]),
            "jsonl": sum(named(f"*/trajectory/trajectory_{pid}_*.jsonl")), "spans": len(spans),
            "trajectory_spans": sum(span["name"].startswith("invoke_agent ") for span in spans)}


@pytest.mark.parametrize("offload", ["0", "1"], ids=["own-outputs", "export-process"])
def test_a_multiprocessing_child_writes_all_it_traced_before_its_os_exit(tmp_path, offload):
    """multiprocessing ends its child by os._exit, past atexit: the child shuts its
    tracing down among multiprocessing's finalizers, its export process's outputs included."""
    pid = _run_forked_child(tmp_path, "multiprocessing", offload)
    loss = _final_loss_file(tmp_path, pid)
    assert loss["dropped"] == {} and loss["pending"] == {}, loss
    written = _written_by(tmp_path, pid)
    assert {kind: written[kind] for kind in PRODUCED} == PRODUCED


def test_a_bare_forked_child_ending_by_os_exit_has_its_spans_written_or_counted_by_its_export_process(tmp_path):
    """No hook runs at a bare os._exit: the child's own export process, which outlives it,
    writes the spans it was sent and counts the span ends the child had queued and never
    sent, in the child's own loss file."""
    pid = _run_forked_child(tmp_path, "fork", "1")
    loss = _final_loss_file(tmp_path, pid, wait_s=60)
    written = _written_by(tmp_path, pid)
    counted = loss["dropped"].get("offload", 0)
    assert set(loss["dropped"]) <= {"offload"}, loss
    assert written["spans"] + counted == PRODUCED["spans"], (written, loss)
    # a line or row is written of every span the export process got: what it did not get
    # is counted above, in spans (a trajectory's line is its span's)
    assert written["jsonl"] == written["trajectory_spans"]
    assert PRODUCED["jsonl"] - written["jsonl"] <= counted
    if counted == 0:
        assert {kind: written[kind] for kind in PRODUCED} == PRODUCED
