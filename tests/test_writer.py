"""The background writer of the legacy files: every line is written or counted, and its
thread outlives whatever one line holds."""

from __future__ import annotations

import json

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
    writer = BackgroundWriter("test_output", linger_s=0.0)
    assert writer.write(str(tmp_path / "a.txt"), "before\n", 1)
    assert writer.flush(5)

    def raising():
        raise RuntimeError("render failed")

    assert writer.submit(raising, 2)
    assert writer.write(str(tmp_path / "a.txt"), "after\n", 1)
    assert writer.flush(5)
    writer.close()
    assert (tmp_path / "a.txt").read_text() == "before\nafter\n"
    assert (writer.written_lines, writer.dropped_lines) == (2, 2)
    assert health.snapshot()["dropped"] == {"test_output": 2}

