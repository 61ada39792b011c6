"""The background writer of the legacy files: every line is written or counted, its
thread outlives whatever one line holds, and files follow their paths."""

from __future__ import annotations

import json
import os
import shutil

from otel_verl import health
from otel_verl.exporters._writer import BackgroundWriter


def test_a_poisoned_line_among_good_ones_is_written_repaired_and_counted(tmp_path):
    path = str(tmp_path / "out.txt")
    writer = BackgroundWriter("test_output", linger_s=0.0)
    poisoned = json.loads('"tool\\ud800name"')  # a lone surrogate, as a model's JSON can hold
    assert writer.write(path, "good 1\n", 1)
    assert writer.flush(5)
    assert writer.write(path, f"bad {poisoned}\n", 1)
    assert writer.flush(5)
    assert writer.write(path, "good 2\n", 1)  # the thread goes on
    assert writer.flush(5)
    writer.close()
    with open(path, encoding="utf-8") as f:
        assert f.read() == "good 1\nbad tool\ufffdname\ngood 2\n"
    assert (writer.written_lines, writer.dropped_lines) == (3, 0)
    assert health.snapshot()["failures"] == {"test_output.lone_surrogate": 1}


def test_a_line_that_cannot_be_written_is_counted_and_the_thread_goes_on(tmp_path):
    def render(job):
        if job == "unrenderable":
            raise RuntimeError("render failed")
        return job

    writer = BackgroundWriter("test_output", linger_s=0.0, render=render)
    assert writer.write(str(tmp_path / "a.txt"), "before\n", 1)
    assert writer.flush(5)
    assert writer.submit("unrenderable", 2, 20)
    assert writer.write(str(tmp_path / "a.txt"), "after\n", 1)
    assert writer.flush(5)
    writer.close()
    assert (tmp_path / "a.txt").read_text() == "before\nafter\n"
    assert (writer.written_lines, writer.dropped_lines) == (2, 2)
    assert health.snapshot()["dropped"] == {"test_output": 2}


def lines_of(path) -> list:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def test_a_deleted_trace_dir_is_created_again_and_gets_every_later_line(tmp_path):
    path = tmp_path / "trace" / "sample" / "out.txt"
    writer = BackgroundWriter("test_output", linger_s=0.0)  # the default look-up interval
    assert writer.write(str(path), "before\n", 1)
    assert writer.flush(5)
    shutil.rmtree(tmp_path / "trace")  # a cleanup job
    accepted = 1 + sum(writer.write(str(path), f"after {i}\n", 1) for i in range(3))
    assert writer.flush(5)
    writer.close()
    assert lines_of(path) == ["after 0", "after 1", "after 2"]
    assert writer.written_lines + writer.dropped_lines == accepted
    assert writer.dropped_lines == 0 and health.snapshot()["dropped"] == {}


def test_a_renamed_file_keeps_its_lines_and_later_ones_go_to_its_path(tmp_path):
    path = tmp_path / "out.log"
    writer = BackgroundWriter("test_output", linger_s=0.0, reopen_check_s=0.0)
    assert writer.write(str(path), "before\n", 1)
    assert writer.flush(5)
    os.rename(path, tmp_path / "out.log.1")  # logrotate, a log shipper
    accepted = 1 + sum(writer.write(str(path), f"after {i}\n", 1) for i in range(3))
    assert writer.flush(5)
    writer.close()
    assert lines_of(tmp_path / "out.log.1") == ["before"]
    assert lines_of(path) == ["after 0", "after 1", "after 2"]
    assert writer.written_lines + writer.dropped_lines == accepted and writer.dropped_lines == 0


def test_a_file_replaced_at_its_path_is_followed(tmp_path):
    path = tmp_path / "out.log"
    writer = BackgroundWriter("test_output", linger_s=0.0, reopen_check_s=0.0)
    assert writer.write(str(path), "before\n", 1)
    assert writer.flush(5)
    os.rename(path, tmp_path / "old.log")
    path.write_text("made by someone else\n")
    assert writer.write(str(path), "after\n", 1)
    assert writer.flush(5)
    writer.close()
    assert lines_of(path) == ["made by someone else", "after"]
    assert lines_of(tmp_path / "old.log") == ["before"]


def test_a_path_is_looked_up_once_per_interval_not_per_line(tmp_path):
    path = tmp_path / "out.log"
    writer = BackgroundWriter("test_output", linger_s=0.0, reopen_check_s=3600.0)
    assert writer.write(str(path), "before\n", 1)
    assert writer.flush(5)
    os.rename(path, tmp_path / "out.log.1")
    assert writer.write(str(path), "within the interval\n", 1)  # still goes where the file went
    assert writer.flush(5)
    writer.reopen_check_s = 0.0  # as if the interval had passed
    assert writer.write(str(path), "after the interval\n", 1)
    assert writer.flush(5)
    writer.close()
    assert lines_of(tmp_path / "out.log.1") == ["before", "within the interval"]
    assert lines_of(path) == ["after the interval"]
    assert (writer.written_lines, writer.dropped_lines) == (3, 0)


def test_lines_for_a_path_that_cannot_be_recreated_are_counted_until_it_can(tmp_path):
    path = tmp_path / "trace" / "out.txt"
    writer = BackgroundWriter("test_output", linger_s=0.0)
    assert writer.write(str(path), "before\n", 1)
    assert writer.flush(5)
    shutil.rmtree(tmp_path / "trace")
    (tmp_path / "trace").write_text("a regular file where the directory was")
    assert writer.write(str(path), "lost\n", 1)
    assert writer.flush(5)
    (tmp_path / "trace").unlink()
    assert writer.write(str(path), "after\n", 1)  # the thread went on
    assert writer.flush(5)
    writer.close()
    assert lines_of(path) == ["after"]
    assert (writer.written_lines, writer.dropped_lines) == (2, 1)
    assert health.snapshot()["dropped"] == {"test_output": 1}


def test_close_counts_what_was_not_written_by_its_deadline(tmp_path, monkeypatch):
    """A disk that hangs: close returns at its deadline and counts the lines not written,
    the one in the hung write among them."""
    import threading
    import time

    from otel_verl.exporters import _writer

    release = threading.Event()
    real_append = _writer.append_whole

    def hanging_append(fd, data):
        release.wait(10)
        real_append(fd, data)

    monkeypatch.setattr(_writer, "append_whole", hanging_append)
    writer = BackgroundWriter("test_output", linger_s=0.0)
    path = str(tmp_path / "slow.txt")
    assert writer.write(path, "first\n", 1)
    time.sleep(0.2)  # the thread took the first line and hangs on the disk
    assert writer.write(path, "second\n", 1)
    assert writer.write(path, "third\n", 1)
    started = time.monotonic()
    writer.close(0.3)
    assert time.monotonic() - started < 2
    assert writer.dropped_lines == 3 and health.snapshot()["dropped"] == {"test_output": 3}
    release.set()  # the hung write fails on its closed file: counted once, by close
    writer._thread.join(5)
    assert writer.dropped_lines == 3 and health.snapshot()["dropped"] == {"test_output": 3}
