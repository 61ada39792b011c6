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
